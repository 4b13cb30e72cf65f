#!/usr/bin/env bash
# ON THE GPU MACHINE (device run, repository root): issue #14's one-GPU benchmark -- the Ray Data job
# against the local job on the same compressed corpus, and `serve --ray` against `serve --mode multi`
# on the same uploads and streams, as ratios measured in the same run (bench/bench_ray.py), with the
# Parakeet-shaped model (random:parakeet-tdt-0.6b-v3) on CUDA. Results: $OUT/ray_gpu*.json.
#
# Ray's wheel is larger than one device call can carry, so the wheels travel in TWO PARTS, carried
# by two calls back to back (the machine stays warm in between: what the first call carried stays
# in the working tree there), then the benchmark runs in a third and fourth call:
#
#   HERE, once:  bash scripts/gpu_bench_stream.sh prepare # .whl (soxr, silero-vad, FastAPI stack), .whav (PyAV)
#                python bench/bench_offline_e2e.py prepare --out .devjobs/corpus --seconds 1050
#                python bench/bench_offline_e2e.py shared --out .devjobs/shared
#                bash scripts/prepare_ray_device.sh       # .rayw1 (ray wheel, part 1), .rayw2 (part 2 + deps)
#   device call 1: carry [".rayw1"]            command: bash scripts/gpu_bench_ray.sh part1
#   device call 2: carry [".rayw2"]            command: bash scripts/gpu_bench_ray.sh part2
#                  (joins the two parts into the wheel, installs Ray and its deps into /tmp/site-ray)
#   device call 2b: carry [".whav"]            command: bash scripts/gpu_bench_stream.sh av (PyAV: the
#                  corpus is compressed; .whav from `bash scripts/gpu_bench_stream.sh prepare`)
#   device call 3: carry [".whl", ".devjobs"]  command: bash scripts/gpu_bench_ray.sh jobs
#   device call 4: carry [".whl", ".devjobs"]  command: bash scripts/gpu_bench_ray.sh serve
#   (keep calls 3 and 4 apart: on 2026-12-02 the Ray job's GPU actor took ~110 s to start, so the corpus is
#    repeated 60 times (~25 h of audio, ~35 s for the local job) for the Ray job's output to stream after
#    its start-up and give a steady-state figure; the serve part is two server start-ups of ~125 s each
#    plus the loads)
# A call that finds a fresh machine (the last one went back) must start again at call 1.
set -u
STEP="${1:-all}"
OUT="${OUT:-/tmp/flashasr-out}"; mkdir -p "$OUT"; export OUT
case "$STEP" in
  part1)  # a carried folder does not stay for the next call (seen 2026-12-02): keep the part in /tmp
    mkdir -p /tmp/rayw1 && cp .rayw1/* /tmp/rayw1/ && ls -la /tmp/rayw1; exit $? ;;
  part2)
    [ -d /tmp/rayw1 ] || { echo "no /tmp/rayw1 here: run part 1 first, on the same warm machine"; exit 1; }
    mkdir -p /tmp/rayw && cat /tmp/rayw1/*.part-* .rayw2/*.part-* > "/tmp/rayw/$(basename /tmp/rayw1/*.part-00 .part-00)"
    cp .rayw2/*.whl /tmp/rayw/
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-ray \
      /tmp/rayw/*.whl || exit 1
    PYTHONPATH=/tmp/site-ray python3 -c "import ray, ray.data; print('ray', ray.__version__)"  # ray.serve needs .whl's pydantic
    exit $? ;;
esac
[ -d /tmp/site-ray/ray ] || { echo "Ray is not installed here: run parts 1 and 2 first (same warm machine)"; exit 1; }
[ -d /tmp/site/av ] || { echo "PyAV is not installed here: run scripts/gpu_bench_stream.sh av first (carry .whav)"; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:/tmp/site-ray:$PWD/src:$PWD/bench PYTHONUNBUFFERED=1 FLASHASR_SHARED=$PWD/.devjobs/shared
export RAY_DEDUP_LOGS=0 RAY_AUTH_MODE=disabled
nproc; nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
PARTS=jobs,serve; [ "$STEP" = jobs ] && PARTS=jobs; [ "$STEP" = serve ] && PARTS=serve
timeout "${LIMIT:-580}" python3 -W ignore bench/bench_ray.py --parts "$PARTS" --name "ray_gpu_${STEP}" \
  --model random:parakeet-tdt-0.6b-v3 --device cuda --corpus .devjobs/corpus --reps "${REPS:-60}" \
  --workers "${WORKERS:-6}" --max-batch 256 --client-procs "${CLIENTS:-6}" --clips .devjobs/shared/audio/en \
  --clip-min-s 4 --clip-max-s 12 --offline-requests "${REQS:-2048}" --offline-concurrency 256 \
  --streams "${STREAMS:-250}" 2>&1 | grep -v -i warning | tail -40
ls -la "$OUT"
