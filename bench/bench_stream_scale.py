"""Streaming at scale (issue 13): streams held per GPU, latency and jitter, cost per stream-second, drift.

Three phases (``--phases``, default all), one JSON with machine, versions and conditions:

* ``cost`` (in process, no server), with the per-call floor (one step for 1, 8, 64, 256 streams): B streams of real speech fed in lockstep, one partial every
  cadence of audio per stream, for utterances of 5, 30 and 120 s; each partial through the model's
  streamer (``chunked``: one batched step for all streams per tick) or by re-transcribing the
  utterance so far (``reencode``, today's path; 5 and 30 s); then every final offline (batched, as
  the server's finals). Reported per length: device seconds per stream-second of audio (partials,
  finals, total; wall time of each call with the device synchronised), and the encoder work
  COUNTED in audio-seconds per audio-second (budget: <= 2, the final included), padded frames.
* ``drift`` (in process): real clips streamed through the streamer in cadence-sized requests; the
  hypothesis after the last partial vs the final (= the offline transcript of the same audio):
  token edit rate, tokens of the final's prefix matched, word error rate of the released words.
  Several (left context, cadence) settings, and the model's own sensitivity as the baseline to read
  them against: its offline tokens with inaudible white noise added (60 and 50 dB SNR) vs clean.
* ``scale``: ``flashasr serve`` with the same model, N concurrent WebSocket streams (``/v1/stream``,
  binary PCM16, real-time pace in ``--packet-ms`` packets, ``--utterances`` utterances each) at
  each cadence, with manual commits and with server VAD. Reported: partial latency (packet holding
  the end of the audio the partial was started on -> partial received), its jitter (std, and std
  of the interval between a stream's partials), time to first partial (first packet sent -> first
  partial; and its latency), time to final (the end of speech decidable -> ``completed``: the
  commit sent, or, with server VAD, the packet completing the VAD's silence window after the
  speech end the server reported), p50/p95/p99/max, the engine's busy fraction, its inference
  seconds per stream-second, server CPU, client send lag. ``--find-max`` then climbs the stream
  count (``--max-step``) at each cadence until a target is missed (p95 partial <= 100 ms, p95 time
  to final <= 150 ms by default) and reports the most streams held. ``--lengths``: each
  utterance a whole clip (``clips``: few distinct lengths, so with streams started over
  ``--ramp-s`` their ends line up in bursts of finals) and/or real speech cut at a random point
  to a length uniform in ``--clip-min-s``..``--clip-max-s`` (``uniform``: ends spread as
  independent callers' would), one run each; every run also reports ``all_live``, the latencies
  while every stream was live (no ramp, no tail).

    python bench/bench_stream_scale.py --smoke           # CPU smoke: tiny NeMo fixture, few streams
    bash scripts/gpu_bench_stream.sh                      # the H200 run (random:parakeet-tdt-0.6b-v3)

Writes ``bench/results/<name>.json`` (copy under ``$OUT`` when set) after every configuration;
``--budget-s`` bounds the whole run (skipped configurations are listed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from bench_serve import SHARED, Server, _env, _metric, _pct, _read_clips, _tree_cpu_s  # noqa: E402

TINY = SHARED / "fixtures" / "parakeet" / "tiny-tdt" / "model.nemo"


# ----------------------------------------------------------------------------- helpers
def _stats(a: list[float]) -> dict:
    """Percentiles (ms) plus mean and standard deviation (jitter)."""
    d = _pct(a)
    if a:
        x = np.asarray(a) * 1000
        d.update(mean_ms=round(float(x.mean()), 1), std_ms=round(float(x.std()), 1))
    return d


def edit_distance(a: list, b: list) -> int:
    """Levenshtein distance between two sequences (tokens or words)."""
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        cur = [i] + [0] * len(b)
        for j, y in enumerate(b, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y))
        prev = cur
    return prev[-1]


def _sync(dev: str) -> None:
    if dev.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _speech(clips: list[tuple[str, bytes]], seconds: float, offset: int = 0) -> np.ndarray:
    """Real speech of exactly ``seconds``: the clips joined (rotated by ``offset``), repeated if needed."""
    xs = [np.frombuffer(p, "<i2").astype(np.float32) / 32768 for _, p in clips]
    xs = xs[offset % len(xs):] + xs[: offset % len(xs)]
    n = int(seconds * 16000)
    out, have = [], 0
    while have < n:
        for x in xs:
            out.append(x)
            have += x.size
            if have >= n:
                break
    return np.concatenate(out)[:n]


def _load(a):
    from flashasr.pipeline.engines import load_model

    t0 = time.perf_counter()
    m = load_model(a.model, device=a.device)
    return m, time.perf_counter() - t0


def _streamer(model, a, cadence_ms: float, left_s: float | None = None, slots: int = 16):
    from flashasr.models.parakeet.streaming import StreamingConfig

    cfg = StreamingConfig.for_cadence(cadence_ms, left_frames=int(round((left_s or a.left_s) / 0.08)),
                                      slots=slots, max_slots=max(slots, 16), max_batch=max(1, a.stream_batch))
    s = model.make_streamer(cfg)
    s.warmup()
    return s


# ----------------------------------------------------------------------------- phase: cost
def run_cost(model, clips, a) -> list[dict]:
    """Device time and counted encoder work per stream-second, by utterance length and path."""
    out = []
    cad = a.cost_cadence_ms
    step_n = int(cad * 16)
    for path in ("chunked", "reencode"):
        for sec in a.cost_lengths:
            if path == "reencode" and sec > a.reencode_max_s:
                continue
            B = a.cost_streams if path == "chunked" else a.reencode_streams
            audio = [_speech(clips, sec, i) for i in range(B)]
            w0 = dict(model.work)
            t_part = 0.0
            streamer = _streamer(model, a, cad, slots=B) if path == "chunked" else None
            ticks = int(math.ceil(sec * 16000 / step_n))
            for k in range(ticks):
                lo, hi = k * step_n, min((k + 1) * step_n, len(audio[0]))
                if hi - lo < step_n:  # the tail after the last partial goes to the final only
                    break
                _sync(a.device)
                t0 = time.perf_counter()
                if streamer is not None:
                    res = streamer.step([(f"s{i}", x[lo:hi]) for i, x in enumerate(audio)])
                    bad = [r for r in res if isinstance(r, BaseException)]
                    if bad:
                        raise bad[0]
                else:
                    model.transcribe_batch([x[:hi] for x in audio])
                _sync(a.device)
                t_part += time.perf_counter() - t0
            w1 = dict(model.work)
            _sync(a.device)
            t0 = time.perf_counter()
            for s0 in range(0, B, a.final_batch):
                model.transcribe_batch(audio[s0:s0 + a.final_batch])
            _sync(a.device)
            t_final = time.perf_counter() - t0
            stream_s = B * sec
            fr = model.frame_seconds
            part_frames = (streamer.counters["encoder_frames"] if streamer else 0) + \
                (w1["encoder_frames"] - w0["encoder_frames"])
            final_frames = model.work["encoder_frames"] - w1["encoder_frames"]
            r = {"path": path, "utterance_s": sec, "streams": B, "cadence_ms": cad, "partials_per_stream": ticks,
                 "device_s_per_stream_s": {"partials": round(t_part / stream_s, 6), "finals": round(t_final / stream_s, 6),
                                           "total": round((t_part + t_final) / stream_s, 6)},
                 "encoder_work_audio_s_per_audio_s": {"partials": round(part_frames * fr / stream_s, 3),
                                                      "final": round(final_frames * fr / stream_s, 3),
                                                      "total": round((part_frames + final_frames) * fr / stream_s, 3)},
                 "partial_step_ms": round(1000 * t_part / max(1, ticks), 2)}
            if streamer is not None:
                c = streamer.counters
                r["streamer"] = {k: c[k] for k in ("encoder_frames", "padded_frames", "subsampling_frames", "steps")}
                r["padding_factor"] = round(c["padded_frames"] / max(1, c["encoder_frames"]), 3)
                r["state_bytes_per_stream"] = streamer.pool.bytes_per_stream()
                r["graph_events"] = list(getattr(streamer, "events", []))
            out.append(r)
            w = r["encoder_work_audio_s_per_audio_s"]
            print(f"cost {path:8s} {sec:4d} s x{B}: device {r['device_s_per_stream_s']['total'] * 1000:.3f} ms per "
                  f"stream-s (partials {r['device_s_per_stream_s']['partials'] * 1000:.3f}, finals "
                  f"{r['device_s_per_stream_s']['finals'] * 1000:.3f}); encoder work {w['total']} audio-s/s "
                  f"(partials {w['partials']}); step {r['partial_step_ms']} ms", flush=True)
    return out


def run_floor(model, clips, a) -> list[dict]:
    """One chunked step (500 ms of new audio per stream) for batches of 1..N live streams: the
    per-call floor (median of ``--floor-reps``; features, encoder, decoder and host work)."""
    out = []
    sizes = [b for b in a.floor_batches if b <= a.stream_batch]
    s = _streamer(model, a, a.cost_cadence_ms, slots=max(sizes))
    n = int(a.cost_cadence_ms * 16)
    audio = [_speech(clips, 60, i) for i in range(max(sizes))]
    pos = 0
    for B in sizes:
        times = []
        for _ in range(a.floor_reps):
            if pos + n > len(audio[0]):
                for k in range(max(sizes)):
                    s.close(f"f{k}")
                s._closed.clear()
                pos = 0
            _sync(a.device)
            t0 = time.perf_counter()
            s.step([(f"f{k}", audio[k][pos:pos + n]) for k in range(B)])
            _sync(a.device)
            times.append(time.perf_counter() - t0)
            pos += n
        r = {"streams": B, "step_ms_median": round(1000 * float(np.median(times)), 3),
             "step_ms_p90": round(1000 * float(np.percentile(times, 90)), 3), "reps": len(times),
             "rows_computed": s.padded_rows(B)}
        out.append(r)
        print(f"floor: one step of {B} streams: median {r['step_ms_median']} ms (p90 {r['step_ms_p90']})", flush=True)
    return out


# ----------------------------------------------------------------------------- phase: drift
def run_drift(model, clips, a, model_name: str) -> list[dict]:
    """Chunked partial hypothesis after the last partial vs the final (offline) transcript."""
    out = []
    waves = [np.frombuffer(p, "<i2").astype(np.float32) / 32768 for _, p in clips[: a.drift_clips]]
    finals = model._decode_pieces(waves)  # the offline tokens (what the final decodes)
    tok = model.tokenizer
    # the model's own sensitivity: the offline tokens again with white noise no one would hear added
    # (a trained model's transcript does not move; a random-weight model's moves a lot, and drift of
    # chunked partials has to be read against it)
    rng = np.random.default_rng(0)
    for snr in a.drift_baseline_snr:
        noisy = [w + rng.standard_normal(w.size).astype(np.float32) * float(np.sqrt(np.mean(w ** 2))) * 10 ** (-snr / 20)
                 for w in waves]
        agree = [(len(f.token_ids), edit_distance(f.token_ids, g.token_ids))
                 for f, g in zip(finals, model._decode_pieces(noisy))]
        r = {"model": model_name, "baseline": f"offline tokens, white noise at {snr} dB SNR vs clean",
             "snr_db": snr, "clips": len(waves), "final_tokens": sum(n for n, _ in agree),
             "token_agreement": round(1 - sum(d for _, d in agree) / max(1, sum(n for n, _ in agree)), 4)}
        out.append(r)
        print(f"drift baseline {model_name}: offline tokens with noise at {snr} dB SNR: token agreement "
              f"{r['token_agreement']}", flush=True)
    settings = [(left_s, cad) for left_s in a.drift_left_s for cad in a.cadences]
    settings += [(max(a.drift_left_s), cad) for cad in a.drift_chunks_ms if cad not in a.cadences]
    for left_s, cad in settings:
        if True:
            s = _streamer(model, a, cad, left_s=left_s, slots=len(waves))
            n = int(cad * 16)
            pos = 0
            longest = max(len(w) for w in waves)
            while pos < longest:
                reqs = [(f"c{i}", w[pos:pos + n]) for i, w in enumerate(waves) if pos + n <= len(w)]
                if not reqs:
                    break
                s.step(reqs)
                pos += n
            ter, pref, n_tok, wer_num, n_words = 0, 0, 0, 0, 0
            per = []
            for i, (w, fin) in enumerate(zip(waves, finals)):
                st = s.streams.get(f"c{i}")
                got = st.tokens if st else []
                # compare on the audio both covered: the final's tokens up to the partials' last frame
                want = [t for t, f in zip(fin.token_ids, fin.token_frames) if f < (st.frames if st else 0)]
                d = edit_distance(got, want)
                p = next((k for k, (x, y) in enumerate(zip(got, want)) if x != y), min(len(got), len(want)))
                words_got = tok.decode(got[: st.word_start] if st else []).split()
                words_want = tok.decode(want).split()[: len(words_got)] if words_got else []
                ter += d
                pref += p
                n_tok += len(want)
                wer_num += edit_distance(words_got, words_want)
                n_words += len(words_want)
                per.append({"clip": clips[i][0], "tokens": len(want), "edits": d, "prefix_matched": p})
            r = {"model": model_name, "left_s": left_s, "cadence_ms": cad, "chunk_frames": s.C, "clips": len(waves),
                 "audio_s": round(sum(len(w) for w in waves) / 16000, 1), "final_tokens": n_tok,
                 "token_edit_rate": round(ter / max(1, n_tok), 4), "token_agreement": round(1 - ter / max(1, n_tok), 4),
                 "prefix_matched_fraction": round(pref / max(1, n_tok), 4),
                 "released_words_wer": round(wer_num / max(1, n_words), 4), "released_words": n_words, "per_clip": per}
            out.append(r)
            print(f"drift {model_name} L={left_s}s cadence={cad}ms: token agreement {r['token_agreement']}, prefix "
                  f"{r['prefix_matched_fraction']}, released-words WER {r['released_words_wer']} "
                  f"({n_tok} tokens, {len(waves)} clips)", flush=True)
    return out


# ----------------------------------------------------------------------------- phase: scale
async def _stream(port, pcms, a, cadence, vad: bool, delay, out, deadline) -> None:
    from websockets.asyncio.client import connect

    await asyncio.sleep(delay)
    step = 32 * a.packet_ms  # bytes per packet (16 kHz PCM16)
    url = (f"ws://127.0.0.1:{port}/v1/stream?sample_rate=16000&partial_interval_ms={cadence}&partials=full"
           + ("&vad=true" if vad else ""))
    sil = b"\x00\x00" * int(16 * (a.vad_silence_ms + 400))
    lead = b"\x00\x00" * 8000 if vad else b""
    try:
        async with connect(url, open_timeout=60, ping_interval=None, max_queue=None, compression=None) as ws:
            await ws.recv()
            sent_at: list[float] = []
            st = {"commit": None, "last_partial": None, "first": None, "done": 0, "decidable_ms": None}
            utt_first: list[int] = []  # per utterance: the index of its first packet in sent_at

            def at_ms(ms: float):
                k = max(0, -(-int(ms * 32) // step) - 1)
                return sent_at[k] if k < len(sent_at) else None

            async def reader():
                async for msg in ws:
                    ev = json.loads(msg)
                    now = time.perf_counter()
                    typ = ev["type"]
                    if typ.endswith("transcription.partial"):
                        t = at_ms(ev["audio_end_ms"])
                        if t is not None:
                            out["partial"].append(now - t)
                            out["partial_at"].append(time.time())
                            if st["first"] is None:
                                st["first"] = now
                                out["first_partial_latency"].append(now - t)
                                u = min(st["done"], len(utt_first) - 1)  # the utterance this partial is of
                                out["first_partial_from_start"].append(now - sent_at[utt_first[u]])
                        if st["last_partial"] is not None:
                            out["interval"].append(now - st["last_partial"])
                        st["last_partial"] = now
                    elif typ == "input_audio_buffer.speech_stopped":
                        st["decidable_ms"] = ev["audio_end_ms"] + a.vad_silence_ms
                    elif typ.endswith("transcription.completed"):
                        t0 = st["commit"] if not vad else (at_ms(st["decidable_ms"]) if st["decidable_ms"] else None)
                        if t0 is not None:
                            out["ttf"].append(now - t0)
                            out["ttf_at"].append(time.time())
                        st["done"] += 1
                        st["last_partial"] = st["first"] = None
                        if st["done"] >= a.utterances:
                            return
                    elif typ == "error" or typ.endswith("failed"):
                        out["errors"] += 1

            rt = asyncio.ensure_future(reader())
            t0 = time.perf_counter()
            k = 0
            for u in range(a.utterances):
                pcm = lead + pcms[u % len(pcms)] + (sil if vad else b"")
                utt_first.append(len(sent_at))
                for off in range(0, len(pcm), step):
                    await asyncio.sleep(max(0.0, t0 + k * a.packet_ms / 1000 - time.perf_counter()))
                    await ws.send(pcm[off:off + step])
                    sent_at.append(time.perf_counter())
                    k += 1
                if not vad:
                    st["commit"] = time.perf_counter()
                    await ws.send('{"type": "commit"}')
            out["late_s"].append(time.perf_counter() - (t0 + (k - 1) * a.packet_ms / 1000))
            out["live_from"].append(time.time() - (time.perf_counter() - sent_at[0]))
            out["live_until"].append(time.time())
            try:
                await asyncio.wait_for(rt, max(1.0, deadline - time.perf_counter()))
                out["finals"] += st["done"]
            except asyncio.TimeoutError:
                out["timeouts"] += 1
                out["finals"] += st["done"]
                rt.cancel()
    except Exception as e:  # noqa: BLE001 - counted, not fatal
        out["connect_errors"] += 1
        out["last_error"] = f"{type(e).__name__}: {e}"[:200]


def _utterances(pcms: list[bytes], speech: bytes | None, a, rng: random.Random, first: int) -> list[bytes]:
    """One stream's utterances (PCM16 bytes). ``--lengths clips``: whole clips in turn from ``first`` (every
    stream's utterances share the few clips' lengths, so ends line up across streams: bursts of finals).
    ``--lengths uniform``: real speech cut from ``speech`` at a random sample, of a length drawn uniformly from
    [clip-min-s, clip-max-s] (ends spread, as with independent callers)."""
    if speech is None:
        return [pcms[(first + j) % len(pcms)] for j in range(a.utterances)]
    out = []
    for _ in range(a.utterances):
        n = int(rng.uniform(a.clip_min_s, a.clip_max_s) * 16000)
        off = rng.randrange(0, len(speech) // 2 - n)
        out.append(speech[2 * off: 2 * (off + n)])
    return out


def _client_proc(port, pcms, speech, n, a, cadence, vad, seed, start_at, q) -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    out = {k: [] for k in ("partial", "interval", "ttf", "first_partial_latency", "first_partial_from_start", "late_s",
                           "partial_at", "ttf_at", "live_from", "live_until")}
    out.update(finals=0, timeouts=0, errors=0, connect_errors=0, last_error=None)
    rng = random.Random(seed)
    longest = a.utterances * (_longest_s(pcms, a, speech) + 1.5)

    async def go():
        await asyncio.sleep(max(0.0, start_at - time.time()))
        deadline = time.perf_counter() + a.ramp_s + longest + a.final_timeout_s
        await asyncio.gather(*(_stream(port, _utterances(pcms, speech, a, rng, seed + i), a,
                                       cadence, vad, rng.uniform(0, a.ramp_s), out, deadline) for i in range(n)))

    try:
        import uvloop

        uvloop.run(go())
    except ImportError:
        asyncio.run(go())
    out["cpu_s"] = time.process_time()
    q.put(out)


def _longest_s(pcms: list[bytes], a, speech: bytes | None) -> float:
    """The longest utterance a stream sends (s): ``speech`` given, utterances are cut from it (``uniform``)."""
    return a.clip_max_s if speech is not None else max(len(p) for p in pcms) / 32000


def _steady(agg: dict) -> dict:
    """Latencies of the events while every stream was live (after the last stream's first packet, before the
    first stream's last one): the load of ``n`` concurrent streams without the ramp's start and the run's end."""
    if not agg["live_from"]:
        return {}
    lo, hi = max(agg["live_from"]), min(agg["live_until"])
    pick = lambda key, at: [x for x, t in zip(agg[key], agg[at]) if lo <= t <= hi]  # noqa: E731
    return {"window_s": round(max(0.0, hi - lo), 1), "partial_latency": _stats(pick("partial", "partial_at")),
            "time_to_final": _stats(pick("ttf", "ttf_at"))}


def run_scale(server: Server, pcms: list[bytes], n: int, cadence: int, vad: bool, a, speech: bytes | None = None) -> dict:
    procs = max(1, min(a.client_procs, n))
    shares = [n // procs + (1 if i < n % procs else 0) for i in range(procs)]
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    start_at = time.time() + 1.0 + n / 2000
    ps = [ctx.Process(target=_client_proc, args=(server.port, pcms, speech, s, a, cadence, vad, 1000 * i + n, start_at, q))
          for i, s in enumerate(shares) if s]
    for p in ps:
        p.start()
    time.sleep(max(0.0, start_at - time.time()))
    m0, cpu0, t0 = server.metrics(), _tree_cpu_s(server.proc.pid), time.perf_counter()
    limit = a.ramp_s + a.utterances * (_longest_s(pcms, a, speech) + 2) + a.final_timeout_s + 120
    outs = [q.get(timeout=limit) for _ in ps]
    wall = time.perf_counter() - t0
    cpu = _tree_cpu_s(server.proc.pid) - cpu0
    m1 = server.metrics()
    for p in ps:
        p.join(10)
    agg = {k: sum((o[k] for o in outs), [] if isinstance(outs[0][k], list) else 0)
           for k in ("partial", "interval", "ttf", "first_partial_latency", "first_partial_from_start", "late_s",
                     "finals", "timeouts", "errors", "connect_errors", "cpu_s", "partial_at", "ttf_at",
                     "live_from", "live_until")}

    def delta(name, label=None):
        return _metric(m1, name, label) - _metric(m0, name, label)

    inf_s = delta("flashasr_engine_stage_seconds_sum", 'stage="inference"')
    handoff_s = delta("flashasr_engine_stage_seconds_sum", 'stage="handoff"')
    calls = delta("flashasr_engine_stage_seconds_count", 'stage="inference"')
    audio_stream_s = delta("flashasr_engine_audio_seconds_total", 'kind="final"')  # every utterance once
    rows = {k: delta("flashasr_engine_batch_size_sum", f'kind="{k}"') for k in ("partial", "final")}
    batches = {k: delta("flashasr_engine_batch_size_count", f'kind="{k}"') for k in ("partial", "final")}
    kind_s = {k: delta("flashasr_engine_inference_seconds_sum", f'kind="{k}"') for k in ("partial", "final")}
    kind_n = {k: delta("flashasr_engine_inference_seconds_count", f'kind="{k}"') for k in ("partial", "final")}
    want = n * a.utterances
    return {"streams": n, "cadence_ms": cadence, "server_vad": vad, "packet_ms": a.packet_ms,
            "lengths": "clips" if speech is None else "uniform",
            "utterances_per_stream": a.utterances, "client_procs": len(ps),
            "partial_latency": _stats(agg["partial"]), "partial_interval": _stats(agg["interval"]),
            "first_partial_latency": _stats(agg["first_partial_latency"]),
            "time_to_first_partial_from_first_packet": _stats(agg["first_partial_from_start"]),
            "time_to_final": _stats(agg["ttf"]), "all_live": _steady(agg),
            "by_second": _by_second(agg, start_at), "finals": agg["finals"], "finals_expected": want,
            "finals_timed_out": agg["timeouts"], "error_events": agg["errors"], "connect_errors": agg["connect_errors"],
            "last_error": next((o["last_error"] for o in outs if o["last_error"]), None),
            "client_send_lag_p99_ms": _pct(agg["late_s"]).get("p99_ms"),
            "server_cpu_cores": round(cpu / wall, 2), "wall_s": round(wall, 1),
            "client_cpu_cores": round(agg["cpu_s"] / wall, 2), "load_avg_1m": round(os.getloadavg()[0], 1),
            "engine_busy_fraction": round(inf_s / wall, 3), "engine_calls": int(calls),
            "stream_graph_captures": int(delta("flashasr_stream_graph_captures_total")),
            "stream_work": _stream_work(delta, kind_n["partial"]),
            "stream_slots_capacity": int(_metric(m1, "flashasr_stream_slots", 'kind="capacity"')),
            "engine_handoff_fraction": round(handoff_s / wall, 3),
            "engine_handoff_ms_per_call": round(1000 * handoff_s / calls, 2) if calls else None,
            "engine_mean_batch": {k: round(rows[k] / batches[k], 1) if batches[k] else None for k in rows},
            "engine_busy_by_kind": {k: round(kind_s[k] / wall, 3) for k in kind_s},
            "engine_call_ms_by_kind": {k: round(1000 * kind_s[k] / kind_n[k], 2) if kind_n[k] else None
                                       for k in kind_s},
            "engine_inference_s_per_stream_s": round(inf_s / audio_stream_s, 6) if audio_stream_s else None}


def _profiled(a, cadence: int) -> tuple[list[str], Path | None]:
    """``--profile DIR``: the server runs under py-spy (``--subprocesses --threads``, non-blocking,
    ``--profile-rate`` Hz; py-spy is the server's parent, so no ptrace rights are needed): the wrapper
    command and the raw stacks' path."""
    if not a.profile:
        return [], None
    out = Path(a.profile) / f"profile_stream_{cadence}.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    return [a.py_spy, "record", "--subprocesses", "--threads", "--nonblocking", "--rate", str(a.profile_rate),
            "--format", "raw", "--output", str(out), "--"], out


def _by_second(agg: dict, start_at: float) -> list[dict]:
    """Per second of the run (from the first packet): partials and finals delivered, their p95 (ms):
    where in the run the tails are (the ramp, the commits' waves, or throughout)."""
    rows: dict[int, dict] = {}
    for key, at in (("partial", "partial_at"), ("ttf", "ttf_at")):
        for lat, t in zip(agg[key], agg[at]):
            rows.setdefault(int(t - start_at), {"partial": [], "ttf": []})[key].append(lat)
    out = []
    for sec in sorted(rows):
        r = rows[sec]
        out.append({"s": sec, "partials": len(r["partial"]), "partial_p95_ms": _pct(r["partial"]).get("p95_ms"),
                    "finals": len(r["ttf"]), "ttf_p95_ms": _pct(r["ttf"]).get("p95_ms")})
    return out


def _stream_work(delta, partial_calls: float) -> dict:
    """The chunked streamer's work over the run (its counters' deltas): device steps per partial call
    (more than 1: streams lagged by more than one chunk), rows per device step, and frames computed
    per new frame encoded (bucket and chunk padding)."""
    w = {k: delta("flashasr_stream_work_total", f'kind="{k}"') for k in ("steps", "rows", "encoder_frames", "padded_frames")}
    return {**{k: int(v) for k, v in w.items()},
            "steps_per_partial_call": round(w["steps"] / partial_calls, 2) if partial_calls else None,
            "rows_per_step": round(w["rows"] / w["steps"], 1) if w["steps"] else None,
            "padding": round(w["padded_frames"] / w["encoder_frames"], 2) if w["encoder_frames"] else None}


def _held(r: dict, a) -> bool:
    return (r["finals"] == r["finals_expected"] and not r["connect_errors"]
            and r["partial_latency"].get("p95_ms", 1e9) <= a.target_partial_p95_ms
            and r["time_to_final"].get("p95_ms", 1e9) <= a.target_final_p95_ms)


def scale_phase(a, clips, result, save, left, speech: bytes | None = None) -> None:
    pcms = [pcm for _, pcm in clips]
    most = max([n for n in a.streams] + ([a.max_streams] if a.find_max else []))
    args = [*(["--model", a.model] if a.model else []), "--device", a.device, "--mode", a.mode, "--workers",
            str(a.workers), "--max-batch", str(a.max_batch), "--batch-wait-ms", "2", "--log-level", "warning",
            "--stream-partials", a.partials, "--stream-left-s", str(a.left_s), "--stream-batch", str(a.stream_batch),
            "--stream-slots", str(min(a.slots_cap, most)), *a.server_args.split()]
    for cadence in a.cadences:
        if left() < 120:
            result["skipped"].append({"phase": "scale", "cadence_ms": cadence})
            continue
        try:
            wrap, raw = _profiled(a, cadence)
            server = Server(args + ["--partial-interval-ms", str(cadence)], Path(os.environ.get("TMPDIR", "/tmp")) /
                            f"bench-stream-{cadence}.log", min(a.ready_timeout_s, left()), wrap=wrap)
        except RuntimeError as e:
            result.setdefault("errors", []).append(f"server (cadence {cadence}): {str(e)[-1500:]}")
            save()
            continue
        result["servers"][str(cadence)] = {"ready_s": round(server.ready_s, 1), "info": server.info}
        print(f"server ready in {server.ready_s:.1f} s ({server.info.get('startup_s')}): "
              f"{server.info.get('stream_partials')} {server.info.get('stream_chunk')}", flush=True)
        need = lambda n, sp=None: a.ramp_s + a.utterances * (_longest_s(pcms, a, sp) + 2) + 20 + n / 300  # noqa: E731
        try:
            plan = [(n, v, ln) for n in a.streams for v in a.vad_modes for ln in a.lengths]
            for n, vad, ln in plan:
                sp = speech if ln == "uniform" else None
                if left() < need(n, sp):
                    result["skipped"].append({"streams": n, "cadence_ms": cadence, "server_vad": vad, "lengths": ln})
                    continue
                r = run_scale(server, pcms, n, cadence, vad, a, sp)
                result["scale"].append(r)
                _print_scale(r)
                save()
            if a.find_max:
                n = max(a.streams) + a.max_step
                while n <= a.max_streams and left() > need(n):
                    r = run_scale(server, pcms, n, cadence, False, a, speech if a.lengths[0] == "uniform" else None)
                    r["find_max"] = True
                    result["scale"].append(r)
                    _print_scale(r)
                    save()
                    if not _held(r, a):
                        break
                    n += a.max_step
        except Exception as e:  # noqa: BLE001 - keep what was measured
            result.setdefault("errors", []).append(f"scale cadence {cadence}: {type(e).__name__}: {e}"[:1000])
            print(f"scale failed: {e}\n{server.log()}", flush=True)
        finally:
            server.stop()
            if raw is not None:
                _profile_summary(result, cadence, raw, a)


def _profile_summary(result: dict, cadence: int, raw: Path, a) -> None:
    """The server's py-spy stacks (its serving only: start-up left out) by role, into ``result["profiles"]``."""
    from profile_stacks import summarize_server

    if not raw.exists():
        result.setdefault("errors", []).append(f"profile: py-spy wrote no {raw.name}")
        return
    runs = [r for r in result["scale"] if r["cadence_ms"] == cadence]
    result.setdefault("profiles", {})[str(cadence)] = {
        "raw": raw.name, "rate_hz": a.profile_rate, "runs": [(r["streams"], r["server_vad"]) for r in runs],
        "loaded_wall_s": round(sum(r["wall_s"] for r in runs), 1),
        "roles": summarize_server(raw, a.profile_rate)}


def _print_scale(r: dict) -> None:
    p, f, fp = r["partial_latency"], r["time_to_final"], r["time_to_first_partial_from_first_packet"]
    print(f"scale streams={r['streams']:5d} lengths={r['lengths']} cadence={r['cadence_ms']} vad={int(r['server_vad'])}  partial p50/p95/p99 "
          f"{p.get('p50_ms')}/{p.get('p95_ms')}/{p.get('p99_ms')} ms (std {p.get('std_ms')})  final p50/p95/p99 "
          f"{f.get('p50_ms')}/{f.get('p95_ms')}/{f.get('p99_ms')} ms  first partial {fp.get('p50_ms')} ms  finals "
          f"{r['finals']}/{r['finals_expected']}  busy {r['engine_busy_fraction']} {r['engine_busy_by_kind']}  "
          f"handoff {r['engine_handoff_fraction']} ({r['engine_handoff_ms_per_call']} ms/call)  "
          f"call ms {r['engine_call_ms_by_kind']}  batch {r['engine_mean_batch']}  "
          f"cpu {r['server_cpu_cores']} (clients {r['client_cpu_cores']})  lag99 {r['client_send_lag_p99_ms']} ms  "
          f"slots {r.get('stream_slots_capacity')} captures {r.get('stream_graph_captures')}  "
          f"work {r.get('stream_work')}", flush=True)
    st = r.get("all_live") or {}
    if st:
        def p95(d):  # a window without events of a kind (one utterance per stream: no final while all live)
            return f"{d['p95_ms']} ms" if d.get("p95_ms") is not None else "none in the window"
        print(f"  all {r['streams']} live ({st['window_s']} s): partial p95 {p95(st['partial_latency'])}  "
              f"final p95 {p95(st['time_to_final'])}", flush=True)


# ----------------------------------------------------------------------------- main
def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU smoke run: the tiny NeMo fixture, few streams")
    ap.add_argument("--phases", default="cost,drift,scale")
    ap.add_argument("--model", default=None, help="model spec (default: the tiny NeMo fixture)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--mode", default="single", choices=("single", "multi"))
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--max-batch", type=int, default=256, help="server: waveforms per offline/final model call")
    ap.add_argument("--server-args", default="")
    ap.add_argument("--partials", default="chunked", choices=("chunked", "reencode", "auto"))
    ap.add_argument("--left-s", type=float, default=10.24, help="chunked partials: left context (s)")
    ap.add_argument("--stream-batch", type=int, default=512)
    ap.add_argument("--slots-cap", type=int, default=8192, help="server --stream-slots at most this")
    ap.add_argument("--clips", default=str(SHARED / "audio" / "en"))
    ap.add_argument("--clip-min-s", type=float, default=4.0)
    ap.add_argument("--clip-max-s", type=float, default=12.0)
    ap.add_argument("--max-clips", type=int, default=16)
    ap.add_argument("--cadences", default="500,1000")
    ap.add_argument("--streams", default="1000,2000")
    ap.add_argument("--vad", default="both", choices=("off", "on", "both"))
    ap.add_argument("--vad-silence-ms", type=int, default=500, help="the server's VAD silence window (its default)")
    ap.add_argument("--utterances", type=int, default=2, help="utterances per stream")
    ap.add_argument("--lengths", default="clips",
                    help="utterance lengths, comma-separated, each a run: 'clips' (each utterance one whole clip of --clip-min-s..--clip-max-s: "
                         "few distinct lengths, so ends line up across streams) or 'uniform' (real speech cut at a "
                         "random point, its length uniform in --clip-min-s..--clip-max-s, as independent callers)")
    ap.add_argument("--packet-ms", type=int, default=20)
    ap.add_argument("--ramp-s", type=float, default=2.0)
    ap.add_argument("--client-procs", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    ap.add_argument("--final-timeout-s", type=float, default=30.0)
    ap.add_argument("--find-max", action="store_true")
    ap.add_argument("--max-step", type=int, default=1000)
    ap.add_argument("--max-streams", type=int, default=8000)
    ap.add_argument("--cost-lengths", default="5,30,120")
    ap.add_argument("--cost-streams", type=int, default=256)
    ap.add_argument("--cost-cadence-ms", type=int, default=500)
    ap.add_argument("--reencode-streams", type=int, default=32)
    ap.add_argument("--reencode-max-s", type=float, default=30)
    ap.add_argument("--final-batch", type=int, default=64)
    ap.add_argument("--floor-batches", default="1,8,64,256", help="streams per step of the per-call floor")
    ap.add_argument("--floor-reps", type=int, default=20)
    ap.add_argument("--drift-clips", type=int, default=16)
    ap.add_argument("--drift-left-s", default="2.56,10.24")
    ap.add_argument("--drift-chunks-ms", default="2000,4000", help="longer chunks for the drift sweep (largest L)")
    ap.add_argument("--drift-baseline-snr", default="60,50", help="dB SNR of the noise of the sensitivity baseline")
    ap.add_argument("--torch-threads", type=int, default=None,
                    help="intra-op threads of the in-process phases on CPU (default 1: OpenMP barriers on a shared "
                         "small CPU cost more than they give for these small steps)")
    ap.add_argument("--drift-models", default="", help="more model specs for the drift phase (comma-separated)")
    ap.add_argument("--ready-timeout-s", type=float, default=600.0)
    ap.add_argument("--budget-s", type=float, default=560.0)
    ap.add_argument("--target-partial-p95-ms", type=float, default=100.0)
    ap.add_argument("--target-final-p95-ms", type=float, default=150.0)
    ap.add_argument("--name", default=None)
    ap.add_argument("--profile", default=None, help="folder: run each scale server under py-spy (its raw stacks)")
    ap.add_argument("--profile-rate", type=int, default=100)
    ap.add_argument("--py-spy", default="py-spy", help="py-spy executable")
    a = ap.parse_args(argv)
    if a.smoke:  # small everything, unless given
        given = set(x.split("=")[0] for x in (argv or sys.argv[1:]) if x.startswith("--"))
        for k, v in {"--streams": "2,4", "--cost-streams": 2, "--floor-batches": "1,8", "--floor-reps": 5, "--reencode-streams": 2, "--drift-clips": 6,
                     "--utterances": 1, "--client-procs": 1, "--max-clips": 4, "--max-batch": 8,
                     "--stream-batch": 64}.items():
            if k not in given:
                setattr(a, k[2:].replace("-", "_"), v)
    a.model = a.model or str(TINY)
    a.name = a.name or ("stream_scale_cpu_smoke" if a.smoke else "stream_scale")
    a.streams = [int(x) for x in str(a.streams).split(",") if x]
    a.cadences = [int(x) for x in str(a.cadences).split(",") if x]
    a.cost_lengths = [int(x) for x in str(a.cost_lengths).split(",") if x]
    a.drift_left_s = [float(x) for x in str(a.drift_left_s).split(",") if x]
    a.drift_chunks_ms = [int(x) for x in str(a.drift_chunks_ms).split(",") if x]
    a.floor_batches = [int(x) for x in str(a.floor_batches).split(",") if x]
    a.drift_baseline_snr = [float(x) for x in str(a.drift_baseline_snr).split(",") if x]
    a.lengths = [x.strip() for x in str(a.lengths).split(",") if x.strip()]
    if not a.lengths or set(a.lengths) - {"clips", "uniform"}:
        raise SystemExit(f"--lengths: clips and/or uniform, not {a.lengths}")
    a.vad_modes = {"off": [False], "on": [True], "both": [False, True]}[a.vad]
    a.phases = set(a.phases.split(","))
    return a


def main(argv=None) -> int:
    a = _args(argv)
    t_start = time.perf_counter()
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    clips = _read_clips(Path(a.clips), a.clip_min_s, a.clip_max_s, a.max_clips)
    drift_clips = _read_clips(Path(a.clips), 2.0, 30.0, max(a.drift_clips, 1))
    out_path = REPO / "bench" / "results" / f"{a.name}.json"
    result = {"benchmark": "bench_stream_scale", "env": _env(a),
              "conditions": {"model": a.model, "device": a.device, "mode": a.mode, "frontend_workers": a.workers,
                             "partials": a.partials, "left_context_s": a.left_s, "stream_batch": a.stream_batch,
                             "server_args": a.server_args,
                             "cadences_ms": a.cadences, "packet_ms": a.packet_ms, "pace": "real time",
                             "utterances_per_stream": a.utterances, "ramp_s": a.ramp_s, "lengths": a.lengths,
                             "vad_silence_ms": a.vad_silence_ms, "clips": [n for n, _ in clips],
                             "clip_seconds": [round(len(p) / 32000, 2) for _, p in clips],
                             "clients": "same host, separate processes", "smoke": a.smoke,
                             "targets": {"partial_p95_ms": a.target_partial_p95_ms,
                                         "final_p95_ms": a.target_final_p95_ms}},
              "servers": {}, "cost": [], "drift": [], "scale": [], "skipped": []}

    def save():
        result["total_wall_s"] = round(time.perf_counter() - t_start, 1)
        ok = [r for r in result["scale"] if _held(r, a)]
        result["most_streams_held"] = {f"cadence {c} ms, vad {int(v)}": max(
            (r["streams"] for r in ok if (r["cadence_ms"], r["server_vad"]) == (c, v)), default=None)
            for c in a.cadences for v in a.vad_modes}
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(result, indent=1))
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], out_path.name).write_text(out_path.read_text())

    def left() -> float:
        return a.budget_s - (time.perf_counter() - t_start)

    if a.phases & {"cost", "drift"}:
        if not a.device.startswith("cuda"):
            import torch

            torch.set_num_threads(a.torch_threads or 1)
            result["conditions"]["torch_threads_in_process"] = torch.get_num_threads()
        model, load_s = _load(a)
        result["conditions"]["model_load_s"] = round(load_s, 1)
        result["conditions"]["model_class"] = type(model).__name__
        if "cost" in a.phases:
            result["cost"] = run_cost(model, clips, a)
            save()
            result["step_floor"] = run_floor(model, clips, a)
            save()
        if "drift" in a.phases:
            result["drift"] = run_drift(model, drift_clips, a, a.model)
            save()
            for spec in [s for s in a.drift_models.split(",") if s]:
                from flashasr.pipeline.engines import load_model

                result["drift"] += run_drift(load_model(spec, device=a.device), drift_clips, a, spec)
                save()
        del model
    if "scale" in a.phases:
        speech = None
        if "uniform" in a.lengths:  # every clip of 1-120 s, joined: the source utterances are cut from
            speech = b"".join(p for _, p in _read_clips(Path(a.clips), 1.0, 120.0, 256))
            result["conditions"]["speech_source_s"] = round(len(speech) / 32000, 1)
            if len(speech) // 2 <= int(a.clip_max_s * 16000):
                raise SystemExit(f"--lengths uniform: {len(speech) / 32000:.1f} s of speech is not more than --clip-max-s")
        scale_phase(a, clips, result, save, left, speech)
    save()
    print("wrote", out_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
