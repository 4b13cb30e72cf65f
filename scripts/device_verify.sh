#!/usr/bin/env bash
# Issue #4, device call after the fusions: ParakeetGPUASR tests (engine == plain model, float32),
# the NeMo peer with the fused engine, and a second end-to-end run (5 runs) for a stable median.
# Carry: .devdata (with shared/audio/en clips the tests read), .whl-nemo.
export PYTHONUNBUFFERED=1 PYTHONPATH=src:bench FLASHASR_SHARED=$PWD/.devdata/shared
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_parakeet_gpu_asr.py > $OUT/tests_asr.txt 2>&1; tail -3 $OUT/tests_asr.txt
bash scripts/device_nemo.sh 2>&1 | sed -n '/ path /,$p'
echo '{"cudnn_benchmark": true, "conv_channels_last": true}' > /tmp/tune.json
FLASHASR_TUNE=/tmp/tune.json timeout 150 python3 -W ignore bench/bench_gpu_e2e.py --runs 5 --variants pipelined,sequential --name e2e_runs5 2>&1 | grep -v Warning | tail -4
