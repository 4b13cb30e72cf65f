#!/usr/bin/env bash
# Device call 1: probe, GPU tests of the TDT decoder, decoder benchmark.
export PYTHONUNBUFFERED=1 PYTHONPATH=src:bench FLASHASR_SHARED=$PWD/.devdata/shared
bash scripts/device_probe.sh 2>&1 | tee $OUT/probe.txt
timeout 200 python3 -m pytest -q tests/test_engine_tdt.py -p no:cacheprovider > $OUT/tests.txt 2>&1; tail -25 $OUT/tests.txt
timeout 300 python3 bench/bench_gpu_decoder.py 2>&1 | tee $OUT/bench_decoder.txt
