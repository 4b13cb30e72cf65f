#!/usr/bin/env bash
# NeMo peer benchmark (issue #4): NVIDIA NeMo 3.0.0's own Parakeet-TDT inference vs our engine on
# the same random-weight 0.6B-v3 model (bench/bench_gpu_nemo_peer.py). docs/NEMO_PEER.md explains
# the wheel set.
#
#   bash scripts/gpu_bench_nemo_peer.sh fetch   # HERE (needs PyPI): wheels for CPython 3.12 x86-64 -> .whl-nemo/ (13.5 MiB)
#   bash scripts/gpu_bench_nemo_peer.sh         # ON THE GPU MACHINE (device run), with
#       carry: [".whl-nemo", ".devdata/speech16k.npz", ".devdata/shared/fixtures/parakeet/parakeet-tdt-0.6b-v3.yaml"]
#       (.devdata/speech16k.npz comes from bench/bench_gpu_prepare_audio.py; all together ~48 MiB with the repo)
#
# The GPU image already holds torch, numpy, scipy, pandas, numba, sentencepiece, transformers,
# torchmetrics, huggingface-hub, pyarrow, fsspec, ... (KINDS.md); only what it lacks travels, plus
# lightning 2.4.0, which SHADOWS the image's lightning 2.6: NeMo 3.0.0 pins lightning<=2.4.0, and with
# 2.6 its nv_one_logger Trainer subclass fails an `overrides` signature check at import time.
set -o pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "fetch" ]; then
  mkdir -p .whl-nemo
  . scripts/device_prep.sh
  ignore_here .whl-nemo
  plat="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
        --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any"
  # shellcheck disable=SC2086
  python3 -m pip download -q --no-deps $plat -d .whl-nemo \
    nemo-toolkit==3.0.0 hydra-core==1.3.2 omegaconf==2.3.0 lightning==2.4.0 \
    nv-one-logger-core==2.3.1 nv-one-logger-training-telemetry==2.3.1 nv-one-logger-pytorch-lightning-integration==2.3.1 \
    StrEnum==0.4.15 overrides==7.7.0 toml==0.10.2 \
    pydantic==2.11.7 pydantic-core==2.33.2 annotated-types==0.8.0 typing-inspection==0.4.5 \
    lhotse==1.33.0 soundfile==0.14.0 cffi==2.1.1 pycparser==3.12 intervaltree==3.2.1 cytoolz==1.2.0 audioread==3.1.0 \
    kaldialign==0.12.0 librosa==0.11.0 decorator==5.3.1 pooch==1.9.0 soxr==1.1.0 platformdirs==4.14.8 \
    braceexpand==0.1.7 webdataset==1.0.2 datasets==5.2.0 multiprocess==0.70.19 dill==0.4.1 || exit 1
  # omegaconf/hydra need antlr4 4.9.x, published only as a source archive: build its pure-Python wheel
  python3 -m pip wheel -q --no-deps --no-binary=:all: -w .whl-nemo antlr4-python3-runtime==4.9.3 || exit 1
  ls .whl-nemo | wc -l; du -ch .whl-nemo/*.whl | tail -1
  exit 0
fi

export PYTHONUNBUFFERED=1
[ -d .whl-nemo ] || { echo ".whl-nemo missing: run 'bash scripts/gpu_bench_nemo_peer.sh fetch' here and carry .whl-nemo"; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-nemo/*.whl \
  || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site:src:bench
# image versions the wheel set relies on (datasets: pyarrow>=24, fsspec<=2026.9.0, huggingface-hub>=1.31;
# pydantic 2.11: typing-extensions>=4.12.2)
python3 -m pip list 2>/dev/null | grep -i -E "^(torch|numpy|numba|numba-cuda|fsspec|pyarrow|typing.extensions|lightning|pytorch-lightning|cuda-bindings|huggingface-hub|transformers|sentencepiece|scipy) " \
  | tee "${OUT:-/tmp}/nemo_peer_versions.txt"
echo '{"cudnn_benchmark": true, "conv_channels_last": true}' > /tmp/tune_nemo_peer.json
FLASHASR_TUNE=/tmp/tune_nemo_peer.json timeout 540 python3 -W ignore bench/bench_gpu_nemo_peer.py --time-budget 480 "$@" 2>&1 \
  | grep -v -E "Warning|warnings.warn" | tee "${OUT:-/tmp}/nemo_peer.txt"
ls "${OUT:-/tmp}"
