"""What slows the offline job's model calls: the GIL (other threads of the model's process) or the
cores (other busy processes)?

Inside a job from disk a 512-piece model call of the Parakeet GPU engine took 1.5-1.7 ms per
piece while the decode workers ran, against 0.84 ms for the engine alone (H100,
``bench/results/offline_e2e_h100_rows.json``). Two causes are possible: the job's other threads
in the model's process (result, planner, writers, the conductor) take the GIL from the model
thread, which then waits up to a switch interval each time it comes back from a CUDA wait; or
the decode processes keep every core busy, so the model thread waits for a core. This benchmark
separates them: the same 512 pieces through ``transcribe_pieces`` (the job's model call) with

* nothing else running (the engine's own pace);
* ``T`` threads in this process spinning in Python (GIL pressure only);
* ``P`` processes spinning on the cores at the decode workers' niceness (core pressure only);
* the same processes kept off the first ``R`` cores (``sched_setaffinity``: cores left free);
* another GIL switch interval during the condition (``switch_us=``);
* with ``--model-process``, every condition with the model in a process of its own (the spinners
  stay in this one): what the job gains by :class:`flashasr.pipeline.model_process.ModelProcess`.

Each condition: ``--repeats`` calls after one warm call; median and best wall time per call, ms
per piece, and the ratio to the condition "alone" of the same run. The JSON goes to
``bench/results/model_contention_<tag>.json`` (or ``--json-out``).

    python bench/bench_model_contention.py --corpus .devjobs/corpus --model random:parakeet-tdt-0.6b-v3
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import sys
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))


def _spin_thread(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x += i


def _spin_proc(stop, nice: int, reserve: int) -> None:
    try:
        os.nice(nice)
    except OSError:
        pass
    if reserve > 0 and hasattr(os, "sched_getaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) > reserve:
            os.sched_setaffinity(0, cpus[reserve:])
    x = 0
    while not stop.is_set():
        for i in range(100000):
            x += i


def load_pieces(corpus: Path, n: int, max_s: float, rate: int = 16000) -> list[np.ndarray]:
    """``n`` pieces of at most ``max_s`` s from the corpus's audio files (decoded, 16 kHz), cycling."""
    from flashasr.audio import load_audio

    files = sorted(p for p in corpus.rglob("*") if p.suffix.lower() in (".mp3", ".opus", ".m4a", ".flac", ".wav", ".ogg"))
    if not files:
        raise SystemExit(f"no audio files under {corpus}")
    pieces: list[np.ndarray] = []
    step = int(max_s * rate)
    for f in files:
        x = load_audio(f, target_rate=rate).samples
        for a in range(0, len(x), step):
            if len(x) - a >= rate:  # at least 1 s
                pieces.append(np.ascontiguousarray(x[a:a + step]))
        if len(pieces) >= n:
            break
    while len(pieces) < n:
        pieces += pieces[: n - len(pieces)]
    return pieces[:n]


def timed_calls(model, pieces, options, repeats: int, sync, texts: list | None = None) -> list[float]:
    from flashasr.pipeline import transcribe_pieces

    first = transcribe_pieces(model, pieces, options)
    if texts is not None:
        texts.extend(getattr(t, "text", repr(t)) for t in first)
    sync()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        got = transcribe_pieces(model, pieces, options)
        sync()
        out.append(time.perf_counter() - t0)
        bad = [g for g in got if isinstance(g, BaseException)]
        if bad:
            raise RuntimeError(f"{len(bad)} pieces failed: {bad[0]!r}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", required=True, help="folder of audio files (bench_offline_e2e.py prepare)")
    ap.add_argument("--model", default="random:parakeet-tdt-0.6b-v3")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--pieces", type=int, default=512)
    ap.add_argument("--max-piece-s", type=float, default=20.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--switch-interval-s", type=float, default=0.0005, help="as the job sets it")
    ap.add_argument("--conditions", default="alone;threads=1;threads=3;procs=15;procs=15,reserve=1;"
                    "procs=12,reserve=4;procs=15,threads=3;alone",
                    help="';'-separated: alone, threads=T, procs=P, reserve=R (with procs), nice=N, "
                         "switch_us=U (the GIL switch interval during this condition)")
    ap.add_argument("--model-process", action="store_true",
                    help="the model in a process of its own (flashasr.pipeline.model_process.ModelProcess): "
                         "the calls go there and the spinning threads stay here; the pieces lie in one "
                         "shared-memory segment, as a job's decoded files do. Compare with a run without it")
    ap.add_argument("--tag", default=None)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)

    import torch

    from flashasr.options import TranscribeOptions
    from flashasr.pipeline.engines import load_model

    sys.setswitchinterval(args.switch_interval_s)
    t0 = time.perf_counter()
    if args.model_process:
        from flashasr.pipeline.model_process import ModelProcess

        model = ModelProcess(args.model, device=args.device)
    else:
        model = load_model(args.model, device=args.device)
    load_s = time.perf_counter() - t0
    pieces = load_pieces(Path(args.corpus), args.pieces, args.max_piece_s, model.capabilities.sample_rate)
    if args.model_process:  # one kept segment: the model process maps the pieces, as in a job
        from flashasr import shm

        whole = shm.take_array(*shm.put_array(np.concatenate(pieces)), keep_for=model)
        cut = np.cumsum([0] + [len(p) for p in pieces])
        pieces = [whole[a:b] for a, b in zip(cut[:-1], cut[1:])]
    audio_s = sum(len(p) for p in pieces) / model.capabilities.sample_rate
    options = TranscribeOptions().resolve(model.capabilities)
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda and not args.model_process else (lambda: None)
    print(f"model {args.model} loaded in {load_s:.1f} s; {len(pieces)} pieces, {audio_s / 3600:.3f} h; "
          f"{os.cpu_count()} CPUs; switch interval {sys.getswitchinterval() * 1e3:g} ms", flush=True)

    rows = []
    texts: list = []
    ctx = mp.get_context("fork")
    for spec in [c.strip() for c in args.conditions.split(";") if c.strip()]:
        kw = {k.strip(): int(v) for k, eq, v in (kv.partition("=") for kv in spec.split(",")) if eq}  # "alone": {}
        stop_t, stop_p = threading.Event(), ctx.Event()
        threads = [threading.Thread(target=_spin_thread, args=(stop_t,), daemon=True) for _ in range(kw.get("threads", 0))]
        procs = [ctx.Process(target=_spin_proc, args=(stop_p, kw.get("nice", 5), kw.get("reserve", 0)), daemon=True)
                 for _ in range(kw.get("procs", 0))]
        for p in procs:
            p.start()
        for t in threads:
            t.start()
        time.sleep(0.3)
        sys.setswitchinterval(kw.get("switch_us", args.switch_interval_s * 1e6) / 1e6)
        try:
            ts = timed_calls(model, pieces, options, args.repeats, sync, None if texts else texts)
        finally:
            sys.setswitchinterval(args.switch_interval_s)
            stop_t.set()
            stop_p.set()
            for t in threads:
                t.join()
            for p in procs:
                p.join(5)
        ts.sort()
        med = ts[len(ts) // 2]
        rows.append({"condition": spec, "median_s": round(med, 4), "best_s": round(ts[0], 4),
                     "ms_per_piece": round(1e3 * med / len(pieces), 3), "speed_factor": round(audio_s / med, 1),
                     "calls_s": [round(t, 4) for t in ts]})
        print(f"{spec:28s} median {med * 1e3:7.1f} ms  best {ts[0] * 1e3:7.1f} ms  "
              f"{1e3 * med / len(pieces):.3f} ms/piece  {audio_s / med:,.0f}x", flush=True)
    if args.model_process:
        model.close()
        shm.release_owner(model)
    import hashlib

    texts_sha = hashlib.sha256("\n".join(texts).encode()).hexdigest()[:16]
    print(f"transcripts of the first call: sha256 {texts_sha} (equal across runs with and without "
          f"--model-process when the model process changes nothing)")
    base = [r["median_s"] for r in rows if r["condition"] == "alone"]
    ref = min(base) if base else rows[0]["median_s"]
    for r in rows:
        r["vs_alone"] = round(r["median_s"] / ref, 3)
    print("\ncondition                    vs alone")
    for r in rows:
        print(f"{r['condition']:28s} {r['vs_alone']:.2f}")

    env = {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
           "gpu": torch.cuda.get_device_name(0) if cuda else None, "host": platform.node()}
    try:
        import subprocess

        env["git_commit"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                                           text=True).stdout.strip() or None
    except OSError:
        pass
    out = {"benchmark": "model_contention", "env": env,
           "conditions": {"model": args.model, "device": args.device, "pieces": len(pieces),
                          "audio_s": round(audio_s, 1), "max_piece_s": args.max_piece_s, "repeats": args.repeats,
                          "model_process": bool(args.model_process), "model_load_s": round(load_s, 1),
                          "first_call_texts_sha256_16": texts_sha,
                          "switch_interval_s": args.switch_interval_s, "spinner_process_niceness_default": 5},
           "rows": rows}
    path = Path(args.json_out) if args.json_out else \
        REPO / "bench" / "results" / f"model_contention_{args.tag or ('gpu' if cuda else 'cpu')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
