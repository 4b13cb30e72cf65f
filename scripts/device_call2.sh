#!/usr/bin/env bash
# Device call 2: WHILE-node diagnostic, GPU tests of the TDT decoder, decoder benchmark.
export PYTHONUNBUFFERED=1 PYTHONPATH=src:bench FLASHASR_SHARED=$PWD/.devdata/shared
timeout 60 python3 bench/bench_gpu_whilediag.py 2>&1 | grep -v Warning | tee $OUT/whilediag.txt
timeout 200 python3 -m pytest -q tests/test_engine_tdt.py -p no:cacheprovider > $OUT/tests.txt 2>&1; tail -4 $OUT/tests.txt
timeout 300 python3 bench/bench_gpu_decoder.py 2>&1 | grep -v Warning | tee $OUT/bench_decoder.txt
