#!/usr/bin/env bash
# Device call 3: engine GPU tests, end-to-end and encoder benchmarks, torch.compile probe.
export PYTHONUNBUFFERED=1 PYTHONPATH=src:bench FLASHASR_SHARED=$PWD/.devdata/shared
F="-W ignore::UserWarning"
timeout 150 python3 -m pytest -q tests/test_engine_tdt.py tests/test_engine_features.py tests/test_engine_profiles.py \
  tests/test_engine_offline.py -p no:cacheprovider > $OUT/tests.txt 2>&1; grep -E "passed|failed|FAILED|Error" $OUT/tests.txt | tail -12
timeout 220 python3 $F bench/bench_gpu_e2e.py 2>&1 | grep -v Warning | tee $OUT/bench_e2e.txt
timeout 150 python3 $F bench/bench_gpu_encoder.py 2>&1 | grep -v Warning | tee $OUT/bench_encoder.txt
timeout 100 python3 $F bench/bench_gpu_encoder.py --compile --seconds 5 --batches 64 --reps 5 --name encoder_compile 2>&1 | grep -v Warning | tail -4 | tee $OUT/bench_encoder_compile.txt
ls $OUT
