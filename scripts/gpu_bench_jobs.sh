#!/usr/bin/env bash
# The offline job benchmark (issue #12): compressed files on disk -> transcripts on disk through run_job
# with random:parakeet-tdt-0.6b-v3, the null-model CPU path, one format alone (44.1 kHz mp3: its stage
# costs), the in-memory engine.
#
# HERE (the CPU machine, repository root, PyPI reachable), once:
#   bash scripts/gpu_bench_jobs.sh prepare
#     .whj/      the wheels the job needs on the device's CPython 3.12 (PyAV, soxr, silero-vad,
#                sentencepiece, PyYAML: about 48 MB; the device tool carries at most 64 MiB a call)
#     .devjobs/  the corpus (bench_offline_e2e.py prepare: 97 files, 18 min, ~5 MB) and what
#                random:NAME needs from the shared folder (calibration clips, Parakeet YAMLs)
# DEVICE (carry [".whj", ".devjobs"], plus the earlier tree's folder for an A/B):
#   bash scripts/gpu_bench_jobs.sh                  # this tree; results: $OUT/offline_e2e_<TAG>.json
#   BEFORE_SRC=.before/src bash scripts/gpu_bench_jobs.sh   # then that tree the same way (its TAG + _before)
# Env: TAG (h200), HOURS (3), WALL (s per run, 270), LIMIT (s per run, 300), MODEL_PROCESS (1: the model in a
# process of its own, the CUDA default of `flashasr transcribe`), EXTRA (more bench_offline_e2e.py arguments).
# A tree on PYTHONPATH wins over the checkout's src in bench_offline_e2e.py, so BEFORE_SRC runs that tree.
set -u
cd "$(dirname "$0")/.."
if [ "${1:-}" = prepare ]; then
  set -e
  . scripts/device_prep.sh
  ignore_here .whj .devjobs
  device_wheels .whj av soxr silero-vad sentencepiece PyYAML
  [ -d .devjobs/corpus ] || python bench/bench_offline_e2e.py prepare --out .devjobs/corpus
  python bench/bench_offline_e2e.py shared --out .devjobs/shared
  du -sh .whj .devjobs
  exit 0
fi
TAG="${TAG:-h200}"
OUT="${OUT:-/tmp/flashasr-out}"; mkdir -p "$OUT"; export OUT
[ -d /tmp/site/av ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whj/*.whl || exit 1
export PYTHONUNBUFFERED=1 FLASHASR_SHARED=$PWD/.devjobs/shared
nproc; nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
ARGS=(run --corpus .devjobs/corpus --hours "${HOURS:-3}" --model random:parakeet-tdt-0.6b-v3 --device cuda
      --batch-sizes default --format-phases mp3-44k --max-wall-s "${WALL:-270}" --progress-s 30)
[ "${MODEL_PROCESS:-1}" = 1 ] && ARGS+=(--model-process)
run() {  # $1: src folder, $2: tag
  PYTHONPATH=/tmp/site:$1 timeout "${LIMIT:-300}" python3 -W ignore bench/bench_offline_e2e.py "${ARGS[@]}" \
    --tag "$2" --json-out "$OUT/offline_e2e_$2.json" ${EXTRA:-} 2>&1 | grep -v -i warning | tail -30
}
run "$PWD/src" "$TAG"
[ -n "${BEFORE_SRC:-}" ] && run "$PWD/$BEFORE_SRC" "${TAG}_before"
exit 0
