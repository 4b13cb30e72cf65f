#!/usr/bin/env bash
# Issue #4, last device call: engine tests after the review fixes + one end-to-end check.
# Carry: .devdata.
export PYTHONUNBUFFERED=1 PYTHONPATH=src:bench FLASHASR_SHARED=$PWD/.devdata/shared
timeout 230 python3 -m pytest -q -p no:cacheprovider tests/test_engine_triton_norm.py tests/test_engine_fuse.py \
  tests/test_engine_fast_attention.py tests/test_engine_sweep.py tests/test_parakeet_gpu_asr.py tests/test_engine_offline.py \
  > $OUT/final_tests.txt 2>&1; tail -3 $OUT/final_tests.txt
echo '{"cudnn_benchmark": true, "conv_channels_last": true}' > /tmp/tune.json
FLASHASR_TUNE=/tmp/tune.json timeout 100 python3 -W ignore bench/bench_gpu_e2e.py --runs 5 --variants pipelined,pipelined_fit --name e2e_final 2>&1 | grep -v Warning | tail -3
