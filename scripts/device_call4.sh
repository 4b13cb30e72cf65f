#!/usr/bin/env bash
# Device call 4: engine GPU tests, end-to-end variants, compiled variant (time-guarded).
export PYTHONUNBUFFERED=1 PYTHONPATH=src:bench FLASHASR_SHARED=$PWD/.devdata/shared
F="-W ignore::UserWarning"
timeout 150 python3 -m pytest -q tests/test_engine_tdt.py tests/test_engine_features.py tests/test_engine_profiles.py \
  tests/test_engine_offline.py -p no:cacheprovider > $OUT/tests.txt 2>&1; grep -E "passed|failed|FAILED|Error" $OUT/tests.txt | tail -12
timeout 200 python3 $F bench/bench_gpu_e2e.py 2>&1 | grep -v Warning | tee $OUT/bench_e2e.txt
timeout 280 python3 $F bench/bench_gpu_e2e.py --variants pipelined_fit_compiled --runs 2 --name e2e_compiled 2>&1 | grep -v Warning | tee $OUT/bench_e2e_compiled.txt
ls $OUT
