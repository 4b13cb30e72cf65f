"""Serving benchmark: streaming load, tail latency with and without gc.freeze(), and offline
transcription through the server against the same model in-process.

Starts ``flashasr serve`` (any model/device/mode; on the H200: ``--model
random:parakeet-tdt-0.6b-v3 --device cuda --mode multi --workers W``) and measures:

* **streaming**: N concurrent WebSocket streams (``/v1/stream``, binary PCM16, 16 kHz) of real
  speech at real-time pace in P ms packets, partials every ``--partial-ms`` of new audio, a
  commit after the last packet. Streams start spread over ``--ramp-s``. Clients run in
  ``--client-procs`` separate processes (one Python process cannot send tens of thousands of
  packets per second without becoming the bottleneck it is meant to measure). Reported:
  partial latency (packet holding the end of the audio a partial covers sent -> that partial
  received; every partial hypothesis via ``partials=full``), time to final (commit sent ->
  ``completed`` received), p50/p90/p95/p99, finals missing, server CPU (cores, all processes of
  the server), engine busy fraction and mean batch (from the engine's own metrics).
* **gc.freeze() on vs off**: the same configurations on a second server started with
  ``--no-gc-freeze``.
* **offline through the server**: ``--offline-requests`` uploads (WAV, clips cycled) with
  ``--offline-concurrency`` in flight -> aggregate speed factor and request latency, per client
  kind (``--offline-clients``: httpx, or aiohttp posting bodies encoded once) and
  ``--offline-repeats`` runs of each (the first kind's median run is the headline); then, with
  the servers stopped, the same waveforms through the same model spec in this process
  (``transcribe_batch`` in batches of ``--max-batch``): the serving overhead as a ratio.

Clips: 16 kHz mono PCM16 WAVs of ``--clip-min-s``..``--clip-max-s`` from ``--clips`` (default
``$FLASHASR_SHARED/audio/en`` or ``../shared/audio/en``).

    python bench/bench_serve.py --name serve_cpu --streams 8,32 --offline-requests 16  # CPU smoke
    # H200: see scripts/gpu_bench_serve.sh

Writes ``bench/results/<name>.json`` (and a copy under ``$OUT`` when set). Every phase is
time-boxed by ``--budget-s``; configurations left out for time are listed as skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import multiprocessing as mp
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import time
import wave
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("FLASHASR_SHARED", REPO.parent / "shared"))


# ----------------------------------------------------------------------------- helpers
def _pct(a: list[float]) -> dict:
    if not a:
        return {"n": 0}
    x = np.asarray(a) * 1000
    return {"n": len(a), **{f"p{p}_ms": round(float(np.percentile(x, p)), 1) for p in (50, 90, 95, 99)},
            "max_ms": round(float(x.max()), 1)}


def _read_clips(folder: Path, lo: float, hi: float, limit: int) -> list[tuple[str, bytes]]:
    out = []
    for f in sorted(folder.glob("*.wav")):
        try:
            with wave.open(str(f)) as w:
                if w.getframerate() != 16000 or w.getnchannels() != 1 or w.getsampwidth() != 2:
                    continue
                pcm = w.readframes(w.getnframes())
        except (OSError, EOFError, wave.Error):
            continue
        if lo <= len(pcm) / 32000 <= hi:
            out.append((f.name, pcm))
        if len(out) == limit:
            break
    if not out:
        raise SystemExit(f"no 16 kHz mono WAV clips of {lo}-{hi} s in {folder}")
    return out


def _wav(pcm: bytes) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(pcm)
    return buf.getvalue()


def _tree_cpu_s(root: int) -> float:
    """utime + stime (s) of ``root`` and all its descendants (live ones)."""
    parent: dict[int, int] = {}
    stat: dict[int, list[str]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                f = open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parent[int(d)] = int(f[1])
            stat[int(d)] = f
    keep, frontier = {root}, [root]
    while frontier:
        p = frontier.pop()
        for c, pp in parent.items():
            if pp == p and c not in keep:
                keep.add(c)
                frontier.append(c)
    tick = os.sysconf("SC_CLK_TCK")
    return sum((int(stat[p][11]) + int(stat[p][12])) / tick for p in keep if p in stat)


def _metric(text: str, name: str, label: str | None = None) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and len(line) > len(name) and line[len(name)] in " {":
            if label is None or label in line:
                total += float(line.rsplit(" ", 1)[1])
    return total


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent(sig: int = signal.SIGKILL) -> None:
    """In a client process forked by the benchmark (Linux): ``sig`` when the benchmark's process dies
    (``prctl(PR_SET_PDEATHSIG)``); a client left behind would block for ever handing its results
    to a queue nobody reads. Elsewhere nothing."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig))  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - not Linux
        pass


def _term_with_parent() -> None:
    """``preexec_fn`` of the server (Linux): SIGTERM when the benchmark's process dies, kept across
    ``exec``, so a benchmark killed with SIGKILL does not leave its server running (the server's own
    processes stop with it)."""
    _die_with_parent(signal.SIGTERM)


class Server:
    """``python -m flashasr.serve.app`` as a subprocess (own process group) on a loopback port; it
    stops when the benchmark's process dies (:func:`_term_with_parent`)."""

    def __init__(self, args: list[str], log_path: Path, ready_timeout: float, wrap: list[str] | None = None):
        """``wrap``: a command the server runs under (e.g. ``py-spy record ... --``); :meth:`stop` sends it
        SIGINT first and waits for it (py-spy then writes what it sampled)."""
        import httpx

        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        t0 = time.perf_counter()
        self.wrapped = bool(wrap)
        self.proc = subprocess.Popen([*(wrap or []), sys.executable, "-m", "flashasr.serve.app", "--port", str(self.port), *args],
                                     stdout=open(log_path, "wb"), stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, preexec_fn=_term_with_parent)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.log()}")
            try:
                r = httpx.get(self.base + "/ready", timeout=2)
                if r.status_code == 200:
                    self.info = r.json()
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() - t0 > ready_timeout:
                self.stop()
                raise RuntimeError(f"server not ready after {ready_timeout} s:\n{self.log()}")
            time.sleep(0.5)
        self.ready_s = time.perf_counter() - t0

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def metrics(self) -> str:
        import httpx

        return httpx.get(self.base + "/metrics", timeout=30).text

    def stop(self) -> None:
        if self.wrapped and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # the wrapper first (it may stop the server itself)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)  # what is left of the group
            except ProcessLookupError:
                pass
            time.sleep(2)
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


# ----------------------------------------------------------------------------- streaming clients
async def _stream(port: int, pcm: bytes, packet_ms: int, partial_ms: int, delay: float, out: dict,
                  deadline: float) -> None:
    from websockets.asyncio.client import connect

    await asyncio.sleep(delay)
    step = 32 * packet_ms  # bytes of 16 kHz PCM16 per packet
    url = (f"ws://127.0.0.1:{port}/v1/stream?sample_rate=16000&partial_interval_ms={partial_ms}"
           f"&partials=full")
    try:
        async with connect(url, open_timeout=60, ping_interval=None, max_queue=None, compression=None) as ws:
            await ws.recv()
            sent_at: list[float] = []  # wall time when packet k (bytes up to (k+1)*step) was sent
            state = {"commit": None}

            async def reader():
                async for msg in ws:
                    ev = json.loads(msg)
                    now = time.perf_counter()
                    typ = ev["type"]
                    if typ.endswith("transcription.partial"):
                        k = max(0, -(-ev["audio_end_ms"] * 32 // step) - 1)
                        if k < len(sent_at):
                            out["partial"].append(now - sent_at[k])
                    elif typ.endswith("transcription.completed"):
                        out["ttf"].append(now - state["commit"])
                        return
                    elif typ in ("error",) or typ.endswith("failed"):
                        out["errors"] += 1

            rt = asyncio.ensure_future(reader())
            t0 = time.perf_counter()
            for k, off in enumerate(range(0, len(pcm), step)):
                await asyncio.sleep(max(0.0, t0 + k * packet_ms / 1000 - time.perf_counter()))
                await ws.send(pcm[off:off + step])
                sent_at.append(time.perf_counter())
            out["late_s"].append(time.perf_counter() - (t0 + (len(sent_at) - 1) * packet_ms / 1000))
            state["commit"] = time.perf_counter()
            await ws.send('{"type": "commit"}')
            try:
                await asyncio.wait_for(rt, max(1.0, deadline - time.perf_counter()))
            except asyncio.TimeoutError:
                out["timeouts"] += 1
                rt.cancel()
    except Exception as e:  # noqa: BLE001 - a refused/broken connection is counted, not fatal
        out["connect_errors"] += 1
        out["last_error"] = f"{type(e).__name__}: {e}"[:200]


def _client_proc(port, pcms, n, packet_ms, partial_ms, ramp_s, seed, final_timeout_s, start_at, q) -> None:
    _die_with_parent()
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    out = {"partial": [], "ttf": [], "late_s": [], "timeouts": 0, "errors": 0, "connect_errors": 0,
           "last_error": None}
    rng = random.Random(seed)
    longest = max(len(p) for p in pcms) / 32000

    async def go():
        await asyncio.sleep(max(0.0, start_at - time.time()))
        deadline = time.perf_counter() + ramp_s + longest + final_timeout_s
        await asyncio.gather(*(_stream(port, pcms[(seed + i) % len(pcms)], packet_ms, partial_ms,
                                       rng.uniform(0, ramp_s), out, deadline) for i in range(n)))

    try:
        import uvloop

        uvloop.run(go())
    except ImportError:
        asyncio.run(go())
    q.put(out)


def run_streams(server: Server, pcms: list[bytes], n: int, packet_ms: int, a, partial_ms: int | None = None) -> dict:
    partial_ms = partial_ms or a.partial_ms
    procs = max(1, min(a.client_procs, n))
    shares = [n // procs + (1 if i < n % procs else 0) for i in range(procs)]
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    start_at = time.time() + 1.0 + n / 2000  # every client process connected and ready
    ps = [ctx.Process(target=_client_proc, args=(server.port, pcms, s, packet_ms, partial_ms, a.ramp_s,
                                                 1000 * i + n, a.final_timeout_s, start_at, q))
          for i, s in enumerate(shares) if s]
    for p in ps:
        p.start()
    time.sleep(max(0.0, start_at - time.time()))
    m0, cpu0, t0 = server.metrics(), _tree_cpu_s(server.proc.pid), time.perf_counter()
    outs = [q.get(timeout=a.ramp_s + max(len(p) for p in pcms) / 32000 + a.final_timeout_s + 120) for _ in ps]
    wall = time.perf_counter() - t0
    cpu = _tree_cpu_s(server.proc.pid) - cpu0
    m1 = server.metrics()
    for p in ps:
        p.join(10)
    agg = {k: sum((o[k] for o in outs), [] if isinstance(outs[0][k], list) else 0)
           for k in ("partial", "ttf", "late_s", "timeouts", "errors", "connect_errors")}
    inf_s = _metric(m1, "flashasr_engine_stage_seconds_sum", 'stage="inference"') - \
        _metric(m0, "flashasr_engine_stage_seconds_sum", 'stage="inference"')
    calls = _metric(m1, "flashasr_engine_stage_seconds_count", 'stage="inference"') - \
        _metric(m0, "flashasr_engine_stage_seconds_count", 'stage="inference"')
    rows = _metric(m1, "flashasr_engine_batch_size_sum") - _metric(m0, "flashasr_engine_batch_size_sum")
    return {"streams": n, "packet_ms": packet_ms, "partial_interval_ms": partial_ms, "client_procs": len(ps),
            "partial_latency": _pct(agg["partial"]), "time_to_final": _pct(agg["ttf"]),
            "finals": len(agg["ttf"]), "finals_timed_out": agg["timeouts"], "error_events": agg["errors"],
            "connect_errors": agg["connect_errors"],
            "last_error": next((o["last_error"] for o in outs if o["last_error"]), None),
            "client_send_lag_p99_ms": _pct(agg["late_s"]).get("p99_ms"),
            "server_cpu_cores": round(cpu / wall, 2), "wall_s": round(wall, 1),
            "engine_busy_fraction": round(inf_s / wall, 3), "engine_calls": int(calls),
            "engine_mean_batch": round(rows / calls, 1) if calls else None}


# ----------------------------------------------------------------------------- offline
def _multipart(wav: bytes, boundary: str) -> bytes:
    """A transcription request's multipart/form-data body (``response_format=json`` + the file),
    encoded once per clip: the aiohttp client posts these bytes as they are."""
    b = boundary.encode()
    return (b"--" + b + b'\r\nContent-Disposition: form-data; name="response_format"\r\n\r\njson\r\n'
            b"--" + b + b'\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
            b"Content-Type: audio/wav\r\n\r\n" + wav + b"\r\n--" + b + b"--\r\n")


def _offline_proc(base: str, bodies: list[bytes], order: list[int], concurrency: int, start_at: float, q,
                  client: str = "httpx") -> None:
    """One client process: ``order``'s uploads, ``concurrency`` in flight, latency and the reply's
    ``Server-Timing`` per request. ``client``: ``httpx`` (a multipart body built per request, pure
    Python HTTP) or ``aiohttp`` (bodies encoded once, C HTTP parser: far less client CPU per
    request, so the client's own time weighs less in the latencies and the in-flight count)."""
    _die_with_parent()
    lat: list[float] = []
    errors: list[int] = []
    stages: list[dict] = []  # each reply's Server-Timing split (ms), with the client's latency

    def done(t: float, status: int, timing: str) -> None:
        if status != 200:
            errors.append(status)
        else:
            stages.append({**_server_timing(timing), "client": (time.perf_counter() - t) * 1000})
        lat.append(time.perf_counter() - t)

    async def go_httpx():
        import httpx

        sem = asyncio.Semaphore(concurrency)
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as c:
            async def one(i):
                async with sem:
                    t = time.perf_counter()
                    try:
                        r = await c.post("/v1/audio/transcriptions", files={"file": ("a.wav", bodies[i])},
                                         data={"response_format": "json"})
                        done(t, r.status_code, r.headers.get("server-timing", ""))
                    except httpx.HTTPError:
                        errors.append(-1)
                        lat.append(time.perf_counter() - t)
            await asyncio.gather(*(one(i) for i in order))

    async def go_aiohttp():
        import aiohttp

        sem = asyncio.Semaphore(concurrency)
        boundary = "flashasr-bench-boundary"
        encoded = {i: _multipart(bodies[i], boundary) for i in set(order)}
        headers = {"Content-Type": f"multipart/form-data; boundary={boundary}"}
        conn = aiohttp.TCPConnector(limit=concurrency)
        async with aiohttp.ClientSession(base, connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as c:
            async def one(i):
                async with sem:
                    t = time.perf_counter()
                    try:
                        async with c.post("/v1/audio/transcriptions", data=encoded[i], headers=headers) as r:
                            await r.read()
                            done(t, r.status, r.headers.get("server-timing", ""))
                    except aiohttp.ClientError:
                        errors.append(-1)
                        lat.append(time.perf_counter() - t)
            await asyncio.gather(*(one(i) for i in order))

    async def go():
        await asyncio.sleep(max(0.0, start_at - time.time()))
        await (go_aiohttp() if client == "aiohttp" else go_httpx())

    import resource

    r0 = resource.getrusage(resource.RUSAGE_SELF)
    try:
        asyncio.run(go())
    except BaseException as e:  # noqa: BLE001 - the parent must hear of it, not wait for an answer
        q.put({"failed": f"{type(e).__name__}: {e}"})
        raise
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    q.put({"lat": lat, "errors": errors, "stages": stages,
           "cpu_s": (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)})


def _server_timing(value: str) -> dict:
    """``Server-Timing`` header -> {stage: ms} (``upload;dur=1.2, decode;dur=0.4, ...``)."""
    out = {}
    for part in value.split(","):
        name, _, dur = part.strip().partition(";dur=")
        try:
            out[name] = float(dur)
        except ValueError:
            pass
    return out


def _stage_split(stages: list[dict]) -> dict:
    """Where the uploads' time went, ms (p50 and mean of each ``Server-Timing`` stage; ``outside``:
    the client's latency less upload + total: the front end's queue before the handler, the reply's
    way back and the client itself)."""
    for st in stages:
        if "total" in st:
            st["outside"] = st["client"] - st["total"] - st.get("upload", 0.0)
    keys = ["upload", "decode", "plan", "transcribe", "total", "outside", "client"]
    return {k: {"p50": round(float(np.median(v)), 1), "mean": round(float(np.mean(v)), 1)}
            for k in keys if (v := [st[k] for st in stages if k in st])}


def run_offline(server: Server, clips: list[tuple[str, bytes]], a, client: str = "httpx",
                timeout_s: float = 900.0) -> dict:
    bodies = [_wav(pcm) for _, pcm in clips]
    order = [i % len(clips) for i in range(a.offline_requests)]
    procs = max(1, min(a.client_procs, a.offline_concurrency))
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    start_at = time.time() + 1.0
    ps = [ctx.Process(target=_offline_proc, args=(server.base, bodies, order[k::procs],
                                                  max(1, a.offline_concurrency // procs), start_at, q, client))
          for k in range(procs)]
    for p in ps:
        p.start()
    time.sleep(max(0.0, start_at - time.time()))
    m0, cpu0 = server.metrics(), _tree_cpu_s(server.proc.pid)
    t0 = time.perf_counter()
    outs = [q.get(timeout=max(30.0, timeout_s)) for _ in ps]
    wall = time.perf_counter() - t0
    failed = [o["failed"] for o in outs if "failed" in o]
    if failed:
        for p in ps:
            p.join(10)
        raise RuntimeError(f"upload client ({client}) failed: {failed[0]}")
    cpu = _tree_cpu_s(server.proc.pid) - cpu0
    m1 = server.metrics()
    for p in ps:
        p.join(10)
    lat = sum((o["lat"] for o in outs), [])
    errors = sum((o["errors"] for o in outs), [])
    audio_s = sum(len(clips[i][1]) for i in order) / 32000
    inf_s = _metric(m1, "flashasr_engine_stage_seconds_sum", 'stage="inference"') - \
        _metric(m0, "flashasr_engine_stage_seconds_sum", 'stage="inference"')
    calls = _metric(m1, "flashasr_engine_stage_seconds_count", 'stage="inference"') - \
        _metric(m0, "flashasr_engine_stage_seconds_count", 'stage="inference"')
    rows = _metric(m1, "flashasr_engine_batch_size_sum") - _metric(m0, "flashasr_engine_batch_size_sum")
    return {"client": client, "requests": len(order), "concurrency": a.offline_concurrency, "client_procs": procs,
            "audio_s": round(audio_s, 1), "wall_s": round(wall, 3), "speed_factor": round(audio_s / wall, 1),
            "errors": len(errors), "latency": _pct(lat),
            "stages_ms": _stage_split(sum((o["stages"] for o in outs), [])), "server_cpu_cores": round(cpu / wall, 2),
            "client_cpu_cores": round(sum(o["cpu_s"] for o in outs) / wall, 2),
            "engine_busy_fraction": round(inf_s / wall, 3), "engine_calls": int(calls),
            "engine_mean_batch": round(rows / calls, 1) if calls else None, "engine_inference_s": round(inf_s, 3)}


def run_in_process(clips: list[tuple[str, bytes]], a) -> dict:
    from flashasr.pipeline import load_model  # as the server loads it: behind its GPU engine on CUDA

    t0 = time.perf_counter()
    model = load_model(a.model, device=a.device)
    load_s = time.perf_counter() - t0
    waves = [np.frombuffer(clips[i % len(clips)][1], "<i2").astype(np.float32) / 32768.0
             for i in range(a.offline_requests)]
    audio_s = sum(map(len, waves)) / 16000

    def once():
        t = time.perf_counter()
        for s in range(0, len(waves), a.max_batch):
            model.transcribe_batch(waves[s: s + a.max_batch])
        return time.perf_counter() - t

    def overlapped():  # each batch queued on the device before the previous one's results are read
        t = time.perf_counter()
        prev = None
        for s in range(0, len(waves), a.max_batch):
            cur = model.submit_batch(waves[s: s + a.max_batch])
            if prev is not None:
                prev.result()
            prev = cur
        prev.result()
        return time.perf_counter() - t

    once()  # first use of each shape
    walls = [once() for _ in range(3)]
    best = min(walls)
    out = {"audio_s": round(audio_s, 1), "batch": a.max_batch, "wall_s_runs": [round(w, 3) for w in walls],
           "speed_factor_best": round(audio_s / best, 1),
           "speed_factor_median": round(audio_s / sorted(walls)[1], 1), "model_load_s": round(load_s, 1),
           "note": "float32 waveforms already in memory; transcribe_batch of the model the server loads"}
    if hasattr(model, "submit_batch"):  # the engine's overlapping calls, as the server's scheduler runs them
        walls = [overlapped() for _ in range(3)]
        out["overlapped"] = {"wall_s_runs": [round(w, 3) for w in walls],
                             "speed_factor_best": round(audio_s / min(walls), 1),
                             "note": "the same batches through submit_batch, each queued before the previous "
                                     "one's results are read"}
    return out


# ----------------------------------------------------------------------------- main
CLIENT_KINDS = ("aiohttp", "httpx")


def _client_kinds(value: str) -> list[str]:
    """``--offline-clients``: comma-separated kinds of :data:`CLIENT_KINDS`, each importable."""
    kinds = [k.strip() for k in value.split(",") if k.strip()]
    bad = [k for k in kinds if k not in CLIENT_KINDS]
    if not kinds or bad:
        raise argparse.ArgumentTypeError(f"expected one or more of {', '.join(CLIENT_KINDS)} (comma-separated), "
                                         f"got {value!r}")
    for k in kinds:
        try:
            __import__(k)
        except ImportError:
            raise argparse.ArgumentTypeError(f"client {k!r} needs the {k} package (pip install {k}; it comes "
                                             "with flashasr's dev extra)") from None
    return kinds


def _non_negative(value: str) -> int:
    n = int(value)
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more, got {n}")
    return n


def _at_least_one(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1, got {n}")
    return n


def _env(a) -> dict:
    rec = {"time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "platform": platform.platform(),
           "python": sys.version.split()[0], "cpus": os.cpu_count()}
    try:
        import torch

        rec["torch"] = torch.__version__
        if torch.cuda.is_available():
            rec["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model spec (default: the server's default, whisper tiny.en)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--mode", default="single", choices=("single", "multi"))
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--batch-wait-ms", type=float, default=2.0)
    ap.add_argument("--server-args", default="", help="extra flashasr serve options (one string)")
    ap.add_argument("--clips", default=str(SHARED / "audio" / "en"))
    ap.add_argument("--clip-min-s", type=float, default=4.0)
    ap.add_argument("--clip-max-s", type=float, default=12.0)
    ap.add_argument("--max-clips", type=int, default=16)
    ap.add_argument("--streams", default="8,32", help="comma-separated concurrent stream counts")
    ap.add_argument("--packets", default="20,200", help="comma-separated packet sizes (ms)")
    ap.add_argument("--extra", default="", help="more configs 'N:P[:C],...' (streams:packet ms[:partial cadence ms])")
    ap.add_argument("--gc-compare", default="", help="configs 'N:P,...' also run on a --no-gc-freeze server")
    ap.add_argument("--partial-ms", type=int, default=500)
    ap.add_argument("--ramp-s", type=float, default=1.0)
    ap.add_argument("--client-procs", type=int, default=max(1, (os.cpu_count() or 2) // 4))
    ap.add_argument("--final-timeout-s", type=float, default=30.0)
    ap.add_argument("--offline-requests", type=_non_negative, default=16, help="uploads (0: none)")
    ap.add_argument("--offline-concurrency", type=_at_least_one, default=256)
    ap.add_argument("--offline-clients", type=_client_kinds, default="aiohttp",
                    help="client kinds for the uploads, each run in turn: httpx and/or aiohttp (the first is the "
                         "headline; aiohttp comes with the dev extra)")
    ap.add_argument("--offline-repeats", type=_at_least_one, default=1,
                    help="runs of the uploads per client kind (the headline: the first kind's median run, the "
                         "slower one of the middle two)")
    ap.add_argument("--no-in-process", action="store_true")
    ap.add_argument("--ready-timeout-s", type=float, default=600.0)
    ap.add_argument("--budget-s", type=float, default=480.0, help="wall budget for everything")
    ap.add_argument("--name", default="serve_cpu")
    ap.add_argument("--target-partial-p95-ms", type=float, default=100.0)
    ap.add_argument("--target-final-p95-ms", type=float, default=150.0)
    ap.add_argument("--only-in-process", action="store_true",
                    help="no server: only the in-process reference on the same clips (its own JSON)")
    a = ap.parse_args(argv)
    # a SIGTERM (a time limit around the run) or SIGHUP (the terminal closed) unwinds like Ctrl-C, so the
    # server is stopped too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGHUP, lambda *_: sys.exit(129))
    t_start = time.perf_counter()
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    clips = _read_clips(Path(a.clips), a.clip_min_s, a.clip_max_s, a.max_clips)
    pcms = [pcm for _, pcm in clips]
    def cfg(x: str) -> tuple[int, int, int]:  # "N:P" or "N:P:C" (C: partial cadence, ms)
        v = [int(y) for y in x.split(":")]
        return (v[0], v[1], v[2] if len(v) > 2 else a.partial_ms)

    stream_cfgs = [(int(n), int(p), a.partial_ms) for n in a.streams.split(",") if n for p in a.packets.split(",") if p]
    stream_cfgs += [cfg(x) for x in a.extra.split(",") if x]
    gc_cfgs = [cfg(x) for x in a.gc_compare.split(",") if x]
    base_args = [*(["--model", a.model] if a.model else []), "--device", a.device, "--mode", a.mode,
                 "--workers", str(a.workers), "--max-batch", str(a.max_batch), "--batch-wait-ms",
                 str(a.batch_wait_ms), "--log-level", "warning", *a.server_args.split()]
    out_path = REPO / "bench" / "results" / f"{a.name}.json"
    result = {"benchmark": "bench_serve", "env": _env(a),
              "conditions": {"model": a.model or "whisper tiny.en (default)", "device": a.device, "mode": a.mode,
                             "frontend_workers": a.workers, "max_batch": a.max_batch,
                             "batch_wait_ms": a.batch_wait_ms, "server_args": a.server_args,
                             "clips": [n for n, _ in clips], "clip_seconds": [round(len(p) / 32000, 2) for p in pcms],
                             "endpoint": "/v1/stream (binary PCM16 16 kHz, no server VAD, commit at end)",
                             "partial_interval_ms": a.partial_ms, "pace": "real time", "ramp_s": a.ramp_s,
                             "offline_clients": a.offline_clients, "offline_repeats": a.offline_repeats,
                             "clients": "same host, separate processes"},
              "servers": {}, "streaming": [], "offline_via_server": None, "in_process": None, "skipped": []}

    def save():
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(result, indent=1))
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], out_path.name).write_text(out_path.read_text())

    def left() -> float:
        return a.budget_s - (time.perf_counter() - t_start)

    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    if a.only_in_process:
        result["in_process"] = run_in_process(clips, a)
        print(f"in process: {result['in_process']['speed_factor_best']}x (best of 3)", flush=True)
        save()
        return 0
    for freeze in (True, False):
        cfgs = stream_cfgs if freeze else gc_cfgs
        if not freeze and not cfgs:
            break
        key = "gc_freeze" if freeze else "no_gc_freeze"
        if left() < 60:
            result["skipped"] += [{"streams": n, "packet_ms": p, "partial_ms": c, key: True} for n, p, c in cfgs]
            continue
        try:
            server = Server(base_args + ([] if freeze else ["--no-gc-freeze"]), tmp / f"bench-serve-{key}.log",
                            min(a.ready_timeout_s, left()))
        except RuntimeError as e:
            result["servers"][key] = {"error": str(e)[-2000:]}
            print(f"{key}: server failed: {str(e)[-600:]}", flush=True)
            save()
            continue
        result["servers"][key] = {"ready_s": round(server.ready_s, 1), "info": server.info}
        print(f"{key}: server ready in {server.ready_s:.1f} s ({server.info})", flush=True)
        try:
            if freeze and a.offline_requests:
                runs = result["offline_runs"] = []
                for rep in range(a.offline_repeats):
                    for client in a.offline_clients:
                        r = run_offline(server, clips, a, client, timeout_s=left())
                        runs.append(r)
                        print(f"offline via server ({client}, run {rep + 1}): {r['requests']} requests "
                              f"x{r['concurrency']} in flight: {r['speed_factor']}x, p50/p99 "
                              f"{r['latency'].get('p50_ms')}/{r['latency'].get('p99_ms')} ms, errors {r['errors']}, "
                              f"engine busy {r['engine_busy_fraction']} batch {r['engine_mean_batch']}, "
                              f"server cpu {r['server_cpu_cores']} client cpu {r['client_cpu_cores']}", flush=True)
                        print("  p50 ms by stage: " + ", ".join(f"{k} {v['p50']}" for k, v in r["stages_ms"].items()),
                              flush=True)
                        save()
                # the headline: the median run of the first client kind
                first = sorted((r for r in runs if r["client"] == runs[0]["client"]), key=lambda r: r["speed_factor"])
                result["offline_via_server"] = first[(len(first) - 1) // 2]
                save()
            for n, pk, cad in cfgs:
                need = a.ramp_s + max(len(p) for p in pcms) / 32000 + 15 + n / 500
                if left() < need + (40 if freeze and gc_cfgs else 0):
                    result["skipped"].append({"streams": n, "packet_ms": pk, "partial_ms": cad, key: True})
                    continue
                r = {"gc_freeze": freeze, **run_streams(server, pcms, n, pk, a, cad)}
                result["streaming"].append(r)
                p, f = r["partial_latency"], r["time_to_final"]
                print(f"{key:12s} streams={n:5d} packet={pk:3d} ms cadence={cad} ms  partial p50/p95/p99 {p.get('p50_ms')}/"
                      f"{p.get('p95_ms')}/{p.get('p99_ms')} ms  final p50/p95/p99 {f.get('p50_ms')}/{f.get('p95_ms')}/"
                      f"{f.get('p99_ms')} ms  finals {r['finals']}/{n}  conn-err {r['connect_errors']}  cpu "
                      f"{r['server_cpu_cores']}  busy {r['engine_busy_fraction']} batch {r['engine_mean_batch']}",
                      flush=True)
                save()
        except Exception as e:  # noqa: BLE001 - keep what was measured
            result.setdefault("errors", []).append(f"{key}: {type(e).__name__}: {e}"[:1000])
            print(f"{key}: failed: {e}\n{server.log()}", flush=True)
        finally:
            server.stop()
    if a.offline_requests and not a.no_in_process and left() > 30:
        try:
            r = run_in_process(clips, a)
            result["in_process"] = r
            via = result["offline_via_server"]
            if via:
                r["server_over_in_process"] = round(via["speed_factor"] / r["speed_factor_best"], 3)
                if "overlapped" in r:
                    r["server_over_overlapped"] = round(via["speed_factor"] / r["overlapped"]["speed_factor_best"], 3)
                for run in result.get("offline_runs", []):
                    run["over_in_process"] = round(run["speed_factor"] / r["speed_factor_best"], 3)
            over = f"; overlapped calls {r['overlapped']['speed_factor_best']}x" if "overlapped" in r else ""
            print(f"in process: {r['speed_factor_best']}x (best of 3); server/in-process "
                  f"{r.get('server_over_in_process')}{over}", flush=True)
        except Exception as e:  # noqa: BLE001
            result.setdefault("errors", []).append(f"in_process: {type(e).__name__}: {e}"[:1000])
    ok = [r for r in result["streaming"] if r["gc_freeze"] and r["finals"] == r["streams"]
          and r["partial_latency"].get("p95_ms", 1e9) <= a.target_partial_p95_ms
          and r["time_to_final"].get("p95_ms", 1e9) <= a.target_final_p95_ms]
    result["targets"] = {"partial_p95_ms": a.target_partial_p95_ms, "final_p95_ms": a.target_final_p95_ms,
                         "most_streams_within": {f"packet {pk} ms, cadence {c} ms": max(
                             r["streams"] for r in ok if (r["packet_ms"], r["partial_interval_ms"]) == (pk, c))
                             for pk, c in sorted({(r["packet_ms"], r["partial_interval_ms"]) for r in ok})}}
    result["total_wall_s"] = round(time.perf_counter() - t_start, 1)
    save()
    print("wrote", out_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
