#!/usr/bin/env bash
# Device call (issue #5): serving benchmark on the H200 with the Parakeet-TDT 0.6B-v3-shaped model
# (random weights, joint calibrated on real speech at load). Carry: .whl (PyAV, soxr, FastAPI stack,
# websockets, uvicorn), .devserve (real clips of 4-11 s + the Parakeet YAMLs + the tiny NeMo fixture).
# The in-process reference on the same clips runs in the jobs call (bench_serve.py --only-in-process).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/bench PYTHONUNBUFFERED=1 FLASHASR_SHARED=$PWD/.devserve/shared
nproc; nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
timeout 575 python3 -W ignore bench/bench_serve.py --name ${NAME:-serve_gpu} --model random:parakeet-tdt-0.6b-v3 --device cuda \
  --mode multi --workers ${WORKERS:-6} --client-procs ${CLIENTS:-6} --max-batch 256 --batch-wait-ms 2 \
  --clips .devserve/shared/audio/en --clip-min-s 4 --clip-max-s 12 \
  --streams ${STREAMS:-100,500,1000,250,750} --packets 20 --extra ${EXTRA:-1000:200,1000:20:1000,2000:200:1000} \
  --gc-compare ${GC:-500:20,1000:20} --offline-requests 2048 --offline-concurrency 256 --no-in-process \
  --offline-clients aiohttp,httpx --offline-repeats 3 \
  --budget-s ${BUDGET:-560} 2>&1 | grep -v "Warning"
ls -la $OUT
