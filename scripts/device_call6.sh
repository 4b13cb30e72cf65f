#!/usr/bin/env bash
# Device call 6 (final): engine GPU tests, encoder profile + settings, encoder / e2e / decoder benchmarks.
export PYTHONUNBUFFERED=1 PYTHONPATH=src:bench FLASHASR_SHARED=$PWD/.devdata/shared
F="-W ignore::UserWarning"
timeout 120 python3 -m pytest -q tests/test_engine_tdt.py tests/test_engine_features.py tests/test_engine_profiles.py \
  tests/test_engine_offline.py tests/test_engine_fast_attention.py -p no:cacheprovider > $OUT/tests.txt 2>&1; grep -E "passed|failed|FAILED|Error" $OUT/tests.txt | tail -8
timeout 100 python3 $F bench/bench_gpu_profile.py 2>&1 | grep -v Warning
[ -f $OUT/tune.json ] && export FLASHASR_TUNE=$OUT/tune.json
timeout 120 python3 $F bench/bench_gpu_encoder.py 2>&1 | grep -v Warning | tail -11
timeout 150 python3 $F bench/bench_gpu_e2e.py --variants sequential,pipelined 2>&1 | grep -v Warning | tail -4
timeout 90 python3 $F bench/bench_gpu_decoder.py 2>&1 | grep -v Warning | tail -19
ls $OUT
