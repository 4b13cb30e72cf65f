#!/usr/bin/env bash
# ON THE GPU MACHINE (device run, repository root): the offline job benchmark
# (bench/bench_offline_e2e.py: compressed files on disk -> transcripts on disk through run_job, the
# null-model ceiling and the in-memory engine, random:parakeet-tdt-0.6b-v3 on the GPU) with py-spy
# sampling every process of it (100 Hz, non-blocking: a few % of one core), then where the CPU time
# went per role (bench/profile_stacks.py). Carry: .whl (av, soxr, silero-vad, nvidia-ml-py, py-spy)
# and .devjobs (bench_offline_e2e.py prepare --out .devjobs/corpus; shared --out .devjobs/shared).
# Results under $OUT: offline_e2e_<TAG>.json, profile_jobs_<TAG>.txt (raw stacks) and .json.
set -u
TAG="${TAG:-h200}"
OUT="${OUT:-/tmp/flashasr-out}"; mkdir -p "$OUT"; export OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 FLASHASR_SHARED=$PWD/.devjobs/shared
nproc; nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
timeout "${LIMIT:-420}" /tmp/site/bin/py-spy record --subprocesses --threads --rate 100 --nonblocking --format raw \
  --output "$OUT/profile_jobs_$TAG.txt" -- python3 -W ignore bench/bench_offline_e2e.py run --corpus .devjobs/corpus \
  --hours "${HOURS:-3}" --model random:parakeet-tdt-0.6b-v3 --device cuda --batch-sizes default \
  --max-wall-s "${WALL:-330}" --tag "$TAG" --progress-s 20 ${EXTRA:-} 2>&1 | grep -v -i warning | tail -40
python3 bench/profile_stacks.py "$OUT/profile_jobs_$TAG.txt" --rate 100 --json-out "$OUT/profile_jobs_$TAG.json"
