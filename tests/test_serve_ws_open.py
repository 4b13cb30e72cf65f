"""WebSocket sessions opened at the edges of the engine's life (in process, uvicorn, CPU).

* Single mode, the NeMo-made Parakeet fixture, its load held back by the test: a session opened
  while the model loads is refused (``error`` ``model_not_ready``, close 1013), never created with
  unchecked options and re-encoded partials; once the model is ready a session gets chunked
  partials.
* A fake multi-mode engine the test connects and disconnects: a session opened while it is away
  is refused after the wait (``engine_unavailable``, 1013); one whose engine comes during the wait
  is created, with chunked partials; a session update while the engine restarts is refused (the
  session keeps its settings) and checked against the model once it is back.
* ``flashasr_active_streams`` returns to its value before the connection however the opening
  ends: refused, the client gone before the refusal could be sent, the handler cancelled while
  it waits for the engine.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import numpy as np
import pytest
from websockets.asyncio.client import connect

from conftest import PARAKEET_FIXTURES
from flashasr.options import ModelCapabilities
from flashasr.serve.backend import LocalBackend
from flashasr.serve.config import ServeConfig
from flashasr.types import StreamResult

TINY = PARAKEET_FIXTURES / "tiny-tdt"
CAPS = ModelCapabilities(name="fake-en", family="parakeet", sample_rate=16000, window_s=60.0,
                         languages=frozenset({"en"}))
DELTA = "conversation.item.input_audio_transcription.delta"
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py


def _cfg() -> ServeConfig:
    return ServeConfig(max_batch=4, batch_wait_ms=0, cpu_threads=1, warmup=False, gc_freeze=False,
                       partial_interval_ms=500)


async def _serve(backend_factory):
    """create_app(backend) under uvicorn in this event loop, once it answers /health;
    returns (ws base url, app, stop)."""
    import uvicorn

    from flashasr.serve.app import create_app

    app = create_app(_cfg(), backend_factory)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, loop="none", lifespan="on", log_level="warning"))
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    base = f"127.0.0.1:{sock.getsockname()[1]}"
    await _until(lambda: _is(_get(base, "/health"), 200))

    async def stop():
        server.should_exit = True
        await task
        sock.close()

    return "ws://" + base, app, stop


async def _get(base: str, path: str) -> int:
    try:
        async with httpx.AsyncClient() as c:
            return (await c.get(f"http://{base}{path}", timeout=2)).status_code
    except httpx.HTTPError:
        return 0


async def _until(cond, timeout: float = 30.0) -> None:
    """Wait for ``cond()`` (a value or an awaitable) to be true."""
    t_end = time.monotonic() + timeout
    while True:
        v = cond()
        if asyncio.iscoroutine(v):
            v = await v
        if v:
            return
        assert time.monotonic() < t_end, "timed out"
        await asyncio.sleep(0.02)


async def _is(status, want: int) -> bool:
    return await status == want


def _streams(app) -> float:
    return app.state.metrics.registry.get_sample_value("flashasr_active_streams")


async def _refused(url: str) -> tuple[dict, int]:
    """The first event of a connection and the close code that follows it (None: still open 5 s later)."""
    async with connect(url) as ws:
        ev = json.loads(await asyncio.wait_for(ws.recv(), 10))
        try:
            await asyncio.wait_for(ws.wait_closed(), 5)
        except asyncio.TimeoutError:
            return ev, None
    return ev, ws.close_code


def _speech(seconds: float) -> bytes:
    ref = np.load(TINY / "reference.npz")
    x = ref["audio"][3, : int(seconds * 16000)]
    return (np.clip(x, -1, 1) * 32767).astype("<i2").tobytes()


# ----------------------------------------------------------------------------- single mode, loading
class _GatedLoad(LocalBackend):
    """LocalBackend whose model load waits for ``gate`` (the tiny Parakeet fixture then)."""

    def __init__(self, cfg, pool, gate: asyncio.Event):
        super().__init__(cfg, pool)
        self.gate = gate

    async def _load(self) -> None:
        from flashasr.models.parakeet.model import load_parakeet

        await self.gate.wait()
        self.model = load_parakeet(TINY / "model.nemo")
        await super()._load()


def test_single_mode_session_opened_while_loading_is_refused_then_chunked():
    async def go():
        gate = asyncio.Event()
        base, app, stop = await _serve(lambda cfg, pool, metrics: _GatedLoad(cfg, pool, gate))
        try:
            before = _streams(app)
            loading = [await _refused(base + "/v1/realtime?sample_rate=16000"),
                       await _refused(base + "/v1/stream?language=de")]
            await _until(lambda: _streams(app) == before)
            gate.set()
            await _until(lambda: _is(_get(base[5:], "/ready"), 200))
            backend = app.state.flashasr["backend"]
            rows = backend.scheduler.streamer.counters["rows"]
            async with connect(base + "/v1/stream?sample_rate=16000&partial_interval_ms=500") as ws:
                created = json.loads(await ws.recv())
                pcm = _speech(3.0)
                for i in range(0, len(pcm), 3200):  # 100 ms packets, 4x real time
                    await ws.send(pcm[i:i + 3200])
                    await asyncio.sleep(0.025)
                await ws.send(json.dumps({"type": "commit"}))
                evs = []
                while not evs or evs[-1]["type"] != "conversation.item.input_audio_transcription.completed":
                    evs.append(json.loads(await asyncio.wait_for(ws.recv(), 60)))
            return loading, created, evs, backend.scheduler.streamer.counters["rows"] - rows
        finally:
            await stop()

    loading, created, evs, chunk_rows = asyncio.run(go())
    for ev, code in loading:  # not created with options nobody checked
        assert ev["type"] == "error" and ev["error"]["code"] == "model_not_ready", ev
        assert "loading" in ev["error"]["message"] and code == 1013
    assert created["type"] == "session.created"
    assert chunk_rows > 0  # the partials went through the model's chunked streamer
    assert any(e["type"] == DELTA for e in evs)


# ----------------------------------------------------------------------------- multi mode, a fake engine
class _Client:
    def __init__(self, engine):
        self.engine = engine

    def unavailable_reason(self) -> str:
        return ("the transcription engine is restarting; retry shortly" if self.engine.connects
                else "the transcription engine is starting (loading the model); retry shortly")


class _Engine:
    """A multi-mode backend whose engine connection the test makes and breaks: capabilities and
    info come with the connection (the engine's HELLO), as in RemoteBackend."""

    mode = "multi"
    error = None

    def __init__(self, cfg, pool, metrics):
        self.caps, self.info, self.connects = None, {}, 0
        self.client = _Client(self)
        self.calls: list[str] = []
        self.waiting: list[asyncio.Task] = []
        self._up = None

    @property
    def capabilities(self):
        return self.caps

    @property
    def ready(self) -> bool:
        return self.caps is not None

    def connect(self) -> None:
        self.caps, self.info = CAPS, {"model": CAPS.name, "stream_partials": "chunked"}
        self.connects += 1
        self.up.set()

    def disconnect(self) -> None:
        self.caps, self.info = None, {}
        self.up.clear()

    @property
    def up(self) -> asyncio.Event:
        if self._up is None:
            self._up = asyncio.Event()
        return self._up

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def wait_ready(self, timeout: float) -> bool:
        self.waiting.append(asyncio.current_task())
        try:
            await asyncio.wait_for(self.up.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        return self.ready

    async def transcribe(self, samples, options, **kw):
        self.calls.append("transcribe")
        return None

    async def stream_chunk(self, key, samples, options, *, new=False, timeout=None):
        self.calls.append("chunk")
        return StreamResult(text="hello world", stable_text="hello", frames=1, audio_s=0.08, new_tokens=2, tokens=2)

    def stream_close(self, key) -> None:
        pass

    async def metrics_text(self) -> bytes:
        return b""


def _engine_server(monkeypatch, wait_s: float):
    monkeypatch.setattr("flashasr.serve.context.ENGINE_WAIT_S", wait_s)
    holder = {}

    def factory(cfg, pool, metrics):
        holder["engine"] = _Engine(cfg, pool, metrics)
        return holder["engine"]

    return factory, holder


def test_multi_mode_sessions_wait_for_the_engine_and_updates_are_checked_against_it(monkeypatch):
    factory, holder = _engine_server(monkeypatch, 0.3)

    async def go():
        base, app, stop = await _serve(factory)
        eng = holder["engine"]
        try:
            away = [await _refused(base + "/v1/realtime"), await _refused(base + "/v1/stream?language=de")]
            # the engine connects while the session waits for it: created, with chunked partials
            asyncio.get_running_loop().call_later(0.1, eng.connect)
            async with connect(base + "/v1/stream?sample_rate=16000&partial_interval_ms=100") as ws:
                created = json.loads(await ws.recv())
                await ws.send(b"\0\0" * 3200)
                await _until(lambda: eng.calls, 10)
            async with connect(base + "/v1/realtime?sample_rate=16000") as ws:
                await ws.recv()
                upd = {"type": "transcription_session.update", "session": {
                    "input_audio_transcription": {"language": "de"}}}
                eng.disconnect()  # the engine restarts
                await ws.send(json.dumps(upd))
                restarting = json.loads(await ws.recv())
                eng.connect()
                await ws.send(json.dumps(upd))
                unsupported = json.loads(await ws.recv())
                await ws.send(json.dumps({"type": "transcription_session.update", "session": {}}))
                same = json.loads(await ws.recv())
            return away, created, list(eng.calls), restarting, unsupported, same
        finally:
            await stop()

    away, created, calls, restarting, unsupported, same = asyncio.run(go())
    for ev, code in away:
        assert ev["type"] == "error" and ev["error"]["code"] == "engine_unavailable", ev
        assert "starting" in ev["error"]["message"] and code == 1013
    assert created["type"] == "session.created" and set(calls) == {"chunk"}
    assert restarting["type"] == "error" and restarting["error"]["code"] == "engine_unavailable", restarting
    assert unsupported["type"] == "error" and unsupported["error"]["code"] == "unsupported_language", unsupported
    assert same["type"] == "transcription_session.updated"
    assert same["session"]["input_audio_transcription"]["language"] is None  # neither update applied


def test_streams_gauge_returns_however_the_opening_ends(monkeypatch):
    factory, holder = _engine_server(monkeypatch, 30.0)

    async def go():
        base, app, stop = await _serve(factory)
        eng = holder["engine"]
        try:
            before = _streams(app)
            # cancelled while it waits for the engine
            async with connect(base + "/v1/realtime") as ws:
                await _until(lambda: len(eng.waiting) == 1, 10)
                assert _streams(app) == before + 1
                eng.waiting[0].cancel()
                await asyncio.wait_for(ws.wait_closed(), 10)
            cancelled = _streams(app)
            # the client leaves while its opening waits; the refusal then finds nobody to read it
            async with connect(base + "/v1/stream?sample_rate=abc"):
                await _until(lambda: len(eng.waiting) == 2, 10)
            await asyncio.sleep(0.2)
            eng.connect()
            await asyncio.sleep(0.5)
            gone = _streams(app)
            refused = await _refused(base + "/v1/stream?sample_rate=abc")
            return before, cancelled, gone, refused, _streams(app)
        finally:
            await stop()

    before, cancelled, gone, (ev, code), after = asyncio.run(go())
    assert cancelled == before, "a handler cancelled while waiting for the engine kept its stream counted"
    assert gone == before, "a refusal sent to a client already gone kept its stream counted"
    assert ev["error"]["code"] == "invalid_sample_rate" and code == 1008 and after == before


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_receive_wait_idles_stops_and_passes_outside_cancels(loop_kind):
    """The session's wait for its client (``_ReceiveWait``, one bare receive per message and one
    watchdog timer per session): steady messages never idle it, and neither does a session busy
    with a message for longer than the idle time, nor one that still owes its client a final (it
    used to be closed 1000 with the final lost); a wait that lasts the idle time ends _IDLE; the
    server's stop ends a wait at once (_STOPPING); a cancel from anyone else propagates."""
    from flashasr.serve.websocket import _IDLE, _STOPPING, _ReceiveWait

    class FakeWS:
        def __init__(self):
            self.q = asyncio.Queue()

        async def receive(self):
            return await self.q.get()

    async def session(ws, stop, idle_s, log, busy=lambda: False):
        wait = _ReceiveWait(stop, idle_s, busy)
        try:
            while True:
                msg = await wait.next(ws)
                log.append((msg["n"] if isinstance(msg, dict) else msg, time.monotonic()))
                if msg in (_IDLE, _STOPPING):
                    return msg
                await asyncio.sleep(msg.get("busy", 0))  # handling the message
        finally:
            wait.close()

    async def go():
        loop = asyncio.get_running_loop()
        ws, log = FakeWS(), []
        stop = loop.create_future()
        t = asyncio.ensure_future(session(ws, stop, 0.3, log))
        for i in range(12):  # 0.6 s of messages every 50 ms: never idle
            ws.q.put_nowait({"n": i})
            await asyncio.sleep(0.05)
        ws.q.put_nowait({"n": 99, "busy": 0.5})  # busy 0.5 s > idle, the next message already waiting
        ws.q.put_nowait({"n": 100})
        await asyncio.sleep(0.6)
        assert not t.done()
        t0 = time.monotonic()
        idle = await asyncio.wait_for(t, 3)
        idle_after = time.monotonic() - t0

        stop2 = loop.create_future()
        t2 = asyncio.ensure_future(session(FakeWS(), stop2, 30, []))
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        stop2.set_result(None)
        stopped = await asyncio.wait_for(t2, 1)
        stop_after = time.monotonic() - t0

        t3 = asyncio.ensure_future(session(FakeWS(), loop.create_future(), 30, []))
        await asyncio.sleep(0.05)
        t3.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t3

        owed_until = time.monotonic() + 0.8  # a final owed for 0.8 s: no message, yet not idle
        t4 = asyncio.ensure_future(session(FakeWS(), loop.create_future(), 0.2, [],
                                           busy=lambda: time.monotonic() < owed_until))
        owed_idle = await asyncio.wait_for(t4, 3)
        owed_after = time.monotonic() - (owed_until - 0.8)
        return idle, idle_after, stopped, stop_after, [n for n, _ in log], owed_idle, owed_after

    run = pytest.importorskip("uvloop").run if loop_kind == "uvloop" else asyncio.run
    idle, idle_after, stopped, stop_after, seen, owed_idle, owed_after = run(go())
    assert owed_idle is _IDLE and 0.8 < owed_after < 1.6, owed_after  # idle only after the final went out
    assert seen[:-1] == list(range(12)) + [99, 100] and seen[-1] is _IDLE
    assert idle is _IDLE and 0.1 < idle_after < 1.5, idle_after  # about 0.3 s after the last message
    assert stopped is _STOPPING and stop_after < 0.2
