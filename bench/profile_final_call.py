"""Where one streaming final's model call goes (issue #13: finals cost the engine twice the partials).

A stream's final is the whole utterance transcribed offline, exactly (``transcribe_pieces`` on the
engine's model thread, as ``BatchScheduler`` runs it). For batches of ``--batches`` real utterances
(16 kHz WAV clips of 4-12 s, as the scale benchmark streams), median of ``--reps`` calls:

* ``call_ms``: the whole ``transcribe_pieces`` (device synchronised at its end);
* ``engine_ms``: inside it, ``OfflineParakeetEngine.transcribe_arrays`` (``host_prep`` = padding
  into pinned memory, ``encoder_gpu`` / ``decoder_gpu`` = device time of each stream, ``wait``);
  ``rest_ms`` = the difference (options, checks, Transcript building, detokenising);
* ``plan``: the encoder profiles the batch ran in (rows x seconds, rows used); ``plan_ms`` the host
  time of ``OfflineParakeetEngine.plan`` alone;
* per ``--launch-costs``: the planner's price of one profile launch (seconds of audio), so a
  higher one packs a call into fewer, more padded launches;
* per ``--joint-steps``: the decoder's head/inner steps fused (``engine/tdt_fused.py``) or the
  PyTorch steps (graphs captured again for each);
* a ``cProfile`` of ``--cprofile-batch`` (host functions by cumulative time) and a
  ``torch.profiler`` table of the same call (device time per kernel, launches).

Model: ``random:NAME`` through ``load_random_model`` (joint calibrated on real speech) behind
``ParakeetGPUASR`` with the server's default profiles (``choose_profiles(SERVING_SMALL_BATCHES)``),
only those up to ``--max-profile-s`` captured (the finals' lengths; the others are not used).

    python bench/profile_final_call.py --json-out bench/results/profile_final_call_h200.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "bench"))
from bench_serve import SHARED, _read_clips  # noqa: E402


def _model(name: str, max_profile_s: float):
    from flashasr.engine.parakeet_gpu import SERVING_SMALL_BATCHES, ParakeetGPUASR
    from flashasr.engine.profiles import choose_profiles
    from flashasr.random_models import load_random_model

    profiles = [p for p in choose_profiles(small_batches=SERVING_SMALL_BATCHES) if p.seconds <= max_profile_s]
    return load_random_model(name, device="cuda", accelerate=lambda m: ParakeetGPUASR(m, profiles=profiles))


def _utterances(n: int, clips) -> list[np.ndarray]:
    pcm = [np.frombuffer(b, "<i2").astype(np.float32) / 32768 for _, b in clips]
    return [pcm[i % len(pcm)] for i in range(n)]


def time_calls(model, waves, reps: int) -> dict:
    """Median whole call and its engine part for one batch of utterances."""
    import torch
    from flashasr.options import TranscribeOptions
    from flashasr.pipeline.run import transcribe_pieces

    eng = model.engine
    inner = eng.transcribe_arrays
    outs = []

    def timed(*args, **kw):
        o = inner(*args, **kw)
        outs.append(o)
        return o

    eng.transcribe_arrays = timed
    opts = TranscribeOptions().resolve(model.capabilities)
    whole = []
    try:
        for _ in range(reps + 2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            transcribe_pieces(model, waves, opts)
            torch.cuda.synchronize()
            whole.append(time.perf_counter() - t0)
    finally:
        eng.transcribe_arrays = inner
    w = np.array(whole[2:])
    lengths = [len(x) for x in waves]
    p0 = time.perf_counter()
    for _ in range(reps):
        eng.plan(lengths)
    plan_s = (time.perf_counter() - p0) / reps
    med = {k: float(np.median([o.timings.get(k, 0.0) for o in outs[2:]])) for k in outs[-1].timings}
    return {"utterances": len(waves), "audio_s": round(sum(map(len, waves)) / 16000, 2),
            "call_ms": round(1000 * float(np.median(w)), 3), "call_p90_ms": round(1000 * float(np.quantile(w, .9)), 3),
            "engine_ms": {k: round(1000 * v, 3) for k, v in med.items()},
            "rest_ms": round(1000 * (float(np.median(w)) - med.get("total", 0.0)), 3),
            "plan": [list(b) for b in outs[-1].batches], "plan_ms": round(1000 * plan_s, 4),
            "tokens": sum(len(it.token_ids) for it in outs[-1].items), "reps": len(w)}


def host_profile(model, waves, reps: int, top: int) -> str:
    """cProfile of ``reps`` calls: functions by cumulative time (text)."""
    from flashasr.options import TranscribeOptions
    from flashasr.pipeline.run import transcribe_pieces

    opts = TranscribeOptions().resolve(model.capabilities)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(reps):
        transcribe_pieces(model, waves, opts)
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(top)
    return s.getvalue()


def kernel_table(model, waves, top: int) -> dict:
    """torch.profiler over one call: device time per kernel/op and the number of launches."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from flashasr.options import TranscribeOptions
    from flashasr.pipeline.run import transcribe_pieces

    opts = TranscribeOptions().resolve(model.capabilities)
    transcribe_pieces(model, waves, opts)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        transcribe_pieces(model, waves, opts)
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        dev = getattr(e, "self_device_time_total", None)
        if dev is None:
            dev = getattr(e, "self_cuda_time_total", 0)
        rows.append({"op": e.key, "calls": e.count, "self_device_ms": round(dev / 1000, 3),
                     "cpu_ms": round(e.cpu_time_total / 1000, 3)})
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=top), flush=True)
    by_dev = sorted(rows, key=lambda r: -r["self_device_ms"])[:top]
    by_cpu = sorted(rows, key=lambda r: -r["cpu_ms"])[:top]
    return {"by_device": by_dev, "by_cpu": by_cpu}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="parakeet-tdt-0.6b-v3", help="random:NAME's NAME")
    ap.add_argument("--clips", default=str(SHARED / "audio" / "en"))
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--max-profile-s", type=float, default=14.48)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--cprofile-batch", type=int, default=4)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--joint-steps", default="fused,pytorch",
                    help="decoder joint steps to time per batch: fused (engine/tdt_fused.py) and/or pytorch")
    ap.add_argument("--launch-costs", default="",
                    help="comma-separated OfflineParakeetEngine.launch_cost_s values to time each batch with "
                         "(seconds of audio a profile launch is worth to the planner; default: the engine's)")
    ap.add_argument("--json-out", default=str(REPO / "bench" / "results" / "profile_final_call_h200.json"))
    a = ap.parse_args(argv)
    from bench_offline_e2e import environment

    clips = _read_clips(Path(a.clips), 4.0, 12.0, 16)
    result = {"benchmark": "profile_final_call", "env": environment("cuda"),
              "conditions": {"model": f"random:{a.model}", "reps": a.reps, "clips": [n for n, _ in clips],
                             "engine": "ParakeetGPUASR (bf16, fused), server profiles <= "
                                       f"{a.max_profile_s} s", "path": "pipeline.transcribe_pieces"}}
    out = Path(a.json_out)

    def save():
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], out.name).write_text(out.read_text())

    t0 = time.perf_counter()
    model = _model(a.model, a.max_profile_s)
    result["conditions"]["model_build_s"] = round(time.perf_counter() - t0, 1)
    result["calls"] = []
    dec = model.engine.decoder
    default_cost = model.engine.launch_cost_s
    costs = [float(c) for c in a.launch_costs.split(",") if c] or [default_cost]
    for B in [int(b) for b in a.batches.split(",") if b]:
        for step in a.joint_steps.split(","):
            dec.fused = step == "fused"
            dec._buckets.clear()  # graphs captured with the other step: capture again
            for cost in costs:
                model.engine.launch_cost_s = cost
                r = {"joint_step": step, "launch_cost_s": cost, **time_calls(model, _utterances(B, clips), a.reps)}
                result["calls"].append(r)
                print(json.dumps(r), flush=True)
                save()
    model.engine.launch_cost_s = default_cost
    dec.fused = True
    dec._buckets.clear()
    waves = _utterances(a.cprofile_batch, clips)
    result["host_cprofile"] = host_profile(model, waves, a.reps, a.top)
    print(result["host_cprofile"], flush=True)
    result["kernels"] = kernel_table(model, waves, a.top)
    save()
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
