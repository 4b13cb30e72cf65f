"""Where a Parakeet GPU server's start-up goes (issue #13: a server at 2,000 streams takes 113-136 s
to load and warm up its model, ``/ready``'s ``startup_s.model_s``).

The server's model is ``ParakeetGPUASR`` with the serving profiles (``choose_profiles(
small_batches=SERVING_SMALL_BATCHES)``: 61 encoder shapes), each captured as a CUDA graph with its
TDT decoder graph before the server is ready. For every profile, in the engine's warm-up order:

* ``encoder_s``: the encoder profile's capture (two eager runs, then the capture; the first run of a
  new convolution shape is where cuDNN's autotuner runs when ``torch.backends.cudnn.benchmark``);
* ``decoder_s``: the decoder graph of that (batch, frames) bucket;
* ``replay_ms``: one replay of the captured encoder graph (CUDA events, mean of ``--replays``);
* ``memory_mib``: graph memory the capture added.

``--cudnn-benchmark both`` runs the whole measurement twice, in two processes (the setting is
process-wide and cuDNN keeps its choices for the process's life): with the autotuner (the engine's
default, measured fastest on the H200's large batches) and with cuDNN's heuristics, and reports per
profile the replay time off / on, so a start-up saved can be weighed against the speed lost.

    python bench/profile_engine_startup.py --json-out bench/results/engine_startup_h200.json

Needs a CUDA device (exits with status 2 and a message without one).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "bench"))


def _profiles(kind: str):
    from flashasr.engine.parakeet_gpu import SERVING_SMALL_BATCHES
    from flashasr.engine.profiles import choose_profiles

    return choose_profiles(small_batches=SERVING_SMALL_BATCHES) if kind == "serving" else choose_profiles()  # offline


def measure(model_name: str, profiles_kind: str, cudnn_benchmark: bool, replays: int) -> dict:
    """One process's start-up, profile by profile (see the module docstring)."""
    import torch

    from flashasr.engine.parakeet_gpu import ParakeetGPUASR
    from flashasr.random_models import build_random_parakeet, find_parakeet_config, shape_random_joint

    t0 = time.perf_counter()
    asr = build_random_parakeet(find_parakeet_config(model_name), device="cuda")
    shape_random_joint(asr)
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    model = ParakeetGPUASR(asr, warmup=False, profiles=_profiles(profiles_kind), cudnn_benchmark=cudnn_benchmark)
    engine_s = time.perf_counter() - t1
    eng = model.engine
    eng.warmup()  # what the server's start-up runs, timed profile by profile
    rows = [dict(r) for r in eng.warmup_report]
    mem = {(r["batch"], r["seconds"]): r["memory_mib"] for r in eng.encoder.memory_report()}
    runners = eng.encoder._runners  # the captured graphs, replayed alone
    by_shape = {(p.batch, p.seconds): p for p in eng.encoder.profiles}
    for row in rows:
        g = runners[by_shape[(row["batch"], row["seconds"])]].graph
        g.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        row["replay_ms"] = round(start.elapsed_time(end) / replays, 3)
        row["memory_mib"] = mem.get((row["batch"], row["seconds"]))
    return {"cudnn_benchmark": cudnn_benchmark, "build_s": round(build_s, 1), "engine_s": round(engine_s, 1),
            "encoder_total_s": round(sum(r["encoder_s"] for r in rows), 1),
            "decoder_total_s": round(sum(r["decoder_s"] for r in rows), 1),
            "replay_total_ms": round(sum(r["replay_ms"] for r in rows), 1), "profiles": rows}


def _child(args, bench: bool) -> dict:
    """:func:`measure` in a fresh process (cuDNN's choices and the setting are process-wide)."""
    cmd = [sys.executable, __file__, "--model", args.model, "--profiles", args.profiles, "--replays",
           str(args.replays), "--cudnn-benchmark", "on" if bench else "off", "--child"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    if out.returncode != 0:
        sys.stderr.write(out.stderr[-4000:])
        raise SystemExit(f"the measurement with cuDNN's autotuner {'on' if bench else 'off'} failed "
                         f"(exit status {out.returncode}; its error output above)")
    return json.loads(out.stdout.strip().splitlines()[-1])


def summary(runs: list[dict]) -> dict:
    """Totals per run, and with both settings the replay ratio off / on per profile."""
    out = {("on" if r["cudnn_benchmark"] else "off"): {k: r[k] for k in ("build_s", "engine_s", "encoder_total_s",
                                                                           "decoder_total_s", "replay_total_ms")}
           for r in runs}
    if len(runs) == 2:
        on, off = sorted(runs, key=lambda r: not r["cudnn_benchmark"])
        ratios = [b["replay_ms"] / a["replay_ms"] for a, b in zip(on["profiles"], off["profiles"]) if a["replay_ms"] > 0]
        out["replay_off_over_on"] = {"min": round(min(ratios), 3), "max": round(max(ratios), 3),
                                     "total": round(off["replay_total_ms"] / on["replay_total_ms"], 3)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="parakeet-tdt-0.6b-v3", help="random:NAME's NAME (a Parakeet YAML)")
    ap.add_argument("--profiles", choices=("serving", "offline"), default="serving",
                    help="serving: the server's (61 shapes, the default); offline: the offline job's")
    ap.add_argument("--cudnn-benchmark", choices=("on", "off", "both"), default="both")
    ap.add_argument("--replays", type=int, default=5)
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.replays < 1:
        ap.error("--replays must be >= 1")
    if args.json_out and not Path(args.json_out).resolve().parent.is_dir():
        ap.error(f"--json-out: no folder {str(Path(args.json_out).resolve().parent)!r}")
    try:
        from flashasr.random_models import find_parakeet_config

        find_parakeet_config(args.model)
    except Exception as e:  # noqa: BLE001 - said up front, not after minutes of captures
        ap.error(f"--model: {e}")
    import torch

    if not torch.cuda.is_available():
        print("profile_engine_startup.py needs a CUDA device (none here)", file=sys.stderr)
        return 2
    if args.child:
        print(json.dumps(measure(args.model, args.profiles, args.cudnn_benchmark == "on", args.replays)))
        return 0
    settings = {"on": [True], "off": [False], "both": [True, False]}[args.cudnn_benchmark]
    runs = [_child(args, b) for b in settings]
    from bench_gpu_common import env_record

    res = {"benchmark": "profile_engine_startup", "env": env_record(),
           "conditions": {"model": f"random:{args.model}", "profiles": args.profiles, "replays": args.replays,
                          "note": "each setting in its own process; times are wall seconds with the device "
                                  "synchronised after each capture"},
           "summary": summary(runs), "runs": runs}
    print(f"{'cuDNN benchmark':>16} {'build s':>8} {'encoders s':>11} {'decoders s':>11} {'replays ms':>11}")
    for k, v in res["summary"].items():
        if k in ("on", "off"):
            print(f"{k:>16} {v['build_s']:>8} {v['encoder_total_s']:>11} {v['decoder_total_s']:>11} "
                  f"{v['replay_total_ms']:>11}")
    if "replay_off_over_on" in res["summary"]:
        print("replay time off / on:", res["summary"]["replay_off_over_on"])
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(res, indent=1) + "\n")
        print("wrote", args.json_out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
