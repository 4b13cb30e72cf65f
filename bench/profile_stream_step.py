"""Where one chunked streaming step's time goes (issue #13: the step floor and the cost per row).

For each batch of live streams (``--batches``), one step of ``--cadence-ms`` of new audio per
stream through :class:`~flashasr.engine.stream_graphs.GraphedStreamer` (what the server runs):

* ``step_ms``: the whole :meth:`step` (host work + device), median of ``--reps``;
* ``device_step_ms``: inside it, the graph replay with its copies in and out
  (:meth:`device_step`); ``host_ms`` = the difference (segments, results, tokenizer);
* ``replay_gpu_ms``: the captured graph alone, replayed back to back (CUDA events);
* per ``--buckets-per-octave`` value (one streamer each): its row buckets, the warm-up's time
  (every bucket's capture) and the GPU memory it left reserved, in graph pools and in all;
* the same replay for other left contexts (``--left-variants``, encoder frames of 80 ms);
* a ``torch.profiler`` table of one eager step (no graphs) at the largest batch: CUDA time per
  operator, to see which part of the Conformer step dominates.

The model is ``random:NAME`` with an engine of one small offline profile (no calibration: this
measures shapes, not tokens; the random joint's default blank bias).

    python bench/profile_stream_step.py --json-out bench/results/profile_stream_step_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "bench"))


def _model(name: str):
    from flashasr.engine.parakeet_gpu import ParakeetGPUASR
    from flashasr.engine.profiles import Profile
    from flashasr.random_models import build_random_parakeet, find_parakeet_config, shape_random_joint

    asr = build_random_parakeet(find_parakeet_config(name), device="cuda", dtype="float32")
    shape_random_joint(asr)
    return ParakeetGPUASR(asr, profiles=[Profile(1, 2.08)])


def _streamer(model, cadence_ms: float, left: int, slots: int, use_graphs: bool = True, per_octave: int = 1):
    from flashasr.engine.stream_graphs import GraphedStreamer
    from flashasr.models.parakeet.streaming import StreamingConfig

    cfg = StreamingConfig.for_cadence(cadence_ms, left_frames=left, slots=slots, max_slots=slots, max_batch=512,
                                      buckets_per_octave=per_octave)
    s = GraphedStreamer(model, cfg, use_graphs=use_graphs)
    s.warmup()
    return s


def memory_gib() -> dict:
    """The caching allocator's reserved and allocated memory, and the part of the reserved memory in
    CUDA graph pools (segments of any pool but the default one), in GiB."""
    import torch

    torch.cuda.synchronize()
    segs = torch.cuda.memory._snapshot().get("segments", [])
    graph = sum(sg["total_size"] for sg in segs if tuple(sg.get("segment_pool_id", (0, 0))) != (0, 0))
    g = 2 ** 30
    return {"reserved_gib": round(torch.cuda.memory_reserved() / g, 2),
            "allocated_gib": round(torch.cuda.memory_allocated() / g, 2), "graph_pools_gib": round(graph / g, 2)}


def _audio(n_streams: int, seconds: float, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    return [(0.1 * np.sin(2 * np.pi * (150 + 7 * i) * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))
             + 0.01 * rng.standard_normal(t.size)).astype(np.float32) for i in range(n_streams)]


def time_steps(s, B: int, n: int, reps: int) -> dict:
    """Median whole step, its device_step part and the host rest, for ``B`` streams."""
    import torch

    audio = _audio(B, n * (reps + 3) / 16000)
    inner = s.device_step
    spent = []

    def timed(*args):
        t0 = time.perf_counter()
        r = inner(*args)
        spent.append(time.perf_counter() - t0)
        return r

    s.device_step = timed
    whole = []
    try:
        for k in range(reps + 2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            s.step([(f"b{B}s{i}", a[k * n:(k + 1) * n]) for i, a in enumerate(audio)])
            torch.cuda.synchronize()
            whole.append(time.perf_counter() - t0)
    finally:
        s.device_step = inner
        for i in range(B):
            s.close(f"b{B}s{i}")
    w, d = np.array(whole[2:]), np.array(spent[2:])
    return {"streams": B, "step_ms": round(1000 * float(np.median(w)), 3),
            "device_step_ms": round(1000 * float(np.median(d)), 3),
            "host_ms": round(1000 * float(np.median(w - d)), 3), "reps": len(w)}


def replay_ms(s, B: int, reps: int) -> float:
    """GPU time of the bucket's captured graph replayed back to back (CUDA events)."""
    import torch

    g = s._graph(s._bucket(B))
    g.slots.fill_(s.pool.scratch)
    g.n_new.fill_(s.C)
    g.feat_valid.fill_(s.sub * (s.C + 1))
    for _ in range(3):
        g.graph.replay()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    e0.record()
    for _ in range(reps):
        g.graph.replay()
    e1.record()
    torch.cuda.synchronize()
    g.n_new.zero_()
    return round(e0.elapsed_time(e1) / reps, 3)


def op_table(model, cadence_ms: float, left: int, B: int, top: int) -> list[dict]:
    """torch.profiler over one eager step of ``B`` streams: CUDA time per operator (top ``top``)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    s = _streamer(model, cadence_ms, left, slots=B, use_graphs=False)
    n = int(cadence_ms * 16)
    audio = _audio(B, 3 * n / 16000)
    for k in range(2):
        s.step([(f"p{i}", a[k * n:(k + 1) * n]) for i, a in enumerate(audio)])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        s.step([(f"p{i}", a[2 * n:3 * n]) for i, a in enumerate(audio)])
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        dev = getattr(e, "device_time_total", None)
        if dev is None:
            dev = getattr(e, "cuda_time_total", 0)
        self_dev = getattr(e, "self_device_time_total", None)
        if self_dev is None:
            self_dev = getattr(e, "self_cuda_time_total", 0)
        rows.append({"op": e.key, "calls": e.count, "device_ms": round(dev / 1000, 3),
                     "self_device_ms": round(self_dev / 1000, 3), "cpu_ms": round(e.cpu_time_total / 1000, 3)})
    rows.sort(key=lambda r: -r["self_device_ms"])
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=top), flush=True)
    return rows[:top]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="parakeet-tdt-0.6b-v3", help="random:NAME's NAME")
    ap.add_argument("--batches", default="1,8,64,256,512")
    ap.add_argument("--cadence-ms", type=float, default=500.0)
    ap.add_argument("--left-s", type=float, default=5.12)
    ap.add_argument("--left-variants", default="0,32,128")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--top", type=int, default=30, help="rows of the eager step's operator table (0: no table)")
    ap.add_argument("--slots", type=int, default=0, help="stream slots (state memory; default: the largest batch)")
    ap.add_argument("--buckets-per-octave", default="1",
                    help="row buckets per doubling above 64 rows, one streamer each (e.g. 1,4): warm-up time, memory, steps")
    ap.add_argument("--json-out", default=str(REPO / "bench" / "results" / "profile_stream_step_h200.json"))
    a = ap.parse_args(argv)
    import torch
    from bench_offline_e2e import environment

    batches = [int(b) for b in a.batches.split(",") if b]
    left = int(round(a.left_s / 0.08))
    result = {"benchmark": "profile_stream_step", "env": environment("cuda"),
              "conditions": {"model": f"random:{a.model}", "cadence_ms": a.cadence_ms, "left_frames": left,
                             "reps": a.reps, "engine": "ParakeetGPUASR (bf16, fused), one offline profile",
                             "audio": "synthetic tones + noise (shapes only)"}}
    out = Path(a.json_out)

    def save():
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], out.name).write_text(out.read_text())

    t0 = time.perf_counter()
    model = _model(a.model)
    result["conditions"]["model_build_s"] = round(time.perf_counter() - t0, 1)
    n = int(a.cadence_ms * 16)
    slots = a.slots or max(batches)
    result["conditions"]["slots"] = slots
    result["steps"], result["buckets"] = [], []
    for per_octave in [int(x) for x in a.buckets_per_octave.split(",") if x]:
        before = memory_gib()
        t0 = time.perf_counter()
        s = _streamer(model, a.cadence_ms, left, slots=slots, per_octave=per_octave)
        info = {"buckets_per_octave": per_octave, "buckets": list(s.buckets), "warmup_s": round(time.perf_counter() - t0, 1),
                "memory_before": before, "memory_after_warmup": memory_gib(), "events": list(s.events)}
        result["buckets"].append(info)
        print(json.dumps(info), flush=True)
        for B in batches:
            r = time_steps(s, B, n, a.reps)
            r["replay_gpu_ms"] = replay_ms(s, B, a.reps)
            r["bucket"], r["buckets_per_octave"] = s._bucket(B), per_octave
            result["steps"].append(r)
            print(json.dumps(r), flush=True)
            save()
        del s
        torch.cuda.empty_cache()
    result["left_variants"] = []
    for lv in [int(x) for x in a.left_variants.split(",") if x]:
        s = _streamer(model, a.cadence_ms, lv, slots=max(batches))
        r = {"left_frames": lv, **{f"replay_gpu_ms_b{B}": replay_ms(s, B, a.reps) for B in (1, 256)}}
        result["left_variants"].append(r)
        print(json.dumps(r), flush=True)
        del s
        torch.cuda.empty_cache()
        save()
    if a.top:
        result["ops_eager_b256"] = op_table(model, a.cadence_ms, left, min(256, max(batches)), a.top)
    save()
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
