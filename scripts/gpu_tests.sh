#!/usr/bin/env bash
# Issue #4: every Parakeet engine test on the H200 (GPU-marked and CPU ones in the same files),
# after the fusions. Carry: .devdata (fixtures + the shared/audio/en clips the tests read).
export PYTHONUNBUFFERED=1 PYTHONPATH=src:bench FLASHASR_SHARED=$PWD/.devdata/shared
timeout 500 python3 -m pytest -q -p no:cacheprovider -rs --durations=5 tests/test_engine_triton_norm.py tests/test_engine_fuse.py \
  tests/test_engine_fast_attention.py tests/test_engine_tdt.py tests/test_engine_features.py tests/test_engine_profiles.py \
  tests/test_engine_offline.py tests/test_engine_sweep.py tests/test_parakeet_gpu_asr.py > $OUT/gpu_tests.txt 2>&1
tail -25 $OUT/gpu_tests.txt
