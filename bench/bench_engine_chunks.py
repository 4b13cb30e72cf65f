"""CPU the engine process spends per streaming chunk (issue #13: the engine's work per partial).

At thousands of live streams every 0.5 s chunk of every stream crosses the engine process: a frame
in, the scheduler, one row of a batched streamer step, a reply out. The event loop and the model
thread share one GIL, so this CPU is time taken from the steps. Measured here without a GPU: the
real :class:`~flashasr.serve.engine_proc.EngineServer` (scheduler, options, framing) with the real
:class:`~flashasr.models.parakeet.streaming.ParakeetStreamer` host code (sample checks, windows,
tokens, texts) of the NeMo-made tiny fixture, whose device step is replaced by a stub that sleeps
(as a GPU step releases the GIL) and returns canned tokens. One front end (the real
:class:`~flashasr.serve.ipc.EngineClient`, in another process) sends N streams' chunks at real-time
pace over one connection.

Reported per chunk: the engine process's CPU (user + system, from ``/proc``), split by thread
(event loop, model thread) and the system part of each. ``--before-src DIR`` runs an earlier
tree's ``src`` the same way, alternating runs, so both are measured under the same load.

    python bench/bench_engine_chunks.py --before-src /tmp/base/src   # writes bench/results/engine_chunks_vm.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
CLK = os.sysconf("SC_CLK_TCK")


def _engine(src: str, path: str, fixture: str, stream_batch: int, step_s: float, row_s: float) -> None:
    sys.path.insert(0, src)
    import uvloop

    from flashasr.models.registry import load_model
    from flashasr.serve.config import ServeConfig
    from flashasr.serve.engine_proc import EngineServer, serve_unix

    model = load_model(fixture, device="cpu")
    cfg = ServeConfig(model=fixture, device="cpu", warmup=False, stream_batch=stream_batch,
                      stream_slots=stream_batch)
    srv = EngineServer(model, cfg)
    rng = np.random.default_rng(0)
    vocab = model.tokenizer.vocab_size
    canned = [[int(a), int(b)] if c < 0.8 else [] for a, b, c in
              zip(rng.integers(1, vocab - 1, 97), rng.integers(1, vocab - 1, 97), rng.random(97))]

    def device_step(seg, n_new, first, feat_valid, slots):  # a GPU step: the GIL released meanwhile
        time.sleep(step_s + row_s * len(slots))
        return [canned[(i + int(slots[0])) % 97] for i in range(len(slots))]

    srv.scheduler.streamer.device_step = device_step

    async def main():
        srv.scheduler.start()
        await serve_unix(path, srv.handle)

    uvloop.run(main())


async def _front_end(path: str, streams: int, seconds: float, cadence_s: float, tag: str) -> np.ndarray:
    from flashasr.options import TranscribeOptions
    from flashasr.serve.ipc import EngineClient

    client = EngineClient(path)
    await client.start()
    if not await client.wait_ready(120):
        raise SystemExit("the engine did not come up")
    opts = TranscribeOptions()
    chunk = (np.random.default_rng(1).standard_normal(int(16000 * cadence_s)) * 0.1).astype(np.float32)
    lat: list[float] = []

    async def stream(i: int):
        await asyncio.sleep(cadence_s * i / streams)
        due = time.perf_counter()
        for k in range(int(seconds / cadence_s)):
            t0 = time.perf_counter()
            await client.stream_chunk(f"{tag}{i}", chunk, opts, new=(k == 0))
            lat.append(time.perf_counter() - t0)
            due += cadence_s
            await asyncio.sleep(max(0.0, due - time.perf_counter()))

    await asyncio.gather(*(stream(i) for i in range(streams)))
    await client.close()
    return np.array(lat)


def _threads_cpu(pid: int) -> dict[str, tuple[float, float]]:
    """Per thread of ``pid``: (user + system, system) CPU seconds."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            raw = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        f = raw.rsplit(")", 1)[1].split()
        out[tid] = ((int(f[11]) + int(f[12])) / CLK, int(f[12]) / CLK)
    return out


def run_once(src: str, a) -> dict:
    ctx = mp.get_context("spawn")
    path = os.path.join(tempfile.mkdtemp(prefix="flashasr-bench-"), "engine.sock")
    p = ctx.Process(target=_engine, args=(src, path, a.fixture, a.stream_batch, a.step_ms / 1000, a.row_us / 1e6),
                    daemon=True)
    p.start()
    try:
        t_end = time.time() + 120
        while not os.path.exists(path) and time.time() < t_end:
            time.sleep(0.1)
        import uvloop

        uvloop.run(_front_end(path, 8, 2.0, a.cadence_ms / 1000, "warm"))  # warm-up: imports, first steps
        before = _threads_cpu(p.pid)
        t0 = time.perf_counter()
        lat = uvloop.run(_front_end(path, a.streams, a.seconds, a.cadence_ms / 1000, "s"))
        wall = time.perf_counter() - t0
        after = _threads_cpu(p.pid)
    finally:
        p.terminate()
        p.join(10)
    n = len(lat)
    used = sorted(((after[t][0] - before.get(t, (0, 0))[0], after[t][1] - before.get(t, (0, 0))[1], t)
                   for t in after), reverse=True)
    total = sum(u for u, _, _ in used)
    # the main thread (its id is the process's) runs the event loop: receive loop, scheduler, replies;
    # the busiest other thread is the model thread
    main_t = next(x for x in used if x[2] == str(p.pid))
    model_t = next(x for x in used if x[2] != str(p.pid))
    by = {role: {"us_per_chunk": round(1e6 * u / n, 1), "system_us_per_chunk": round(1e6 * s_ / n, 1)}
          for role, (u, s_, _) in (("event_loop", main_t), ("model_thread", model_t))}
    return {"chunks": n, "wall_s": round(wall, 2), "engine_cpu_us_per_chunk": round(1e6 * total / n, 1),
            "by_thread": by, "reply_p50_ms": round(1000 * float(np.median(lat)), 2),
            "reply_p95_ms": round(1000 * float(np.percentile(lat, 95)), 2), "load_avg_1m": os.getloadavg()[0]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=400)
    ap.add_argument("--seconds", type=float, default=15.0, help="measured seconds of audio per stream")
    ap.add_argument("--cadence-ms", type=float, default=500.0)
    ap.add_argument("--stream-batch", type=int, default=512)
    ap.add_argument("--step-ms", type=float, default=2.0, help="the stub device step: fixed part (GIL released)")
    ap.add_argument("--row-us", type=float, default=20.0, help="... and per row")
    ap.add_argument("--runs", type=int, default=2, help="runs of each tree, alternating")
    ap.add_argument("--before-src", help="an earlier tree's src folder, measured the same way")
    ap.add_argument("--fixture", default=None, help="the Parakeet .nemo (default: the shared tiny fixture)")
    ap.add_argument("--json-out", default=str(REPO / "bench" / "results" / "engine_chunks_vm.json"))
    a = ap.parse_args(argv)
    sys.path.insert(0, str(REPO / "src"))
    sys.path.insert(0, str(REPO / "bench"))
    if a.fixture is None:
        shared = Path(os.environ.get("FLASHASR_SHARED", REPO.parent / "shared"))
        a.fixture = str(shared / "fixtures" / "parakeet" / "tiny-tdt" / "model.nemo")
    from bench_offline_e2e import environment

    trees = {"this": str(REPO / "src")}
    if a.before_src:
        trees["before"] = str(Path(a.before_src).resolve())
    runs: dict[str, list] = {k: [] for k in trees}
    for r in range(a.runs):
        for name, src in trees.items():
            got = run_once(src, a)
            runs[name].append(got)
            print(f"{name:7s} run {r + 1}: {got['engine_cpu_us_per_chunk']:6.1f} us/chunk "
                  f"(event loop {got['by_thread']['event_loop']['us_per_chunk']}, model thread "
                  f"{got['by_thread']['model_thread']['us_per_chunk']}), reply p50 {got['reply_p50_ms']} ms", flush=True)
    summary = {k: {"engine_cpu_us_per_chunk_median": float(np.median([g["engine_cpu_us_per_chunk"] for g in v])),
                   "event_loop_us_median": float(np.median([g["by_thread"]["event_loop"]["us_per_chunk"] for g in v])),
                   "model_thread_us_median": float(np.median([g["by_thread"]["model_thread"]["us_per_chunk"] for g in v]))}
               for k, v in runs.items()}
    print(f"\n{'tree':8s} {'engine CPU us/chunk':>20s} {'event loop':>11s} {'model thread':>13s}")
    for k, v in summary.items():
        print(f"{k:8s} {v['engine_cpu_us_per_chunk_median']:20.1f} {v['event_loop_us_median']:11.1f} "
              f"{v['model_thread_us_median']:13.1f}")
    git = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = {"benchmark": "engine_chunks", "env": environment("cpu"),
           "conditions": {"streams": a.streams, "seconds": a.seconds, "cadence_ms": a.cadence_ms,
                          "stream_batch": a.stream_batch, "device_step_stub": {"fixed_ms": a.step_ms, "per_row_us": a.row_us},
                          "model": "NeMo tiny-tdt fixture (host code only; the device step is a stub)",
                          "front_end": "one EngineClient in another process, one connection, real-time pace",
                          "git_head": git, "trees": trees},
           "runs": runs, "summary": summary}
    Path(a.json_out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json_out).write_text(json.dumps(out, indent=1))
    print(f"wrote {a.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
