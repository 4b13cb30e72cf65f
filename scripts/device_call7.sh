#!/usr/bin/env bash
# Device call 7: length sweep + fusion tests on the GPU; end-to-end benchmark with encoder fusions on vs off
# (same engine settings as call 6: cudnn_benchmark + channels-last subsampling convs).
export PYTHONUNBUFFERED=1 PYTHONPATH=src:bench FLASHASR_SHARED=$PWD/.devdata/shared
F="-W ignore::UserWarning"
if [ ! -f .devdata/speech16k.npz ] || [ ! -d .devdata/shared/fixtures/parakeet ]; then
  echo "devdata missing: rebuilding"; ls -la .devdata; timeout 40 python3 bench/bench_gpu_prepare_audio.py 2>&1 | tail -3
fi
echo '{"cudnn_benchmark": true, "conv_channels_last": true}' > /tmp/tune_on.json
echo '{"cudnn_benchmark": true, "conv_channels_last": true, "fuse": false}' > /tmp/tune_off.json
FLASHASR_TUNE=/tmp/tune_on.json timeout 60 python3 $F bench/bench_gpu_e2e.py --variants pipelined,sequential --name e2e_fuse_on 2>&1 | grep -v Warning | tail -4
FLASHASR_TUNE=/tmp/tune_off.json timeout 60 python3 $F bench/bench_gpu_e2e.py --variants pipelined,sequential --name e2e_fuse_off 2>&1 | grep -v Warning | tail -4
timeout 65 python3 -m pytest -q tests/test_engine_sweep.py tests/test_engine_fuse.py -p no:cacheprovider --durations=4 > $OUT/tests.txt 2>&1
grep -E "passed|failed|FAILED|Error|call " $OUT/tests.txt | tail -12
ls $OUT
