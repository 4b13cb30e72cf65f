#!/usr/bin/env bash
# ON THE GPU MACHINE (device run, repository root): every GPU-marked test, with the CPU tests of the
# same files. Data from scripts/prepare_device_data.sh: with .whisperdev present the Whisper engine
# tests run (tiny.en from the pack), with .devdata the Parakeet engine tests; .whl installs the
# pipeline's VAD. Logs under $OUT.
export PYTHONUNBUFFERED=1 PYTHONPATH=src:bench FLASHASR_SHARED=$PWD/.devdata/shared
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
OUT="${OUT:-/tmp/flashasr-out}"; mkdir -p "$OUT"
WHAT="${1:-all}"
if [ -d .whisperdev ] && [ "$WHAT" != parakeet ]; then
  FLASHASR_WHISPER_PACK=$PWD/.whisperdev timeout 280 python3 -m pytest -q -p no:cacheprovider -rs --durations=5 \
    tests/test_whisper_gpu.py > "$OUT/gpu_tests_whisper.txt" 2>&1
  tail -15 "$OUT/gpu_tests_whisper.txt"
fi
if [ -d .devdata ] && [ "$WHAT" != whisper ]; then
  timeout 500 python3 -m pytest -q -p no:cacheprovider -rs --durations=5 tests/test_engine_triton_norm.py \
    tests/test_engine_fuse.py tests/test_engine_fast_attention.py tests/test_engine_tdt.py tests/test_engine_features.py \
    tests/test_engine_profiles.py tests/test_engine_offline.py tests/test_engine_sweep.py tests/test_parakeet_gpu_asr.py \
    tests/test_stream_graphs.py tests/test_stream_encoder.py \
    > "$OUT/gpu_tests_parakeet.txt" 2>&1
  tail -25 "$OUT/gpu_tests_parakeet.txt"
fi
