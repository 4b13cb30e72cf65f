"""The engine's scheduler under thousands of streams, with the GPU's measured costs (issue #13).

At 2,000 streams the engine is near its limit, and two scale runs of the same tree on two machines
differ by more than a scheduling change can move the tails (``docs/SERVING.md``, tenth session).
Here the real :class:`~flashasr.serve.scheduler.BatchScheduler` runs in one process, with a model
and a streamer whose calls sleep for the device time the step and final benchmarks measured (a
GPU call releases the GIL while it waits). Only the scheduling policy changes between the runs, so
they can be compared.

Cost model (H100, this tree; ``--cost-scale`` multiplies both, e.g. 2 for a GPU half as fast):

* a chunked partial call: per pass over the rows, the step graph of the row bucket (powers of two,
  the server's default) ``3.4 ms + 0.044 ms x bucket rows`` (``profile_stream_step_h100_buckets.json``:
  1 row 3.8 ms, 64 rows 6.1 ms, 256 rows 14.5 ms, 512 rows 26.2 ms) and the host work of the bucket,
  0.028 ms a bucket row (7.1 ms for 135 rows in the 256 bucket there; more at 512 rows, 25.7 ms).
  A stream with more than one chunk of frames waiting (it fell behind) needs more passes, as in
  :class:`~flashasr.models.parakeet.streaming.ParakeetStreamer`. The server's own partial calls
  were slower: 25.1 ms for 155 rows (``stream_scale_h100_scale500_u_default_s10.json``) where this
  model gives 21.8 ms;
* a final call of ``n`` utterances: ``11 ms + 0.75 ms x n``, fitted to the server's calls (17.0 ms
  for 7.8 utterances in the same run; in-process, 8 / 16 / 32 utterances took 13.4 / 20.1 / 30.3 ms,
  ``profile_final_call_h100_curve.json``).

Load: ``--streams`` streams at real-time pace, each ``--utterances`` utterances of lengths uniform
over ``--min-s``..``--max-s``, one after the other on the stream's own clock (the next starts at the
commit, whatever its final does); streams start spread over ``--ramp-s``; a cadence of audio
(``--cadence-ms``) arrives at a time. As the front end does, a stream has one partial in flight:
audio that arrives meanwhile is held and sent the moment it ends; at the commit a chunk still queued
is dropped and the final (the whole utterance) submitted. Measured in the engine (no network, no
front end): for every cadence of audio, the wait from its arrival to the first partial covering it
(so merged audio counts once per cadence, the same population under every policy); a final's time
from the commit; p50 / p95 / p99, engine busy, calls, device steps per partial call.

    python bench/bench_scheduler_sim.py --streams 2000 --cost-scale 1.3 --policies "final_wait_max_ms=0;default"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

SR = 16000
FRAME_S = 0.08


class SimStreamer:
    """A streamer whose step sleeps for the step graph's measured time (see the module docstring)."""

    def __init__(self, chunk_frames: int, cost_scale: float):
        self.C = chunk_frames
        self.scale = cost_scale
        self.pending: dict[str, float] = {}  # per stream: seconds of audio not encoded yet
        self.counters = {"steps": 0, "rows": 0, "encoder_frames": 0, "padded_frames": 0}
        self.device_s = 0.0

    @staticmethod
    def bucket(rows: int) -> int:
        return 1 << max(0, math.ceil(math.log2(max(1, rows))))

    def graph_ms(self, rows: int) -> float:
        return 3.4 + 0.044 * self.bucket(rows)

    def step(self, requests):
        frames = []
        for key, samples, _new in requests:
            self.pending[key] = self.pending.get(key, 0.0) + len(samples) / SR
            n = int(self.pending[key] / FRAME_S + 1e-9)
            self.pending[key] -= n * FRAME_S
            frames.append(n)
        ms, rows = 0.0, list(frames)
        while any(f > 0 for f in rows):  # one pass per chunk of frames the furthest-behind row has
            live = sum(f > 0 for f in rows)
            ms += self.graph_ms(live) + 0.028 * self.bucket(live)  # the graph, and the host work of the bucket
            self.counters["steps"] += 1
            self.counters["rows"] += live
            self.counters["padded_frames"] += live * self.C
            rows = [max(0, f - self.C) for f in rows]
        self.counters["encoder_frames"] += sum(frames)
        time.sleep(ms * self.scale / 1000)
        self.device_s += ms * self.scale / 1000
        return [None] * len(requests)

    def close(self, key: str) -> None:
        self.pending.pop(key, None)


class SimModel:
    """A model whose batch of finals sleeps for the final call's measured time."""

    sample_rate = SR
    device = "cpu"
    name = family = "sim"

    def __init__(self, cost_scale: float):
        self.scale = cost_scale

    def transcribe_batch(self, waves, options=None, **kw):
        from flashasr.types import Transcript

        time.sleep((11.0 + 0.75 * len(waves)) * self.scale / 1000)
        return [Transcript(text="", language="en", duration=len(w) / SR, model="sim") for w in waves]


async def run_policy(policy: dict, a) -> dict:
    from flashasr.options import TranscribeOptions
    from flashasr.serve.scheduler import FINAL, BatchScheduler

    streamer = SimStreamer(int(math.ceil(a.cadence_ms / 80 - 1e-9)), a.cost_scale)
    from flashasr.serve.config import ServeConfig

    # the server's defaults, with the scale runs' batch limits (bench_stream_scale.py: --max-batch 256)
    opts = {**ServeConfig().scheduler_options, "max_batch": 256, "stream_batch": 512}
    opts.update({k.replace("_ms", "_s"): v / 1000 if k.endswith("_ms") else v for k, v in policy.items()})
    sched = BatchScheduler(SimModel(a.cost_scale), streamer=streamer, **opts)
    sched.start()
    rng = random.Random(a.seed)
    options = TranscribeOptions()
    partial, final, finals = [], [], []
    chunk_n = int(a.cadence_ms * SR / 1000)
    cadence = a.cadence_ms / 1000
    t0 = time.perf_counter()

    async def utterance(key: str, start: float, length: float) -> None:
        """One utterance on its own clock: a cadence of audio arrives at ``start + k * cadence``."""
        st = {"fut": None, "held": [], "first": True, "open": True}  # held: arrival times not sent yet

        def send() -> None:
            it = sched.queue_chunk(key, np.zeros(chunk_n * len(st["held"]), np.float32), options, new=st["first"])
            covered, st["held"], st["first"], st["fut"] = st["held"], [], False, it

            def done(f) -> None:
                if not f.cancelled() and f.exception() is None:
                    now = time.perf_counter()  # each cadence of audio it covers: its wait since arrival
                    partial.extend(now - t for t in covered)
                if st["open"] and st["held"]:  # as the front end: held audio goes as soon as this ends
                    send()

            it.fut.add_done_callback(done)

        k = 1
        while k * cadence <= length:
            arrive = start + k * cadence
            await asyncio.sleep(max(0.0, arrive - time.perf_counter()))
            st["held"].append(arrive)
            if st["fut"] is None or st["fut"].fut.done():
                send()
            k += 1
        await asyncio.sleep(max(0.0, start + length - time.perf_counter()))
        st["open"] = False  # the commit: the front end drops the utterance's chunk still queued
        if st["fut"] is not None and not st["fut"].fut.done():
            sched.drop(st["fut"])
        t_c = time.perf_counter()  # the end of speech is decidable
        await sched.submit(np.zeros(int(length * SR), np.float32), options, priority=FINAL)
        final.append(time.perf_counter() - t_c)
        sched.close_stream(key)

    async def one_stream(i: int) -> None:
        start = time.perf_counter() + rng.random() * a.ramp_s
        for u in range(a.utterances):  # the next utterance starts at the commit, whatever the final does
            length = rng.uniform(a.min_s, a.max_s)
            finals.append(asyncio.ensure_future(utterance(f"s{i}u{u}", start, length)))
            start += length
            await asyncio.sleep(max(0.0, start - time.perf_counter()))

    await asyncio.gather(*(one_stream(i) for i in range(a.streams)))
    await asyncio.gather(*finals)
    wall = time.perf_counter() - t0
    inf = {k: _hist(sched.metrics, "flashasr_engine_inference_seconds", k) for k in ("partial", "final")}
    bs = {k: _hist(sched.metrics, "flashasr_engine_batch_size", k) for k in ("partial", "final")}
    await sched.stop()
    return {"policy": policy, "streams": a.streams, "wall_s": round(wall, 1),
            "partial_latency": _pct(partial), "time_to_final": _pct(final), "finals": len(final),
            "engine_busy": round((inf["partial"][0] + inf["final"][0]) / wall, 3),
            "busy_by_kind": {k: round(v[0] / wall, 3) for k, v in inf.items()},
            "calls": {k: int(v[1]) for k, v in inf.items()},
            "mean_batch": {k: round(v[0] / v[1], 1) if v[1] else None for k, v in bs.items()},
            "device_steps_per_partial_call": round(streamer.counters["steps"] / max(1, inf["partial"][1]), 2)}


def _hist(metrics, name: str, kind: str) -> tuple[float, float]:
    """(sum, count) of a labelled histogram's ``kind`` child."""
    s = n = 0.0
    for m in metrics.registry.collect():
        for smp in m.samples:
            if smp.labels.get("kind") == kind and smp.name == name + "_sum":
                s = smp.value
            elif smp.labels.get("kind") == kind and smp.name == name + "_count":
                n = smp.value
    return s, n


def _pct(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0}
    v = np.sort(np.asarray(xs)) * 1000
    return {"n": len(v), **{f"p{q}_ms": round(float(np.percentile(v, q)), 1) for q in (50, 95, 99)},
            "max_ms": round(float(v[-1]), 1)}


POLICY_KEYS = ("final_wait_ms", "final_wait_max_ms", "partial_wait_ms", "max_batch", "stream_batch")


def _policy(text: str) -> dict:
    """``default`` or ``key=value,...``: changes to the server's BatchScheduler options, ``*_ms`` in
    milliseconds (``final_wait_ms=35``). ``finals_with_chunks`` needs a model with queued device
    work (``submit_batch``), which the simulated one is not: refused."""
    out = {}
    for part in text.split(","):
        part = part.strip()
        if part and part != "default":
            k, eq, v = (x.strip() for x in part.partition("="))
            if k == "finals_with_chunks":
                raise SystemExit("finals_with_chunks cannot be simulated (the simulated model queues no device work)")
            if k not in POLICY_KEYS:
                raise SystemExit(f"policy {text!r}: {k!r} is not one of {', '.join(POLICY_KEYS)} (or 'default')")
            try:
                out[k] = float(v)
            except ValueError:
                out[k] = math.nan
            if not (math.isfinite(out[k]) and out[k] >= 0):
                raise SystemExit(f"policy {text!r}: {k} needs a finite number >= 0, got {v!r}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=2000)
    ap.add_argument("--utterances", type=int, default=2)
    ap.add_argument("--min-s", type=float, default=4.0)
    ap.add_argument("--max-s", type=float, default=12.0)
    ap.add_argument("--ramp-s", type=float, default=2.0)
    ap.add_argument("--cadence-ms", type=float, default=500.0)
    ap.add_argument("--cost-scale", type=float, default=1.0)
    ap.add_argument("--policies", default="final_wait_max_ms=0;default",
                    help="';'-separated: 'default' (the server's defaults) or changes to them, BatchScheduler "
                         "options (final_wait_ms=35,partial_wait_ms=40; final_wait_max_ms=0: before it existed)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per policy, alternating")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json-out", default=str(REPO / "bench" / "results" / "scheduler_sim_vm.json"))
    a = ap.parse_args(argv)
    if a.streams < 1 or a.utterances < 1 or not 0 < a.min_s <= a.max_s or a.cadence_ms <= 0 or a.cost_scale <= 0:
        ap.error("--streams and --utterances must be >= 1, 0 < --min-s <= --max-s, --cadence-ms and --cost-scale > 0")
    import uvloop

    policies = [_policy(p) for p in a.policies.split(";")]
    result = {"benchmark": "scheduler_sim", "env": {"time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                                    "python": platform.python_version(), "cpus": os.cpu_count(),
                                                    "load_avg_1m": round(os.getloadavg()[0], 2)},
              "conditions": {k: getattr(a, k) for k in ("streams", "utterances", "min_s", "max_s", "ramp_s",
                                                        "cadence_ms", "cost_scale", "repeats", "seed")},
              "cost_model": "partial pass 3.4 ms + 0.044 ms x bucket rows + 0.028 ms host x bucket rows (powers "
                            "of two); final call 11 ms + 0.75 ms x utterances; times cost_scale",
              "latency": "partial: per cadence of audio, arrival -> first partial covering it; final: commit -> final",
              "runs": []}
    print(f"{'policy':32s} {'partial p50/p95/p99 ms':>24s} {'final p50/p95/p99 ms':>22s} {'busy':>5s} "
          f"{'rows/call p|f':>14s} {'steps/call':>10s}")
    for rep in range(a.repeats):
        for pol in policies:
            r = uvloop.run(run_policy(pol, a))
            r["repeat"] = rep
            result["runs"].append(r)
            p, f = r["partial_latency"], r["time_to_final"]
            print(f"{json.dumps(pol) if pol else 'default':32s} {p['p50_ms']:7.1f}/{p['p95_ms']:7.1f}/{p['p99_ms']:7.1f} "
                  f"{f['p50_ms']:6.1f}/{f['p95_ms']:6.1f}/{f['p99_ms']:6.1f} {r['engine_busy']:5.2f} "
                  f"{r['mean_batch']['partial']!s:>6}|{r['mean_batch']['final']!s:<6} {r['device_steps_per_partial_call']:10.2f}",
                  flush=True)
    result["env"]["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    Path(a.json_out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json_out).write_text(json.dumps(result, indent=1))
    print(f"wrote {a.json_out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
