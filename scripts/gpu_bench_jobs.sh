#!/usr/bin/env bash
# ON THE GPU MACHINE (device run, repository root): the offline job benchmark (issue #12):
# compressed files on disk -> transcripts on disk through run_job with random:parakeet-tdt-0.6b-v3,
# the null-model CPU path, one format alone (44.1 kHz mp3: its stage costs), the in-memory engine.
# Carry: .whl (PyAV, soxr, silero-vad, py-spy, the FastAPI stack) and .devjobs (bench_offline_e2e.py
# prepare --out .devjobs/corpus; shared --out .devjobs/shared). Results: $OUT/offline_e2e_<TAG>.json.
set -u
TAG="${TAG:-h200}"
OUT="${OUT:-/tmp/flashasr-out}"; mkdir -p "$OUT"; export OUT
[ -d /tmp/site/av ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 FLASHASR_SHARED=$PWD/.devjobs/shared
nproc; nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
timeout "${LIMIT:-300}" python3 -W ignore bench/bench_offline_e2e.py run --corpus .devjobs/corpus --hours "${HOURS:-3}" \
  --model random:parakeet-tdt-0.6b-v3 --device cuda --batch-sizes default --format-phases mp3-44k \
  --max-wall-s "${WALL:-270}" --tag "$TAG" --progress-s 30 ${EXTRA:-} 2>&1 | grep -v -i warning | tail -30
