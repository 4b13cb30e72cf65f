"""Uploads through the pipeline: the server cuts like the CLI, off the model thread, with fair turns.

* In process, with a fake slow model (each call sleeps 0.2 s): the splitter runs in the CPU pool
  (``flashasr-cpu``), never on the model thread (``flashasr-model``), and a short upload sent
  while a 40-piece upload is being transcribed is answered after about one batch in flight, not
  after the 20 batches a first-come-first-served queue would make it wait for.
* Against a real ``flashasr serve`` (tiny.en): a 69 s upload's transcript equals
  ``flashasr.transcribe`` of the same file (VAD pieces), and with ``segmentation=none`` equals
  ``model.transcribe_waveform`` (Whisper's own 30 s seek); a Realtime session update naming a
  language the model cannot take is refused at the update and the session keeps working.
"""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import threading
import time

import httpx
import numpy as np
import pytest
from websockets.asyncio.client import connect

from conftest import AUDIO
from test_serve_util import CLIP, CLIP_WORDS, Server, pcm16, wav_bytes, words

from flashasr.models.base import ASRModel
from flashasr.types import Transcript

LONG = AUDIO / "long" / "long-en-voxpopuli-000.ogg"  # 69 s of European Parliament English
DELAY = 0.2  # seconds per model call of the fake model


class SlowModel(ASRModel):
    """Every call sleeps DELAY s; a piece's text names its length in samples."""

    name, family = "slow-fake", "whisper"

    def __init__(self):
        self.calls: list[tuple[float, list[int], str]] = []  # (end time, piece lengths, thread)

    def _transcribe(self, waves, options):
        time.sleep(DELAY)
        self.calls.append((time.monotonic(), [w.size for w in waves], threading.current_thread().name))
        return [Transcript(text=f"n{w.size}", language="en", duration=w.size / 16000, model=self.name)
                for w in waves]


def _noise(seconds: float, seed: int) -> bytes:
    x = np.random.default_rng(seed).standard_normal(int(seconds * 16000)) * 300
    return wav_bytes(x.astype("<i2").tobytes())


async def _in_process_server(cfg, model):
    """create_app + LocalBackend(model) under uvicorn in this event loop; returns (base url, stop)."""
    import uvicorn

    from flashasr.serve.app import create_app
    from flashasr.serve.backend import LocalBackend

    app = create_app(cfg, lambda cfg, pool, metrics: LocalBackend(cfg, pool, model=model))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, loop="none", lifespan="on", log_level="warning"))
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    async with httpx.AsyncClient() as c:
        t_end = time.monotonic() + 30
        while True:
            try:
                if (await c.get(base + "/ready")).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < t_end and not task.done()
            await asyncio.sleep(0.02)

    async def stop():
        server.should_exit = True
        await task
        sock.close()

    return base, stop


def test_long_upload_is_cut_in_the_cpu_pool_and_takes_turns_with_a_short_one(monkeypatch):
    import flashasr.audio.vad as vad
    from flashasr.serve.config import ServeConfig

    split_threads = []

    def all_speech(samples, *a, **kw):  # the VAD, as planning calls it: here everything is speech
        split_threads.append(threading.current_thread().name)
        return [(0, len(samples))]

    monkeypatch.setattr(vad, "asr_speech_spans", all_speech)
    model = SlowModel()
    cfg = ServeConfig(max_batch=2, batch_wait_ms=0, cpu_threads=2, warmup=False)
    form = {"segmentation": "fixed", "max_segment_s": "1", "response_format": "verbose_json"}
    long_body, short_body = _noise(40, 0), _noise(0.5, 1)  # 40 pieces of 1 s; one piece of 0.5 s

    async def go():
        base, stop = await _in_process_server(cfg, model)
        try:
            async with httpx.AsyncClient(base_url=base, timeout=60) as c:
                post = c.post("/v1/audio/transcriptions", files={"file": ("long.wav", long_body)}, data=form)
                long_task = asyncio.ensure_future(post)
                t_end = time.monotonic() + 20
                while not model.calls:  # the long upload's first batch is done: its pieces are queued
                    assert time.monotonic() < t_end and not long_task.done()
                    await asyncio.sleep(0.01)
                t0 = time.monotonic()
                short = await c.post("/v1/audio/transcriptions", files={"file": ("short.wav", short_body)},
                                     data=form)
                short_s = time.monotonic() - t0
                calls_before_short = len(model.calls)
                metrics = (await c.get("/metrics")).text
                return (await long_task).json(), short.json(), short_s, calls_before_short, metrics
        finally:
            await stop()

    long_r, short_r, short_s, calls_before_short, metrics = asyncio.run(go())
    assert long_r["text"] == " ".join(["n16000"] * 40) and long_r["duration"] == 40.0
    assert short_r["text"] == "n8000"
    # the splitter ran for both uploads, in the CPU pool; the model only ever ran on its own thread
    assert len(split_threads) == 2 and all(t.startswith("flashasr-cpu") for t in split_threads), split_threads
    assert {t.split("_")[0] for _, _, t in model.calls} == {"flashasr-model"}
    # fair turns: the short piece went into the batch after the one in flight (FIFO: after all 20)
    short_call = next(i for i, (_, sizes, _) in enumerate(model.calls) if 8000 in sizes)
    assert short_call <= 3, [sizes for _, sizes, _ in model.calls]
    assert calls_before_short <= 4 < 20  # most of the long upload's pieces were still queued
    assert short_s < 4 * DELAY + 1.0, short_s  # ~2 batch times; FIFO would be >= 20 * DELAY = 4 s
    assert 'flashasr_stage_seconds_count{stage="plan"} 2.0' in metrics



class EchoParakeet(ASRModel):
    """A Parakeet-like fake (no speech gate: a recording that fits its window needs no VAD); a piece's
    text names its length in samples and its first sample (so decodes can be compared)."""

    name, family = "echo-fake", "parakeet"
    speech_gate = False

    def _transcribe(self, waves, options):
        return [Transcript(text=f"n{w.size} {float(w[0]):.6f}", language="en", duration=w.size / 16000,
                           model=self.name) for w in waves]


def test_a_short_wav_at_the_model_rate_decodes_and_plans_without_the_cpu_pool(monkeypatch):
    """A plain PCM WAV at the model's rate of at most SHORT_S (30 s), for a model that needs no VAD on it:
    decoded and planned on the event loop (no CPU-pool job: under load the pool's queue and its two
    hand-offs cost more than the work), the same transcript as through the pool. Other rates, longer
    WAVs and other containers still go to the pool."""
    from flashasr.serve import offline
    from flashasr.serve.config import ServeConfig
    from flashasr.serve.cpu_pool import CPUPool

    jobs = []
    real = CPUPool.submit

    def counted(self, fn, /, *args, **kw):
        jobs.append(getattr(fn, "__name__", str(fn)))
        return real(self, fn, *args, **kw)

    monkeypatch.setattr(CPUPool, "submit", counted)
    cfg = ServeConfig(max_batch=4, batch_wait_ms=0, cpu_threads=2, warmup=False)
    rng = np.random.default_rng(3)
    short16 = wav_bytes((rng.standard_normal(16000 * 7) * 3000).astype("<i2").tobytes())
    short8 = wav_bytes((rng.standard_normal(8000 * 7) * 3000).astype("<i2").tobytes(), rate=8000)
    long16 = wav_bytes((rng.standard_normal(16000 * 45) * 3000).astype("<i2").tobytes())

    async def go():
        base, stop = await _in_process_server(cfg, EchoParakeet())
        out = {}
        try:
            async with httpx.AsyncClient(base_url=base, timeout=60) as c:
                for name, body, form in (("short16", short16, {}), ("short8", short8, {}),
                                         ("long16", long16, {"segmentation": "fixed"})):
                    jobs.clear()
                    r = await c.post("/v1/audio/transcriptions", files={"file": (name + ".wav", body)}, data=form)
                    assert r.status_code == 200, r.text
                    out[name] = (r.json()["text"], list(jobs))
                monkeypatch.setattr(offline, "_decodes_inline", lambda up, rate: False)  # the pooled path
                jobs.clear()
                r = await c.post("/v1/audio/transcriptions", files={"file": ("short16.wav", short16)})
                out["short16 pooled"] = (r.json()["text"], list(jobs))
        finally:
            await stop()
        return out

    out = asyncio.run(go())
    assert out["short16"][1] == [], out["short16"]  # neither decode nor plan in the pool
    assert out["short16"][0] == out["short16 pooled"][0] and out["short16 pooled"][1] == ["_decode"]
    assert out["short16"][0].startswith("n112000 ")
    assert out["short8"][1] == ["_decode"]  # resampled: decoded in the pool, planned inline
    assert out["long16"][1] == ["_decode", "_plan"]  # longer than SHORT_S and the window: both in the pool
    assert out["long16"][0].count("n") == 2  # two fixed pieces (30 s + 15 s)


def test_a_short_upload_is_cut_between_a_long_uploads_vad_slices(monkeypatch):
    """Found on the H200 (multi mode, 2 CPU threads): a 3 s upload sent while 32 uploads of 600 s
    were being cut waited 19 s in the CPU pool's queue. Now a long upload's VAD runs as slices of
    about a minute (bulk jobs) and a short upload's decode and VAD are urgent jobs: with one CPU
    thread and each VAD slice taking 0.3 s, the short upload is cut right after the slice in
    progress, not after the long upload's ten."""
    import flashasr.audio.vad as vad
    from flashasr.serve.config import ServeConfig

    log = []

    def slow(samples, sample_rate=16000, frames=None):  # the VAD, 0.3 s a job, every frame speech
        time.sleep(0.3)
        log.append(("long" if samples.size > 30 * 16000 else "short", time.monotonic()))
        total = -(-samples.size // vad.FRAME)
        lo, hi = frames or (0, total)
        return np.ones(min(hi, total) - lo, np.float32)

    monkeypatch.setattr(vad, "speech_probabilities", slow)
    cfg = ServeConfig(max_batch=8, batch_wait_ms=0, cpu_threads=1, warmup=False)
    long_body, short_body = _noise(600, 0), _noise(3, 1)  # 600 s: 10 slices of 65.5 s

    async def go():
        base, stop = await _in_process_server(cfg, SlowModel())
        try:
            async with httpx.AsyncClient(base_url=base, timeout=60) as c:
                long_task = asyncio.ensure_future(c.post("/v1/audio/transcriptions",
                                                         files={"file": ("long.wav", long_body)}))
                t_end = time.monotonic() + 20
                while not log:  # the long upload's first VAD slice is done: the rest are queued
                    assert time.monotonic() < t_end and not long_task.done()
                    await asyncio.sleep(0.01)
                short = await c.post("/v1/audio/transcriptions", files={"file": ("short.wav", short_body)})
                short_done = time.monotonic()
                return (await long_task), short, short_done
        finally:
            await stop()

    long_r, short_r, short_done = asyncio.run(go())
    assert long_r.status_code == 200 and short_r.status_code == 200, (long_r.text, short_r.text)
    kinds = [k for k, _ in log]
    assert kinds.count("long") == 10 and kinds.count("short") == 1, kinds
    assert kinds.index("short") <= 3, kinds  # after the slice in progress (FIFO: after all ten)
    assert short_done < log[-1][1], "the short upload waited for the long upload's whole VAD"


def test_a_stopping_single_mode_backend_answers_what_waits_for_the_model_503_shutting_down():
    """Single mode as multi mode (``RemoteBackend.begin_shutdown``): once the time that
    ``LocalBackend.begin_shutdown`` gives is up, the pieces still waiting for the model -- queued,
    and the one on the model thread -- fail with 503 ``engine_unavailable`` "the server is shutting
    down" (an answer before uvicorn's grace would cancel the request without one), the model runs
    no more of them, and a request made after fails the same way at once."""
    from flashasr.options import TranscribeOptions
    from flashasr.serve.backend import LocalBackend
    from flashasr.serve.config import ServeConfig
    from flashasr.serve.errors import EngineUnavailable

    model = SlowModel()
    opts = TranscribeOptions(segmentation="fixed")

    async def go():
        b = LocalBackend(ServeConfig(max_batch=1, batch_wait_ms=0, warmup=False), None, model=model)
        await b.start()
        assert await b.wait_ready(10)
        x = np.zeros(20 * 16000, np.float32)
        work = asyncio.ensure_future(b.transcribe_pieces(x, [(i * 16000, (i + 1) * 16000) for i in range(20)], opts))
        while not model.calls:  # 20 model calls of DELAY s each: the first is done, the rest wait
            await asyncio.sleep(0.01)
        b.begin_shutdown(0.05)
        with pytest.raises(EngineUnavailable) as waiting:
            await work
        calls = len(model.calls)
        with pytest.raises(EngineUnavailable) as after:
            await b.transcribe(x[:16000], opts)
        await asyncio.sleep(2 * DELAY)
        await b.stop()
        return waiting.value, after.value, calls, len(model.calls)

    waiting, after, calls, calls_later = asyncio.run(go())
    for err in (waiting, after):
        assert (err.status, err.code, err.message) == (503, "engine_unavailable", "the server is shutting down")
    assert calls <= 3 and calls_later <= calls + 1, (calls, calls_later)  # the call running then, no more


# --------------------------------------------------------------------- real server, tiny.en
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("serve_pipeline"), "--max-audio-s", "120", "--partial-interval-ms", "0")
    yield s
    s.stop()


def _upload(server, data: bytes, name: str, **form) -> dict:
    r = httpx.post(server.base + "/v1/audio/transcriptions", files={"file": (name, data)},
                   data={"response_format": "verbose_json", **form}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _same_transcript(got: dict, want: Transcript) -> None:
    want_d = json.loads(json.dumps(want.to_dict()))
    assert got["text"] == want_d["text"]
    assert got["duration"] == want_d["duration"] and got["language"] == want_d["language"]
    assert [s["text"] for s in got["segments"]] == [s["text"] for s in want_d["segments"]]
    for g, w in zip(got["segments"], want_d["segments"]):  # batch mates may move a time by a frame
        assert abs(g["start"] - w["start"]) <= 0.02 and abs(g["end"] - w["end"]) <= 0.02


def test_long_whisper_upload_equals_the_python_api_and_none_keeps_the_seek(server):
    import flashasr
    from flashasr.audio import load_audio
    from flashasr.pipeline import cached_model

    data = LONG.read_bytes()
    vad = _upload(server, data, LONG.name)
    seek = _upload(server, data, LONG.name, segmentation="none")
    assert vad["duration"] > 60 and len(words(vad["text"])) > 100
    _same_transcript(vad, flashasr.transcribe(LONG))  # the CLI's path: VAD pieces, merged
    model = cached_model(None, "cpu")
    _same_transcript(seek, model.transcribe_waveform(load_audio(LONG, target_rate=16000).samples))


def test_realtime_update_refuses_a_language_the_model_cannot_take(server):
    pcm = pcm16(CLIP)

    async def go():
        async with connect(f"ws://127.0.0.1:{server.port}/v1/realtime?sample_rate=16000") as ws:
            await ws.recv()
            upd = {"type": "transcription_session.update", "event_id": "u1", "session": {
                "turn_detection": None, "input_audio_transcription": {"language": "de"}}}
            await ws.send(json.dumps(upd))
            err = json.loads(await ws.recv())
            await ws.send(json.dumps({"type": "transcription_session.update", "session": {}}))
            same = json.loads(await ws.recv())
            upd["session"]["input_audio_transcription"]["language"] = "English"
            await ws.send(json.dumps(upd))
            ok = json.loads(await ws.recv())
            for off in range(0, len(pcm), 640):
                await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                          "audio": base64.b64encode(pcm[off:off + 640]).decode()}))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            while True:
                ev = json.loads(await asyncio.wait_for(ws.recv(), 60))
                if ev["type"].endswith("transcription.completed"):
                    break
        async with connect(f"ws://127.0.0.1:{server.port}/v1/stream?language=de") as ws:
            refused = json.loads(await ws.recv())
            await asyncio.wait_for(ws.wait_closed(), 5)
        return err, same, ok, ev, refused, ws.close_code

    err, same, ok, final, refused, close_code = asyncio.run(go())
    assert err["type"] == "error" and err["error"]["code"] == "unsupported_language", err
    assert err["error"]["param"] == "language" and err["error"]["event_id"] == "u1"
    # the refused update changed nothing (neither its language nor its turn_detection) ...
    assert same["session"]["input_audio_transcription"]["language"] is None
    assert same["session"]["turn_detection"]["type"] == "server_vad"
    # ... and the session takes a language the model can do (the options' one rule: names accepted)
    assert ok["type"] == "transcription_session.updated" and ok["session"]["turn_detection"] is None
    assert ok["session"]["input_audio_transcription"]["language"] == "en"
    assert words(final["transcript"]) == CLIP_WORDS
    assert refused["error"]["code"] == "unsupported_language" and close_code == 1008


def test_a_model_failure_is_answered_with_error_json_and_the_server_goes_on():
    """A model that raises something of its own (Whisper's sampling once met inf probabilities) gets
    OpenAI's error JSON (500 internal_error, counted and logged as 500), not Starlette's bare text
    500 that dropped the connection; the next request on the same connection is answered."""
    from flashasr.serve.config import ServeConfig

    class Broken(EchoParakeet):
        def _transcribe(self, waves, options):
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")

    cfg = ServeConfig(max_batch=4, batch_wait_ms=0, cpu_threads=2, warmup=False)
    body = wav_bytes((np.random.default_rng(5).standard_normal(16000 * 2) * 3000).astype("<i2").tobytes())

    async def go():
        base, stop = await _in_process_server(cfg, Broken())
        try:
            async with httpx.AsyncClient(base_url=base, timeout=60) as c:
                r = await c.post("/v1/audio/transcriptions", files={"file": ("a.wav", body)})
                ready = await c.get("/ready")
                metrics = (await c.get("/metrics")).text
                return r, ready, metrics
        finally:
            await stop()

    r, ready, metrics = asyncio.run(go())
    assert r.status_code == 500 and r.headers["content-type"].startswith("application/json"), r.text
    assert r.json()["error"]["code"] == "internal_error"
    assert ready.status_code == 200
    assert 'endpoint="/v1/audio/transcriptions",status="500"' in metrics
