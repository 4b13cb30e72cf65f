#!/usr/bin/env bash
# Device call (issue #5): serving benchmark on the H200 with the Parakeet-TDT 0.6B-v3-shaped model
# (random weights, joint calibrated on real speech at load). Carry: .whl (PyAV, soxr, FastAPI stack,
# websockets, uvicorn), .devserve (13 real clips of 4-11 s + the Parakeet YAMLs).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/bench PYTHONUNBUFFERED=1 FLASHASR_SHARED=$PWD/.devserve/shared
ulimit -n 65536
nproc; nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_parakeet_gpu_asr.py > $OUT/tests_gpu_asr.txt 2>&1
tail -3 $OUT/tests_gpu_asr.txt
timeout 480 python3 -W ignore bench/bench_serve.py --name serve_gpu --model random:parakeet-tdt-0.6b-v3 --device cuda \
  --mode multi --workers ${WORKERS:-6} --client-procs ${CLIENTS:-6} --max-batch 256 --batch-wait-ms 2 \
  --clips .devserve/shared/audio/en --clip-min-s 4 --clip-max-s 12 \
  --streams 100,1000 --packets 20,200 --extra ${EXTRA:-2000:200,4000:200,2000:20} --gc-compare 1000:20 \
  --offline-requests 2048 --offline-concurrency 256 --budget-s ${BUDGET:-470} 2>&1 | grep -v "Warning"
ls -la $OUT
