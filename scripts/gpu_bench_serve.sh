#!/usr/bin/env bash
# Device call (issue #5): serving benchmark on the H200 with the Parakeet-TDT 0.6B-v3-shaped model
# (random weights, joint calibrated on real speech at load). Carry: .whl (PyAV, soxr, FastAPI stack,
# websockets, uvicorn), .devserve (real clips of 4-11 s + the Parakeet YAMLs + the tiny NeMo fixture).
# The in-process reference on the same clips runs in the jobs call (bench_serve.py --only-in-process).
#
#   bash scripts/gpu_bench_serve.sh uploads    # issue #12's server target alone: 2,048 uploads (4-12 s clips)
#     with 256 in flight through `serve --mode multi` (aiohttp client, REP runs, default 3), then the same
#     clips in process (bench_serve.py --only-in-process), on one machine; with BEFORE_SRC (another tree's
#     src folder, e.g. `git archive <commit> src | tar -x -C .before`) that tree's server runs right after
#     this one's. Carry .whl and .devstream (scripts/gpu_bench_stream.sh prepare; .devserve also works).
#     JSON: serve_<card>_uploads{,_before,_inproc}.json under $OUT. About 100 s a server start, 60 s in process.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
DATA=.devserve; [ -d "$DATA" ] || DATA=.devstream
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/bench PYTHONUNBUFFERED=1 FLASHASR_SHARED=$PWD/$DATA/shared
nproc; nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
if [ "${1:-}" = uploads ]; then
  case "$(nvidia-smi --query-gpu=name --format=csv,noheader)" in *H200*) CARD=h200 ;; *H100*) CARD=h100 ;; *) CARD=gpu ;; esac
  C=(--model random:parakeet-tdt-0.6b-v3 --device cuda --mode multi --workers "${WORKERS:-6}" --client-procs 6
     --max-batch 256 --batch-wait-ms 2 --clips "$DATA/shared/audio/en" --clip-min-s 4 --clip-max-s 12 --streams ""
     --extra "" --offline-requests 2048 --offline-concurrency 256 --offline-clients aiohttp --offline-repeats "${REP:-3}")
  one() {  # $1: src folder, $2: wall limit (s), $3: JSON name, then bench_serve.py arguments
    PYTHONPATH=/tmp/site:$1:$PWD/bench timeout "$2" python3 -W ignore bench/bench_serve.py "${C[@]}" --name "$3" \
      "${@:4}" 2>&1 | grep -v -i warning | tail -12
  }
  one "$PWD/src" 200 "serve_${CARD}_uploads" --no-in-process --budget-s 195
  [ -n "${BEFORE_SRC:-}" ] && one "$PWD/$BEFORE_SRC" 200 "serve_${CARD}_uploads_before" --no-in-process --budget-s 195
  one "$PWD/src" 150 "serve_${CARD}_uploads_inproc" --only-in-process --budget-s 145
  exit 0
fi
timeout 575 python3 -W ignore bench/bench_serve.py --name ${NAME:-serve_gpu} --model random:parakeet-tdt-0.6b-v3 --device cuda \
  --mode multi --workers ${WORKERS:-6} --client-procs ${CLIENTS:-6} --max-batch 256 --batch-wait-ms 2 \
  --clips .devserve/shared/audio/en --clip-min-s 4 --clip-max-s 12 \
  --streams ${STREAMS:-100,500,1000,250,750} --packets 20 --extra ${EXTRA:-1000:200,1000:20:1000,2000:200:1000} \
  --gc-compare ${GC:-500:20,1000:20} --offline-requests 2048 --offline-concurrency 256 --no-in-process \
  --offline-clients aiohttp,httpx --offline-repeats 3 \
  --budget-s ${BUDGET:-560} 2>&1 | grep -v "Warning"
ls -la $OUT
