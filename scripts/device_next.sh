#!/usr/bin/env bash
# Next session, first device call (issue #4): correctness of the two encoder changes made without a
# GPU (rel-pos GEMM padded to a multiple of 8 -- default now; opt-in conv_nhwc fusion), then the
# end-to-end benchmark with and without conv_nhwc. Carry: .devdata (speech16k.npz + fixtures;
# rebuild with bench/bench_gpu_prepare_audio.py). Then run scripts/device_nemo.sh (its own carry).
export PYTHONUNBUFFERED=1 PYTHONPATH=src:bench FLASHASR_SHARED=$PWD/.devdata/shared
F="-W ignore::UserWarning"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_engine_fuse.py tests/test_engine_fast_attention.py \
  tests/test_engine_sweep.py tests/test_engine_offline.py > $OUT/tests.txt 2>&1; tail -4 $OUT/tests.txt
echo '{"cudnn_benchmark": true, "conv_channels_last": true}' > /tmp/tune_base.json
echo '{"cudnn_benchmark": true, "conv_channels_last": true, "fuse": ["bn_fold", "conv_pad", "inplace", "sub_masks", "conv_nhwc"]}' > /tmp/tune_nhwc.json
FLASHASR_TUNE=/tmp/tune_base.json timeout 150 python3 $F bench/bench_gpu_e2e.py --variants pipelined,sequential --name e2e_relpos_pad 2>&1 | grep -v Warning | tail -4
FLASHASR_TUNE=/tmp/tune_nhwc.json timeout 150 python3 $F bench/bench_gpu_e2e.py --variants pipelined,sequential --name e2e_conv_nhwc 2>&1 | grep -v Warning | tail -4
FLASHASR_TUNE=/tmp/tune_base.json timeout 90 python3 $F bench/bench_gpu_kernels.py 2>&1 | grep -v Warning | head -60
ls $OUT
