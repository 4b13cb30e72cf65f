"""Moving audio between processes: our Unix-socket framing (inline), shared memory, ZeroMQ.

The sender is a front end (asyncio, N concurrent requests multiplexed over ONE persistent
connection, the real :class:`flashasr.serve.ipc.EngineClient`); the receiver is a separate
process that takes each waveform out into its own memory (what the engine does) and answers
with a small reply. Measured: round-trip latency per message (p50/p99) and throughput
(MB/s, seconds of 16 kHz float32 audio per second).

    python bench/bench_ipc.py            # writes bench/results/ipc_cpu.json

ZeroMQ: pyzmq DEALER/ROUTER over ipc://, zero-copy sends (``copy=False``), same reply shape.
10 min x 256 concurrent would put 9.8 GB in flight on a 23 GB shared machine: 10 min runs
at 1 and 32 concurrent senders instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import struct
import sys
import tempfile
import time

import numpy as np

SR = 16000


# ------------------------------------------------------------------ receivers
def _recv_framing(path: str) -> None:
    from flashasr.serve import ipc
    from flashasr.serve.engine_proc import die_with_parent

    die_with_parent()

    async def handle(conn):
        await conn.send(ipc.encode(ipc.MsgType.HELLO, 0, {"model": "bench", "pid": os.getpid()}))
        try:
            while True:
                f = await conn.recv_frame()
                a = ipc.unpack_audio(f)  # the samples as the engine gets them (socket: no extra copy)
                await conn.send(ipc.encode(ipc.MsgType.RESULT, f.req_id, {"text": "", "segments": [],
                                                                          "duration": a.size / SR}))
        except (asyncio.IncompleteReadError, ConnectionError):
            conn.close()

    import uvloop

    from flashasr.serve.engine_proc import serve_unix

    uvloop.run(serve_unix(path, handle))


def _recv_zmq(addr: str) -> None:
    import zmq

    from flashasr.serve.engine_proc import die_with_parent

    die_with_parent()

    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    s.bind(addr)
    while True:
        ident, head, payload = s.recv_multipart(copy=False)
        a = np.frombuffer(payload.buffer, np.float32).copy()
        s.send_multipart([ident, head.bytes + struct.pack("<d", a.size / SR)])


# -------------------------------------------------------------------- senders
async def _run_framing(path: str, audio: np.ndarray, conc: int, per: int, shm_threshold: int) -> list[float]:
    from flashasr.serve.ipc import EngineClient

    c = EngineClient(path, shm_threshold=shm_threshold)
    await c.start()
    assert await c.wait_ready(30)
    lat: list[float] = []
    # warm-up at the same concurrency: a long-running front end has its shared-memory pool filled
    await asyncio.gather(*(c.transcribe(audio) for _ in range(conc)))

    async def one():
        for _ in range(per):
            t = time.perf_counter()
            await c.transcribe(audio)
            lat.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(conc)))
    lat.append(-(time.perf_counter() - t0))  # wall time of the timed part (popped by the caller)
    await c.close()
    return lat


async def _run_zmq(addr: str, audio: np.ndarray, conc: int, per: int) -> list[float]:
    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    s = ctx.socket(zmq.DEALER)
    s.connect(addr)
    pending: dict[int, asyncio.Future] = {}
    lat: list[float] = []
    ids = iter(range(1, 1 << 62))

    async def reader():
        while True:
            (head,) = await s.recv_multipart()
            pending.pop(struct.unpack("<Q", head[:8])[0]).set_result(None)

    rt = asyncio.ensure_future(reader())
    view = memoryview(audio).cast("B")

    async def one(per=per):
        loop = asyncio.get_running_loop()
        for _ in range(per):
            rid = next(ids)
            fut = loop.create_future()
            pending[rid] = fut
            t = time.perf_counter()
            await s.send_multipart([struct.pack("<QI", rid, audio.size), view], copy=False)
            await fut
            lat.append(time.perf_counter() - t)

    await asyncio.gather(*(one(1) for _ in range(conc)))  # warm-up, as for the socket paths
    lat.clear()
    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(conc)))
    lat.append(-(time.perf_counter() - t0))
    rt.cancel()
    s.close(0)
    ctx.term()
    return lat


def _stats(lat: list[float], wall: float, nbytes: int, audio_s: float) -> dict:
    a = np.sort(np.asarray(lat)) * 1000
    n = len(lat)
    return {"messages": n, "p50_ms": round(float(np.percentile(a, 50)), 3),
            "p99_ms": round(float(np.percentile(a, 99)), 3), "mean_ms": round(float(a.mean()), 3),
            "throughput_MBps": round(n * nbytes / wall / 1e6, 1),
            "audio_s_per_s": round(n * audio_s / wall, 1), "wall_s": round(wall, 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "ipc_cpu.json"))
    ap.add_argument("--quick", action="store_true", help="fewer messages (smoke run)")
    args = ap.parse_args(argv)
    import uvloop

    tmp = tempfile.mkdtemp(prefix="flashasr-bench-")
    path = os.path.join(tmp, "e.sock")
    zaddr = "ipc://" + os.path.join(tmp, "z.sock")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_recv_framing, args=(path,), daemon=True),
             ctx.Process(target=_recv_zmq, args=(zaddr,), daemon=True)]
    for p in procs:
        p.start()
    q = 4 if args.quick else 1
    # (label, seconds of audio, [(concurrent senders, messages per sender)])
    plan = [("1 s", 1.0, [(1, 300 // q), (256, 4)]),
            ("30 s", 30.0, [(1, 40 // q), (256, 1)]),
            ("10 min", 600.0, [(1, 6 // min(q, 2)), (32, 1)])]
    rows = []
    try:
        time.sleep(1.0)
        for label, secs, confs in plan:
            audio = (np.random.default_rng(0).standard_normal(int(secs * SR)) * 0.1).astype(np.float32)
            for conc, per in confs:
                for method in ("socket", "shm", "zmq"):
                    if method == "zmq":
                        run = lambda: _run_zmq(zaddr, audio, conc, per)  # noqa: E731
                    else:
                        thr = 1 << 40 if method == "socket" else 0
                        run = lambda thr=thr: _run_framing(path, audio, conc, per, thr)  # noqa: E731
                    # pyzmq's asyncio integration needs the stock event loop (edge-triggered zmq FD)
                    runner = asyncio.run if method == "zmq" else uvloop.run
                    lat = runner(run())
                    wall = -lat.pop()
                    r = {"audio": label, "method": method, "concurrency": conc, **_stats(lat, wall, audio.nbytes, secs)}
                    rows.append(r)
                    print(f"{label:>6} {method:>6} x{conc:<3} p50 {r['p50_ms']:9.3f} ms  p99 {r['p99_ms']:9.3f} ms"
                          f"  {r['throughput_MBps']:8.1f} MB/s  {r['audio_s_per_s']:10.1f} audio-s/s", flush=True)
    finally:
        for p in procs:
            p.terminate()
            p.join(5)
        for f in os.listdir(tmp):
            os.unlink(os.path.join(tmp, f))
        os.rmdir(tmp)
    import zmq

    out = {"benchmark": "bench_ipc", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": sys.version.split()[0],
                       "note": "shared 2-core development machine, other jobs running; CPU only (no GPU figures)"},
           "versions": {"numpy": np.__version__, "pyzmq": zmq.__version__, "libzmq": zmq.zmq_version()},
           "conditions": "audio float32 16 kHz; one persistent connection per method; the receiver gets each "
                         "waveform as the engine does (socket: received into its own array; shm: pooled segment "
                         "read in place, one-off segments copied out; zmq: copied out of the message) and replies "
                         "with a small message; latency = round trip; one untimed warm-up pass at the same "
                         "concurrency first (fills the shared-memory pool)",
           "results": rows}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", args.out)
    return 0



if __name__ == "__main__":
    raise SystemExit(main())
