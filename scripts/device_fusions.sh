#!/usr/bin/env bash
# Issue #4, device call: the add+LayerNorm kernel (Triton), fused q/k/v attention and the
# conv_nhwc default, checked then measured: GPU tests, kernel census, encoder profiles (batch 1
# and 64), end to end. Carry: .devdata (speech16k.npz + fixtures; bench/bench_gpu_prepare_audio.py).
export PYTHONUNBUFFERED=1 PYTHONPATH=src:bench FLASHASR_SHARED=$PWD/.devdata/shared
F="-W ignore::UserWarning"
echo '{"cudnn_benchmark": true, "conv_channels_last": true}' > /tmp/tune.json
export FLASHASR_TUNE=/tmp/tune.json
timeout 200 python3 -m pytest -q -p no:cacheprovider -x tests/test_engine_triton_norm.py tests/test_engine_fuse.py \
  tests/test_engine_fast_attention.py tests/test_engine_sweep.py tests/test_engine_offline.py tests/test_parakeet_gpu_asr.py \
  > $OUT/tests.txt 2>&1; tail -4 $OUT/tests.txt
timeout 80 python3 $F bench/bench_gpu_kernels.py --name kernels_fused 2>&1 | grep -v Warning | head -40
timeout 150 python3 $F bench/bench_gpu_encoder.py 2>&1 | grep -v Warning | tail -12
timeout 140 python3 $F bench/bench_gpu_e2e.py --variants pipelined,sequential --name e2e 2>&1 | grep -v Warning | tail -4
ls $OUT
