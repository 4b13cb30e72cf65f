"""Time to a streaming final, and to a short upload's reply, while long uploads are in flight.

Issue #17 item 4: a streaming final or a short request never waits behind more than one model call
of offline work. A server (``python -m flashasr.serve.app``, ``--mode single|multi``, the model of
``--model`` on ``--device``) gets ``--uploads`` concurrent uploads of a long recording (real speech of
../shared/audio: the 69 s VoxPopuli recording and English clips up to ``--upload-s`` seconds, 16 kHz
WAV; ``--segmentation`` vad, the default, or none: Whisper's own seek over the whole upload). While
they are being transcribed, two loops run side by side, each repeated while uploads are unanswered:

* a stream (``/v1/stream``, binary PCM16 16 kHz, no partials) sends a 7.1 s clip at once and
  commits: time from the commit to ``...completed``;
* a short upload (the 2.97 s LibriSpeech clip, ``response_format=json``): time to the reply.

The same run ``--trials`` times in turn on the idle server first (``alone``). A measurement
counts as under load when uploads were unanswered as it started. Also: the server's model calls
over the loaded phase (``flashasr_engine_stage_seconds{stage="inference"}``: count, mean seconds): a
final waits for at most the call running when it arrives. Prints a table and writes
``bench/results/final_latency_<cpu|gpu><label>.json`` (or ``--out``).

Usage: ``python bench/bench_final_latency.py`` (CPU, the embedded tiny.en, 6 x 90 s uploads: the
issue's case). On a GPU (the H200 figure is the lead's run): ``python bench/bench_final_latency.py
--device cuda --model random:parakeet-tdt-0.6b-v3 --uploads 32 --upload-s 600`` (Parakeet shapes
with random weights: the timing of the real model; its chunked partials are off here, finals are
offline re-encodes as always). ``--src DIR``: run the server from another source tree (e.g. an
export of an older commit, for a before/after on the same machine); ``--label`` names the file.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import wave
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "bench"))

import numpy as np  # noqa: E402

from bench_cpu_audio import cpu_info, versions  # noqa: E402
from bench_serve import Server, _metric  # noqa: E402

AUDIO = Path(os.environ.get("FLASHASR_SHARED", REPO.parent / "shared")) / "audio"
STREAM_CLIP = AUDIO / "en" / "en-librivox-sense-sensibility-0870.wav"  # 7.1 s
SHORT_CLIP = AUDIO / "en" / "en-ls-61-70968-0002.wav"  # 2.97 s


def _wav_bytes(x: np.ndarray) -> bytes:
    import io

    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000)
        w.writeframes((np.clip(x, -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def _read_16k(path: Path, load_audio) -> np.ndarray:
    """float32 samples at 16 kHz: a 16 kHz mono PCM16 WAV through the stdlib (the GPU machine has no
    PyAV), anything else through flashasr's decoder."""
    with wave.open(str(path)) if path.suffix == ".wav" else contextlib.nullcontext() as w:
        if w and (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (16000, 1, 2):
            return np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float32) / 32768
    return load_audio(path).samples


def long_upload(seconds: float) -> bytes:
    from flashasr.audio import load_audio

    # the VoxPopuli recording as shared/audio holds it (ogg) or as a 16 kHz WAV beside it (the GPU
    # machine has no audio decoder: scripts/gpu_bench_stream.sh prepare writes one)
    long = sorted((AUDIO / "long").glob("long-en-voxpopuli-000.*"), key=lambda p: p.suffix != ".wav")[:1]
    names = [f"long/{p.name}" for p in long] + [f"en/{p.name}" for p in sorted((AUDIO / "en").glob("*.wav"))]
    parts, n = [], 0
    for name in names * 20:
        x = _read_16k(AUDIO / name, load_audio)
        parts += [x, np.zeros(8000, np.float32)]
        n += x.size + 8000
        if n >= seconds * 16000:
            break
    return _wav_bytes(np.concatenate(parts)[: int(seconds * 16000)])


def _pcm(path: Path) -> bytes:
    with wave.open(str(path)) as w:
        return w.readframes(w.getnframes())


async def stream_final(port: int, pcm: bytes) -> float:
    from websockets.asyncio.client import connect

    url = f"ws://127.0.0.1:{port}/v1/stream?sample_rate=16000&partial_interval_ms=0"
    async with connect(url, open_timeout=60, ping_interval=None, max_queue=None, compression=None) as ws:
        await ws.recv()
        for off in range(0, len(pcm), 32000):
            await ws.send(pcm[off:off + 32000])
        t0 = time.perf_counter()
        await ws.send('{"type": "commit"}')
        async for msg in ws:
            ev = json.loads(msg)
            if ev["type"].endswith("transcription.completed"):
                return time.perf_counter() - t0
            if ev["type"] == "error" or ev["type"].endswith("failed"):
                raise RuntimeError(ev)
    raise RuntimeError("stream closed before the final")


async def short_upload(client, base: str, body: bytes) -> float:
    t0 = time.perf_counter()
    r = await client.post(base + "/v1/audio/transcriptions", files={"file": ("short.wav", body)},
                          data={"response_format": "json"}, timeout=3600)
    r.raise_for_status()
    return time.perf_counter() - t0


async def trials(server: Server, n: int, pcm: bytes, short: bytes) -> list[dict]:
    """The idle server: ``n`` times a stream final, then a short upload."""
    import httpx

    out = []
    async with httpx.AsyncClient() as client:
        for _ in range(n):
            f = await stream_final(server.port, pcm)
            s = await short_upload(client, server.base, short)
            out.append({"final_s": round(f, 3), "short_upload_s": round(s, 3)})
            await asyncio.sleep(0.2)
    return out


async def loaded(server: Server, a, body: bytes, pcm: bytes, short: bytes) -> tuple[dict, list[float]]:
    """``a.uploads`` long uploads at once; meanwhile two loops, one of stream finals and one of short
    uploads, each repeated (0.2 s apart, at least once) while uploads are unanswered.
    A measurement counts as under load when uploads were unanswered as it *started* (a request that
    waited until the uploads were done still counts)."""
    import httpx

    pending = {"n": a.uploads}
    done_s: list[float] = []

    async def one(client):
        t0 = time.perf_counter()
        r = await client.post(server.base + "/v1/audio/transcriptions", files={"file": ("long.wav", body)},
                              data={"response_format": "json", "segmentation": a.segmentation}, timeout=7200)
        r.raise_for_status()
        pending["n"] -= 1
        done_s.append(time.perf_counter() - t0)

    async def repeat(fn) -> list[dict]:
        rows: list[dict] = []
        while pending["n"] > 0 or not rows:
            busy = pending["n"] > 0
            rows.append({"s": round(await fn(), 3), "under_load": busy, "t_start": round(time.perf_counter() - t0, 2)})
            await asyncio.sleep(0.2)
        return rows

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=a.uploads + 4)) as client:
        t0 = time.perf_counter()
        ups = [asyncio.ensure_future(one(client)) for _ in range(a.uploads)]
        await asyncio.sleep(a.settle_s)  # uploads read, decoded and planned: their pieces queued
        finals, shorts = await asyncio.gather(repeat(lambda: stream_final(server.port, pcm)),
                                              repeat(lambda: short_upload(client, server.base, short)))
        await asyncio.gather(*ups)
    return {"final": finals, "short_upload": shorts}, done_s


def _commit(src: str | None) -> str | None:
    """The git commit of the server's source tree (None when it is not a checkout)."""
    import subprocess

    try:
        return subprocess.run(["git", "-C", str(Path(src or REPO / "src")), "rev-parse", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def summary(rows: list[dict], key: str) -> dict:
    v = [r[key] for r in rows if r.get("under_load", True)]
    return {"n": len(v), "p50": round(statistics.median(v), 3), "max": round(max(v), 3)} if v else {"n": 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--mode", default="single", choices=("single", "multi"))
    ap.add_argument("--uploads", type=int, default=6)
    ap.add_argument("--upload-s", type=float, default=90.0)
    ap.add_argument("--segmentation", default="vad", choices=("vad", "none"))
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--settle-s", type=float, default=4.0)
    ap.add_argument("--label", default="")
    ap.add_argument("--src", default=None, help="the server's source tree (default: this checkout's src)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    body, pcm, short = long_upload(a.upload_s), _pcm(STREAM_CLIP), _wav_bytes(
        _read_16k(SHORT_CLIP, __import__("flashasr.audio", fromlist=["load_audio"]).load_audio))
    log = Path(tempfile.mktemp(prefix="final-latency-", suffix=".log"))
    args = ["--mode", a.mode, "--device", a.device] + (["--model", a.model] if a.model else [])
    if a.src:
        os.environ["PYTHONPATH"] = str(Path(a.src).resolve())
    load0 = os.getloadavg()
    server = Server(args, log, 300)
    try:
        alone = asyncio.run(trials(server, a.trials, pcm, short))
        m0 = server.metrics()
        c0 = _metric(m0, "flashasr_engine_stage_seconds_count", 'stage="inference"')
        s0 = _metric(m0, "flashasr_engine_stage_seconds_sum", 'stage="inference"')
        t0 = time.perf_counter()
        under, upload_s = asyncio.run(loaded(server, a, body, pcm, short))
        wall = time.perf_counter() - t0
        m1 = server.metrics()
        calls = _metric(m1, "flashasr_engine_stage_seconds_count", 'stage="inference"') - c0
        busy = _metric(m1, "flashasr_engine_stage_seconds_sum", 'stage="inference"') - s0
    finally:
        server.stop()
    res = {"bench": "final_latency", "model": a.model or "tiny.en", "device": a.device, "mode": a.mode,
           "uploads": a.uploads, "upload_s": a.upload_s, "segmentation": a.segmentation,
           "alone": {"final": summary(alone, "final_s"), "short_upload": summary(alone, "short_upload_s")},
           "under_load": {k: summary(rows, "s") for k, rows in under.items()},
           "trials": {"alone": alone, "loaded": under}, "uploads_reply_s": sorted(round(x, 1) for x in upload_s),
           "model_calls": {"n": int(calls), "mean_s": round(busy / calls, 3) if calls else None},
           "loaded_wall_s": round(wall, 1), "src": a.src or str(REPO / "src"), "commit": _commit(a.src),
           "loadavg_at_start": [round(x, 2) for x in load0],
           "machine": {"platform": platform.platform(), "cpu": cpu_info(), "cpus": os.cpu_count()},
           "versions": versions(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(f"{a.uploads} x {a.upload_s:g} s uploads (segmentation {a.segmentation}), {a.mode} mode, "
          f"{res['model']} on {a.device}; model calls during load: {res['model_calls']}")
    print(f"{'':12} {'final p50':>10} {'final max':>10} {'n':>4} {'short p50':>10} {'short max':>10} {'n':>4}")
    for k in ("alone", "under_load"):
        f, s = res[k]["final"], res[k]["short_upload"]
        print(f"{k:12} {f.get('p50', float('nan')):10.2f} {f.get('max', float('nan')):10.2f} {f['n']:4d} "
              f"{s.get('p50', float('nan')):10.2f} {s.get('max', float('nan')):10.2f} {s['n']:4d}")
    dev = "gpu" if a.device.startswith("cuda") else "cpu"
    out = Path(a.out) if a.out else REPO / "bench" / "results" / f"final_latency_{dev}{a.label}.json"
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
