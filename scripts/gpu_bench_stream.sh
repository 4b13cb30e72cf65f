#!/usr/bin/env bash
# Issue 13 (streaming at scale) on the H200: bench/bench_stream_scale.py with the Parakeet-TDT 0.6B-v3
# shapes (random weights, joint calibrated on real speech at load; ParakeetGPUASR + GraphedStreamer).
#
# HERE (the CPU machine, repository root, PyPI reachable), once:
#   bash scripts/gpu_bench_stream.sh prepare
#     .whl/        wheels the serving path needs, for the device's CPython 3.12, pinned to the versions
#                  installed here (fastapi/starlette/uvicorn/uvloop/websockets/httpx stack, pydantic,
#                  prometheus-client, python-multipart, soxr, silero-vad, sentencepiece, PyYAML); a wheel
#                  the device already has is simply shadowed by the same version
#     .devstream/  shared/fixtures (Parakeet YAMLs + the tiny NeMo fixture) and the 16 kHz WAV clips of
#                  shared/audio/en (the device has no audio decoder; about 9 MiB)
# DEVICE (carry [".whl", ".devstream"]; one call per phase, each <= 575 s):
#   bash scripts/gpu_bench_stream.sh cost       # device s per stream-s for 5/30/120 s utterances, counted
#                                               # encoder work, chunked vs re-encoded partials; drift
#   bash scripts/gpu_bench_stream.sh scale500   # 1,000 / 2,000 streams at a 500 ms cadence, manual commits
#                                               # and server VAD, then the most streams held (+1,000 steps)
#   bash scripts/gpu_bench_stream.sh scale1000  # the same at a 1 s cadence (aim >= 4,000)
#   bash scripts/gpu_bench_stream.sh ab2000     # the A/B run of the ninth to eleventh sessions: 2,000 streams at
#                                               # 500 ms, utterances uniform over 4-12 s, manual commits, no
#                                               # search (BUDGET 255: ~290 s with the server's start-up); name
#                                               # each variant with NAME and SERVER_ARGS, e.g.
#                                               # NAME=_old SERVER_ARGS="--final-wait-max-ms 0"
#   bash scripts/gpu_bench_stream.sh startup    # where the server model's start-up goes: per serving profile
#                                               # the encoder and decoder captures and the replay time, cuDNN's
#                                               # autotuner on and off (bench/profile_engine_startup.py, ~4 min)
#   bash scripts/gpu_bench_stream.sh final      # issue #17: a stream final and a short upload under 32 x 600 s
#                                               # uploads (bench_final_latency.py; MODE multi|single); the
#                                               # server decodes uploads with PyAV, which does not fit beside
#                                               # .whl: carry [".whav"] in a call just before (machine warm),
#                                               # command `bash scripts/gpu_bench_stream.sh av`
# Env: WORKERS (front ends, 6), CLIENTS (client processes, 8), PACKET (ms, 20), LEFT (left context s, 5.12:
# 6.4 MB of state per stream, 8,000 streams = 51 GB), STREAMS, MAXSTREAMS, BUDGET, VAD (off|on|both),
# FINDMAX (1: then search for the most streams held), PROFILE=1 (the server under py-spy: raw stacks under
# $OUT, a table by role in the JSON's "profiles"; .whl needs py-spy), NAME (a suffix of the JSON's name),
# LENGTHS (clips|uniform|clips,uniform: utterance lengths, see the benchmark's --lengths),
# EXTRA (more bench_stream_scale.py arguments, split on spaces), SERVER_ARGS (the server's own options, e.g.
# "--stream-buckets-per-octave 4 --final-wait-ms 35": passed as one --server-args).
# JSON: bench/results/stream_scale_<card>_<phase>.json (and under $OUT); <card>: h200, h100 (from nvidia-smi) or gpu.
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = prepare ]; then
  set -e
  SHARED="${FLASHASR_SHARED:-../shared}"
  . scripts/device_prep.sh
  ignore_here .whl .whav .devstream
  device_wheels .whl fastapi opentelemetry-api starlette uvicorn uvloop websockets httpx httpcore h11 anyio sniffio idna \
    certifi pydantic pydantic_core annotated-types typing_extensions typing-inspection prometheus_client python-multipart \
    soxr silero-vad sentencepiece PyYAML httptools aiohttp multidict yarl frozenlist aiosignal propcache aiohappyeyeballs attrs
  rm -rf .whav && device_wheels .whav av
  rm -rf .devstream && mkdir -p .devstream/shared/audio/en
  cp -r "$SHARED/fixtures" .devstream/shared/fixtures
  cp "$SHARED"/audio/en/*.wav .devstream/shared/audio/en/
  cp "$SHARED/audio/manifest.jsonl" .devstream/shared/audio/
  # the long recording bench_final_latency.py uploads, as 16 kHz WAV (no audio decoder over there)
  mkdir -p .devstream/shared/audio/long
  PYTHONPATH=src python -c "import sys, numpy as np, wave; from flashasr.audio import load_audio
x = load_audio(sys.argv[1]).samples; w = wave.open(sys.argv[2], 'wb'); w.setnchannels(1); w.setsampwidth(2)
w.setframerate(16000); w.writeframes((np.clip(x, -1, 1) * 32767).astype('<i2').tobytes()); w.close()" \
    "$SHARED/audio/long/long-en-voxpopuli-000.ogg" .devstream/shared/audio/long/long-en-voxpopuli-000.wav
  du -sh .whl .whav .devstream
  exit 0
fi
if [ "${1:-}" = av ]; then  # PyAV alone, into the same /tmp/site (the next call's .whl install keeps it)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whav/*.whl
  exit $?
fi
case "${1:-cost}" in
  cost|scale500|scale1000|ab2000|startup|final) ;;
  *) echo "usage: $0 prepare | av | cost | scale500 | scale1000 | ab2000 | startup | final"; exit 2 ;;
esac
if ! ls .whl/*.whl >/dev/null 2>&1; then
  echo "no wheels in .whl/: run 'bash scripts/gpu_bench_stream.sh prepare' on the CPU machine first and carry .whl"
  exit 2
fi
if [ "${1:-}" = ab2000 ]; then  # scale500 with the A/B settings (see the top)
  STREAMS=2000 FINDMAX=0 VAD=off LENGTHS=uniform BUDGET=${BUDGET:-255} NAME="_u${NAME:-}"
  set -- scale500
fi

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/bench PYTHONUNBUFFERED=1 FLASHASR_SHARED=$PWD/.devstream/shared
nproc; nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
case "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)" in
  *H200*) CARD=h200 ;; *H100*) CARD=h100 ;; *) CARD=gpu ;;
esac
MODEL=random:parakeet-tdt-0.6b-v3
COMMON=(--model $MODEL --device cuda --clips .devstream/shared/audio/en --clip-min-s 4 --clip-max-s 12
        --left-s "${LEFT:-5.12}" --stream-batch 512 --budget-s "${BUDGET:-560}")
case "${1:-cost}" in
  cost)
    timeout 575 python3 -W ignore bench/bench_stream_scale.py --name "stream_scale_${CARD}_cost" --phases cost,drift \
      "${COMMON[@]}" --cost-streams 256 --reencode-streams 32 --cadences 500,1000 \
      --drift-left-s 2.56,5.12,10.24 --drift-clips 16 --drift-models "$FLASHASR_SHARED/fixtures/parakeet/tiny-tdt/model.nemo" ;;
  scale500|scale1000)
    CAD=${1#scale}
    timeout 575 python3 -W ignore bench/bench_stream_scale.py --name "stream_scale_${CARD}_$1${NAME:-}" --phases scale \
      "${COMMON[@]}" --mode multi --workers "${WORKERS:-6}" --client-procs "${CLIENTS:-8}" --max-batch 256 \
      --packet-ms "${PACKET:-20}" --cadences "$CAD" --streams "${STREAMS:-1000,2000}" --vad "${VAD:-both}" --utterances 2 \
      --lengths "${LENGTHS:-clips}" \
      $([ "${FINDMAX:-1}" = 1 ] && echo --find-max) --max-step 1000 --max-streams "${MAXSTREAMS:-8000}" \
      $([ -n "${PROFILE:-}" ] && echo --profile "$OUT" --py-spy /tmp/site/bin/py-spy) ${EXTRA:-} \
      ${SERVER_ARGS:+--server-args="$SERVER_ARGS"} ;;
  startup)
    timeout 575 python3 -W ignore bench/profile_engine_startup.py --json-out "$OUT/engine_startup_${CARD}${NAME:-}.json" ;;
  final)  # issue #17 item 4: time to a stream final and a short upload's reply under long uploads (after `av`)
    [ -d /tmp/site/av ] || { echo "PyAV is not installed here: run the av step first on this warm machine"; exit 1; }
    timeout 575 python3 -W ignore bench/bench_final_latency.py --device cuda --model $MODEL --mode "${MODE:-multi}" \
      --uploads "${UPLOADS:-32}" --upload-s "${UPLOAD_S:-600}" --label "_${CARD}${LABEL:-}" \
      --out "$OUT/final_latency_${CARD}${LABEL:-}.json" ;;
  *) echo "usage: $0 prepare | cost | scale500 | scale1000 | ab2000 | startup | final"; exit 2 ;;
esac
ls -la "${OUT:-.}"
