#!/usr/bin/env bash
# ON THE GPU MACHINE (device run, repository root): one long file, one request (issue #12 item 4):
# a 1-hour mp3 (44.1 kHz stereo) and a 1-hour ogg/opus built from the clips in .devjobs/shared,
# stage by stage and through flashasr.transcribe and run_job (bench/bench_long_file.py).
# Carry: .whl, .devjobs (with .devjobs/shared/audio/manifest.jsonl). Result: $OUT/long_file_h200.json.
set -u
OUT="${OUT:-/tmp/flashasr-out}"; mkdir -p "$OUT"; export OUT
[ -d /tmp/site/av ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/bench PYTHONUNBUFFERED=1 FLASHASR_SHARED=$PWD/.devjobs/shared
timeout "${LIMIT:-280}" python3 -W ignore bench/bench_long_file.py --cache-dir /tmp/long --repeats "${REPEATS:-2}" \
  --out "$OUT/long_file_h200.json" ${EXTRA:-} 2>&1 | grep -v -i warning | tail -40
