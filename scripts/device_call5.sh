#!/usr/bin/env bash
# Device call 5: engine GPU tests, encoder profile + settings trial, encoder and e2e benchmarks with the best settings.
export PYTHONUNBUFFERED=1 PYTHONPATH=src:bench FLASHASR_SHARED=$PWD/.devdata/shared
F="-W ignore::UserWarning"
timeout 120 python3 -m pytest -q tests/test_engine_tdt.py tests/test_engine_features.py tests/test_engine_profiles.py \
  tests/test_engine_offline.py -p no:cacheprovider > $OUT/tests.txt 2>&1; grep -E "passed|failed|FAILED|Error" $OUT/tests.txt | tail -8
timeout 120 python3 $F bench/bench_gpu_profile.py 2>&1 | grep -v Warning | tee $OUT/profile.txt
[ -f $OUT/tune.json ] && export FLASHASR_TUNE=$OUT/tune.json
timeout 130 python3 $F bench/bench_gpu_encoder.py 2>&1 | grep -v Warning | tail -14 | tee $OUT/bench_encoder.txt
timeout 170 python3 $F bench/bench_gpu_e2e.py --variants sequential,pipelined 2>&1 | grep -v Warning | tail -9 | tee $OUT/bench_e2e.txt
ls $OUT
