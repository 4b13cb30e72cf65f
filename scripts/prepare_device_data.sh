#!/usr/bin/env bash
# HERE (the CPU machine, repository root, PyPI reachable): the data the GPU scripts carry to the
# device machine, in folders .git/info/exclude ignores (the device tool's 64 MiB carry limit is why
# they are split in two):
#   .whisperdev/     real tiny.en weights (int8 matrices, one scale per row) + the English clips +
#                    tokenizers (bench/bench_gpu_whisper.py prepare; 44 MiB)
#   .whl/            wheels the device image lacks: silero-vad (the pipeline's VAD; onnxruntime is
#                    there) and soxr (12 MiB)
#   .devdata/shared  the Parakeet fixtures + the 16 kHz WAV clips of shared/audio/en the tests read
#                    (the device has no audio decoder; 9 MiB)
# Then: device call 1 carries .whisperdev and .whl, call 2 (machine still warm: the first call's
# folders stay) carries .devdata; both run `bash scripts/gpu_tests.sh` (scripts/gpu_tests.sh says
# which tests each runs).
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED="${FLASHASR_SHARED:-../shared}"
. scripts/device_prep.sh
ignore_here .whl .devdata .whisperdev
[ -d .whisperdev ] || python bench/bench_gpu_whisper.py prepare --pack .whisperdev
mkdir -p .whl
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl silero-vad==6.2.3 soxr==1.1.0
mkdir -p .devdata/shared/audio
rm -rf .devdata/shared/fixtures .devdata/shared/audio/en
cp -r "$SHARED/fixtures" .devdata/shared/fixtures
mkdir -p .devdata/shared/audio/en && cp "$SHARED"/audio/en/*.wav .devdata/shared/audio/en/
cp "$SHARED/audio/manifest.jsonl" .devdata/shared/audio/
du -sh .whisperdev .whl .devdata
