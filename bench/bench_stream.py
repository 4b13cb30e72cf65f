"""Concurrent real-time streams against `flashasr serve` (binary WebSocket mode, CPU, tiny.en).

Each stream sends a real clip at real-time pace in fixed packets (20 ms or 200 ms), gets
partials (``...delta`` events, 500 ms cadence) and, after the last packet, commits and waits
for the final (``...completed``). Measured per configuration:

* partial latency: time from sending the packet that holds the end of the audio a partial
  covers (its ``audio_end_ms``) to receiving that partial (every partial hypothesis, via the
  ``partials=full`` extension, not only the agreed ``delta`` words);
* time to final: commit sent -> ``completed`` received;
* server CPU: (utime + stime) of the server process over the run / wall time, in cores.

Runs with and without ``gc.freeze()`` (``--no-gc-freeze``) on otherwise equal servers.

    python bench/bench_stream.py                 # writes bench/results/stream_cpu.json

A global budget (``--budget-s``, default 110 s of streaming per server) skips the remaining
configurations when the CPU is slower than planned; skipped ones are listed in the JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
import wave
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "bench"))
CLIP = REPO.parent / "shared" / "audio" / "en" / "en-librivox-sense-sensibility-0870.wav"  # 7.1 s, 16 kHz


def _pcm(path: Path) -> bytes:
    with wave.open(str(path)) as w:
        assert w.getframerate() == 16000 and w.getnchannels() == 1
        return w.readframes(w.getnframes())


# one stream client, percentiles and server CPU: shared with bench_serve.py (the multi-process,
# any-model version of this benchmark)
from bench_serve import _pct, _stream, _tree_cpu_s  # noqa: E402


def run_config(server, pcm: bytes, n: int, packet_ms: int, timeout_s: float) -> dict:
    out = {"partial": [], "ttf": [], "late_s": [], "timeouts": 0, "errors": 0, "connect_errors": 0,
           "last_error": None}
    rng = np.random.default_rng(n * 1000 + packet_ms)
    cpu0, t0 = _tree_cpu_s(server.proc.pid), time.perf_counter()
    deadline = t0 + len(pcm) / 32000 + 1.0 + timeout_s

    async def go():
        await asyncio.gather(*(_stream(server.port, pcm, packet_ms, 500, float(rng.uniform(0, 1.0)), out, deadline)
                               for _ in range(n)), return_exceptions=False)

    import uvloop

    uvloop.run(go())
    wall = time.perf_counter() - t0
    cpu = _tree_cpu_s(server.proc.pid) - cpu0
    return {"streams": n, "packet_ms": packet_ms, "audio_s_per_stream": round(len(pcm) / 32000, 2),
            "partial_latency": _pct(out["partial"]), "time_to_final": _pct(out["ttf"]),
            "finals_timed_out": out["timeouts"], "server_cpu_cores": round(cpu / wall, 2), "wall_s": round(wall, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", default="1,8,100", help="comma-separated concurrent stream counts")
    ap.add_argument("--packets", default="20,200", help="comma-separated packet sizes in ms")
    ap.add_argument("--budget-s", type=float, default=110.0, help="streaming time budget per server")
    ap.add_argument("--final-timeout-s", type=float, default=40.0)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "stream_cpu.json"))
    args = ap.parse_args(argv)
    import resource
    import tempfile

    from test_serve_util import Server

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    pcm = _pcm(CLIP)
    streams = [int(x) for x in args.streams.split(",")]
    packets = [int(x) for x in args.packets.split(",")]
    results, skipped, offline_s = [], [], {}
    tmp = Path(tempfile.mkdtemp(prefix="flashasr-bench-stream-"))
    for freeze in (True, False):
        server = Server(tmp, *([] if freeze else ["--no-gc-freeze"]), "--log-level", "warning")
        # reference: the same clip offline through HTTP on this server now (model speed under current load)
        import httpx

        t = time.perf_counter()
        httpx.post(server.base + "/v1/audio/transcriptions", files={"file": ("c.wav", CLIP.read_bytes())},
                   timeout=120).raise_for_status()
        offline_s[freeze] = round(time.perf_counter() - t, 2)
        print(f"gc_freeze={freeze}: offline transcription of the {len(pcm) / 32000:.1f} s clip took "
              f"{offline_s[freeze]} s", flush=True)
        t_budget = time.perf_counter() + args.budget_s
        try:
            for n in streams:
                for pk in packets:
                    if not freeze and (n, pk) != (streams[min(1, len(streams) - 1)], packets[0]):
                        continue  # gc comparison: one configuration
                    if time.perf_counter() > t_budget:
                        skipped.append({"streams": n, "packet_ms": pk, "gc_freeze": freeze})
                        continue
                    r = {"gc_freeze": freeze, **run_config(server, pcm, n, pk, args.final_timeout_s)}
                    results.append(r)
                    p, f = r["partial_latency"], r["time_to_final"]
                    print(f"gc_freeze={freeze!s:5} streams={n:4} packet={pk:3} ms  partial p50/p99 "
                          f"{p.get('p50_ms', '-')}/{p.get('p99_ms', '-')} ms  final p50/p99 {f.get('p50_ms', '-')}/"
                          f"{f.get('p99_ms', '-')} ms  timeouts {r['finals_timed_out']}  cpu {r['server_cpu_cores']}"
                          f" cores", flush=True)
        finally:
            server.stop()
    out = {"benchmark": "bench_stream", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": sys.version.split()[0],
                       "loadavg_at_end": os.getloadavg(),
                       "note": "shared 2-core development machine with other jobs running; CPU only, no GPU "
                               "figures (the GPU machine was not available to the serving engineer)"},
           "conditions": {"model": "whisper tiny.en (flashasr, CPU, OMP_NUM_THREADS=2)", "mode": "single process",
                          "clip": CLIP.name, "endpoint": "/v1/stream (binary PCM16, 16 kHz)",
                          "partial_interval_ms": 500, "pace": "real time"},
           "offline_transcription_s": {("gc_freeze" if k else "no_gc_freeze"): v for k, v in offline_s.items()},
           "results": results, "skipped_for_budget": skipped}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
