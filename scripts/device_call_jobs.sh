#!/usr/bin/env bash
# Device call (issues #4/#5/#6): the ParakeetGPUASR GPU tests, the offline jobs benchmark
# (scripts/device_jobs.sh) and the in-process reference for bench_serve's offline comparison.
# Carry: .whl .devjobs .devserve
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src:$PWD/bench FLASHASR_SHARED=$PWD/.devserve/shared
timeout 130 python3 -m pytest -q -p no:cacheprovider --durations=3 \
  tests/test_parakeet_gpu_asr.py::test_gpu_wrapper_equals_plain_model \
  tests/test_parakeet_gpu_asr.py::test_registry_wraps_parakeet_on_cuda > $OUT/tests_gpu_asr.txt 2>&1
tail -6 $OUT/tests_gpu_asr.txt
PYTHONPATH=/tmp/site:$PWD/.devjobs/site bash scripts/device_jobs.sh
timeout 150 python3 -W ignore bench/bench_serve.py --only-in-process --name serve_gpu_inproc \
  --model random:parakeet-tdt-0.6b-v3 --device cuda --max-batch 256 --clips .devserve/shared/audio/en \
  --clip-min-s 4 --clip-max-s 12 --offline-requests 2048 2>&1 | grep -v Warning | tail -3
cp -f bench/results/serve_gpu_inproc.json $OUT/ 2>/dev/null; ls $OUT
