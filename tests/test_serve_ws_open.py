"""WebSocket sessions opened at the edges of the engine's life (in process, uvicorn, CPU).

* A fake multi-mode engine the test connects and disconnects:
  ``flashasr_active_streams`` returns to its value before the connection however the opening
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
