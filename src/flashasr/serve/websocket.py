"""The WebSocket doors: ``/v1/realtime`` (OpenAI Realtime transcription, JSON events) and
``/v1/stream`` (lean binary mode: raw PCM16 frames in, the same JSON events out).

Both share one connection life (:meth:`WebSocketDoor.run`): open (API key, accept; a missing or
wrong key: accepted, an ``error`` event ``invalid_api_key``, closed 1008 "invalid API key"; any
other path: HTTP 404 instead of the handshake), the model's capabilities (the options of every
session are checked against them: a session is never created before they are known; the model
still loading, or no engine after the wait: an ``error`` event ``model_not_ready`` /
``engine_unavailable``, closed 1013 "try again later"), the protocol's opening (bad opening
parameters: an ``error`` event, closed 1008), one receive loop (idle timeout, disconnect, an
``error`` event for a bad client message while the session lives on, the session closed at the
end) and one emitter (``event_id`` per event, a send timeout that drops a client that does not
read). ``flashasr_active_streams`` counts the connection from its accept to its end, however it
ends (refused, cancelled, the client gone). A protocol is a small handler that turns one client
message into calls on its :class:`~.stream.StreamSession`:

==================  ===================================  =====================================
handler             text frames                          binary frames
==================  ===================================  =====================================
:class:`Realtime`   ``input_audio_buffer.append`` /      refused (``invalid_request``)
                    ``.commit`` / ``.clear``,
                    ``session.update`` /
                    ``transcription_session.update``
:class:`Binary`     ``commit`` / ``clear`` / ``close``   PCM16 little-endian mono at the
                                                         declared ``sample_rate``
==================  ===================================  =====================================

Requests become objects in :mod:`.protocol`; the stream itself (resampling, VAD, partials,
finals) is :mod:`.stream`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import itertools
import json
import logging

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse

from ..errors import FlashASRError
from ..options import ModelCapabilities
from .context import ServeContext
from .errors import APIError, error_body
from .protocol import (UNCHANGED, SessionUpdate, default_turn_detection, parse_session_update, parse_stream_query,
                       session_view, stream_options)
from .offline import UploadTranscriber
from .routes import check_auth
from .scheduler import FINAL
from .shutdown import GOING_AWAY
from .stream import LazyVad, StreamSession, check_rate

log = logging.getLogger("flashasr.serve")


async def send_error(emit, err: BaseException, client_event_id=None) -> None:
    """An ``error`` event (OpenAI's error object plus the client's ``event_id``)."""
    _, body = error_body(err)
    e = dict(body["error"])
    if e["type"] == "server_error" and e["code"] == "internal_error":
        log.exception("websocket handler error", exc_info=err)
    e["event_id"] = client_event_id
    await emit({"type": "error", "error": e})


class WebSocketDoor:
    """Opening, the receive loop and closing, shared by both protocols."""

    def __init__(self, ctx: ServeContext):
        self.ctx = ctx
        self._ids = itertools.count(1)

    async def run(self, ws: WebSocket, opening) -> None:
        """One connection's life: :meth:`open`, then ``await opening(emit, caps)`` (the protocol's
        :class:`_Handler` for this connection; :class:`Refusal` when its opening parameters are bad)
        with the model's capabilities, then :meth:`serve`. The live-streams gauge counts it from the
        accept until it ends, however it ends."""
        emit = await self.open(ws)
        if emit is None:
            return
        streams = self.ctx.metrics.streams
        streams.inc()
        try:
            try:
                handler = await opening(emit, await self.capabilities())
            except Refusal as r:
                return await self.refuse(ws, emit, r.err, r.reason, r.code)
            await self.serve(ws, handler)
        finally:
            streams.dec()

    async def capabilities(self):
        """The model's capabilities (multi and Ray mode: waiting for the engine as an upload does);
        :class:`Refusal` (close 1013, try again later) while they are not known."""
        try:
            return await self.ctx.capabilities()
        except FlashASRError as e:
            raise Refusal(e, "model not ready" if e.code == "model_not_ready" else "engine unavailable",
                          code=1013) from None

    async def open(self, ws: WebSocket):
        """Check the key and accept; returns the connection's ``emit`` coroutine, or None (a missing
        or wrong key: :meth:`refuse_key`)."""
        protos = list(ws.scope.get("subprotocols") or [])
        m = self.ctx.metrics
        try:
            check_auth(self.ctx.cfg.api_key, ws.headers, protos, ws.query_params)
        except APIError as e:
            await self.refuse_key(ws, protos, e)
            m.requests.labels("ws", "401").inc()
            return None
        await ws.accept(subprotocol="realtime" if "realtime" in protos else None)
        m.requests.labels("ws", "101").inc()
        return self._emitter(ws)

    async def refuse_key(self, ws: WebSocket, protos: list[str], err: APIError) -> None:
        """A missing or wrong API key: accept, one ``error`` event (code ``invalid_api_key``), close
        1008 with reason "invalid API key": what a client can read (a refused handshake reaches
        clients as a bare 403, whatever the reason)."""
        await ws.accept(subprotocol="realtime" if "realtime" in protos else None)
        try:
            await send_error(self._emitter(ws), err)
            await ws.close(code=1008, reason="invalid API key")
        except (asyncio.TimeoutError, RuntimeError, ConnectionError, WebSocketDisconnect):
            pass  # the client did not wait for the reason

    def _emitter(self, ws: WebSocket):
        lock = asyncio.Lock()
        n = itertools.count(1)
        prefix = f"event_{next(self._ids)}_"
        timeout = self.ctx.cfg.send_timeout_s

        async def emit(ev: dict) -> None:
            data = json.dumps({"event_id": prefix + str(next(n)), **ev}, ensure_ascii=False, separators=(",", ":"))
            async with lock:
                await asyncio.wait_for(ws.send_text(data), timeout)

        return emit

    async def refuse(self, ws: WebSocket, emit, err: BaseException, reason: str, code: int = 1008) -> None:
        """A connection that does not become a session: an ``error`` event, then close ``code``
        (1008: bad opening parameters; 1013: the model is not ready)."""
        try:
            await send_error(emit, err)
            await ws.close(code=code, reason=reason)
        except (asyncio.TimeoutError, RuntimeError, ConnectionError, WebSocketDisconnect):
            pass  # the client did not wait for the reason

    async def serve(self, ws: WebSocket, handler: "_Handler") -> None:
        """The receive loop: each message to the handler until the client leaves, idles past
        ``--ws-idle-timeout-s`` (closed 1000), the handler says stop or the server begins to stop
        (:meth:`wind_down`: the committed finals out, closed 1001)."""
        with self.ctx.stopping.session() as server_stop:
            await self._serve(ws, handler, server_stop)

    async def _serve(self, ws: WebSocket, handler: "_Handler", server_stop: asyncio.Future) -> None:
        wait = _ReceiveWait(server_stop, self.ctx.cfg.ws_idle_timeout_s, busy=lambda: handler.session.finals_pending)
        try:
            await handler.start()
            while True:
                msg = await wait.next(ws)
                if msg is _IDLE:
                    await ws.close(code=1000, reason="idle timeout")
                    break
                if msg is _STOPPING:
                    await self.wind_down(ws, handler)
                    break
                if msg["type"] == "websocket.disconnect":
                    break
                handler.event_id = None
                try:
                    data = msg.get("bytes")
                    done = await (handler.on_bytes(data) if data is not None else handler.on_text(msg.get("text")))
                except FlashASRError as e:  # a bad message: the session lives on
                    await send_error(handler.emit, e, handler.event_id)
                    continue
                except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as e:
                    # a message we failed to understand (a bug of ours, not the client's connection):
                    # an error event, logged once with its traceback, and the session lives on
                    log.exception("%s: could not handle a client message", handler.name)
                    await send_error(handler.emit, APIError(f"could not handle the message: {type(e).__name__}",
                                                            code="invalid_request"), handler.event_id)
                    continue
                if done:
                    break
        except (asyncio.TimeoutError, RuntimeError, ConnectionError) as e:
            log.info("%s stream ended: %s", handler.name, e)
        except Exception as e:  # noqa: BLE001
            if type(e).__name__ not in ("WebSocketDisconnect", "ClientDisconnected"):
                log.exception("%s stream failed", handler.name)
        finally:
            wait.close()
            await handler.session.close()

    async def wind_down(self, ws: WebSocket, handler: "_Handler") -> None:
        """The server is stopping (:mod:`.shutdown`): the finals the session committed go out, up
        to the last cut (one still not out then gets ``...failed`` naming the shutdown), then close
        :data:`~.shutdown.GOING_AWAY` (1001) "server shutting down"."""
        stopping = self.ctx.stopping
        try:  # bounded even for a client that does not read its events
            await asyncio.wait_for(handler.session.finish(stopping.left()), stopping.left() + 0.2)
        finally:
            await asyncio.wait_for(ws.close(code=GOING_AWAY, reason="server shutting down"), 0.5)


_IDLE, _STOPPING = object(), object()  # _ReceiveWait.next: no message came, and why


class _ReceiveWait:
    """A session's wait for its client's next message, ended early by the server's stop (``stop``
    done) or by ``idle_s`` without a message and without a final still owed (``busy()``: while it is,
    the idle time starts again): both cancel the session's task while, and only while,
    it waits for the client. The wait itself is a bare ``receive``: no task, future or
    timeout object per message (a stream sends 50 a second); the idle watchdog is one timer per
    session that re-arms itself (every ``idle_s`` while messages keep coming). A message the client sent in
    the very loop turn of the stop may go unread (the session closes 1001 as for one sent after it).
    :meth:`close` ends the watchdog."""

    def __init__(self, stop: asyncio.Future, idle_s: float, busy=lambda: False):
        self.stop = stop
        self.busy = busy  # the session still owes its client something (a final): not idle
        self.task = asyncio.current_task()
        self.loop = asyncio.get_running_loop()
        self.idle_s = float(idle_s)
        self.since = self.loop.time()  # when the current wait for the client began
        self.waiting = False
        self.idle = False
        stop.add_done_callback(self._interrupt)
        self._timer = self.loop.call_later(self.idle_s, self._watch)

    def close(self) -> None:
        self._timer.cancel()

    def _stopped(self) -> bool:
        return self.stop.done() and not self.stop.cancelled()  # cancelled: the session ended first

    def _interrupt(self, _fut) -> None:
        if self.waiting and self._stopped():
            self.task.cancel()

    def _watch(self) -> None:
        """The idle watchdog: idle once one wait for the client has lasted ``idle_s`` (a session busy
        with a message is not idle); otherwise look again when that could first be."""
        left = self.since + self.idle_s - self.loop.time()
        if self.waiting and left <= 0 and not self._stopped():
            if self.busy():  # its client waits for a final: the idle time starts again from now
                self.since, left = self.loop.time(), self.idle_s
            else:
                self.idle = True
                self.task.cancel()
                return
        self._timer = self.loop.call_later(left if self.waiting and left > 0 else self.idle_s, self._watch)

    async def next(self, ws: WebSocket):
        """The next ASGI message, :data:`_IDLE` after ``idle_s`` without one, or :data:`_STOPPING`."""
        if self._stopped():
            return _STOPPING
        self.waiting, self.since = True, self.loop.time()
        try:
            return await ws.receive()
        except asyncio.CancelledError:
            if not (self._stopped() or self.idle):
                raise  # cancelled from outside (uvicorn, a disconnect): not ours to keep
            uncancel = getattr(self.task, "uncancel", None)  # Python 3.11+: the cancel is consumed
            if uncancel is not None:
                uncancel()
            return _STOPPING if self._stopped() else _IDLE
        finally:
            self.waiting = False


class Refusal(Exception):
    """A connection's opening that cannot become a session: ``err`` as an ``error`` event, then
    close ``code`` with ``reason`` (:meth:`WebSocketDoor.refuse`)."""

    def __init__(self, err: BaseException, reason: str, code: int = 1008):
        super().__init__(reason)
        self.err, self.reason, self.code = err, reason, code


class _Handler:
    """One protocol on one connection. ``on_text`` / ``on_bytes`` return True to end the loop;
    a FlashASRError they raise becomes an ``error`` event naming ``event_id``. ``caps``: the
    model's capabilities the session's options were checked against."""

    name = "websocket"

    def __init__(self, ctx: ServeContext, ws: WebSocket, emit, session: StreamSession, turn_detection,
                 caps: ModelCapabilities):
        self.ctx, self.ws, self.emit, self.session = ctx, ws, emit, session
        self.turn_detection = turn_detection
        self.caps = caps
        self.event_id = None

    def view(self) -> dict:
        return session_view(self.session, self.turn_detection, self.caps)


class Realtime(_Handler):
    """``/v1/realtime``: OpenAI Realtime transcription events (JSON text frames, base64 PCM16)."""

    name = "realtime"

    async def start(self) -> None:
        await self.emit({"type": "transcription_session.created", "session": self.view()})

    async def on_bytes(self, data: bytes):
        raise APIError("binary frames are not part of the Realtime protocol; send JSON events "
                       "(or use /v1/stream for raw PCM)", code="invalid_request")

    async def on_text(self, text):
        ev = parse_event(text, "event")
        self.event_id = ev.get("event_id")
        typ, s = ev["type"], self.session
        if typ == "input_audio_buffer.append":
            await s.append_pcm16(_b64_audio(ev.get("audio")))
        elif typ == "input_audio_buffer.commit":
            await s.commit()
        elif typ == "input_audio_buffer.clear":
            await s.clear()
        elif typ in ("transcription_session.update", "session.update"):
            await s.vad_settled()  # audio received before the update is handled under the old settings
            # checked against the model as it is now (an engine restarting: waited for, as an upload
            # waits; still away: an error event, the session keeps its settings)
            self.caps = await self.ctx.capabilities()
            await self.apply(parse_session_update(ev.get("session") or {}, s.options, self.caps, self.ctx.cfg))
            await self.emit({"type": "session.updated" if typ == "session.update" else
                             "transcription_session.updated", "session": self.view()})
        else:
            raise APIError(f"unknown event type {typ!r}", param="type", code="unknown_event")

    async def apply(self, upd: SessionUpdate) -> None:
        """Apply a parsed (wholly valid) session update to the live session."""
        s = self.session
        if upd.options is not UNCHANGED:
            s.options = upd.options
        if upd.rate is not UNCHANGED:
            await s.set_rate(upd.rate)
        if upd.partial_interval is not UNCHANGED:
            s.partial_interval = upd.partial_interval
        if upd.turn_detection is not UNCHANGED:
            td = self.turn_detection = upd.turn_detection
            await s.set_vad(None if td is None else LazyVad(td), None if td is None else td["prefix_padding_ms"])


class Binary(_Handler):
    """``/v1/stream``: binary PCM16 frames; JSON control messages ``commit``, ``clear``, ``close``."""

    name = "binary"

    async def start(self) -> None:
        await self.emit({"type": "session.created", "session": self.view()})

    async def on_bytes(self, data: bytes):
        await self.session.append_pcm16(data)

    async def on_text(self, text):
        typ = parse_event(text, "control message", CONTROL_TYPES)["type"]
        if typ in ("commit", "input_audio_buffer.commit"):
            await self.session.commit()
        elif typ in ("clear", "input_audio_buffer.clear"):
            await self.session.clear()
        elif typ == "close":
            await self.session.drain(self.ctx.cfg.request_timeout_s)
            await self.ws.close(code=1000)
            return True
        else:
            raise APIError(f"unknown control message type {typ[:100]!r}; use {CONTROL_TYPES}", param="type",
                           code="unknown_event")


CONTROL_TYPES = "commit, clear or close"  # the /v1/stream control messages (named in its errors)


def parse_event(text, what: str, types: str | None = None) -> dict:
    """A client's JSON text message -> its object, whose ``type`` is a string (``what``: "event" or
    "control message", ``types``: the types to name, both for the errors).

    Raises:
        APIError: ``invalid_json`` (not JSON, or nested past the parser's depth); ``invalid_request``
        with param ``type`` (valid JSON
        that is not an object, an object without ``type``, a ``type`` that is not a string).
    """
    try:
        ev = json.loads(text or "")
    except ValueError as e:
        raise APIError(f"malformed JSON {what}: {e}", code="invalid_json") from None
    except RecursionError:  # found by a new user: 100,000 nested brackets ended the session
        raise APIError(f"malformed JSON {what}: nested too deeply", code="invalid_json") from None
    if not isinstance(ev, dict) or not isinstance(ev.get("type"), str):
        say = f" ({types})" if types else ""
        raise APIError(f"every {what} must be a JSON object with a string 'type'{say}; got {_described(ev)[:100]}",
                       param="type")
    return ev


def _described(ev) -> str:
    """What a parsed message that is no event is, for its error: ``a JSON array`` (string, number,
    boolean, null), ``an object without 'type'``, ``'type' 5``."""
    if isinstance(ev, dict):
        return f"'type' {json.dumps(ev['type'])[:50]}" if "type" in ev else "an object without 'type'"
    kind = "null" if ev is None else "boolean" if isinstance(ev, bool) else \
        {list: "array", str: "string"}.get(type(ev), "number")
    return f"a JSON {kind}"


def _b64_audio(audio) -> bytes:
    if not isinstance(audio, str):
        raise APIError("'audio' must be a base64 string", param="audio")
    try:
        return base64.b64decode(audio, validate=True)
    except (binascii.Error, ValueError):
        raise APIError("'audio' is not valid base64", param="audio") from None


def websocket_router(ctx: ServeContext) -> APIRouter:
    """``/v1/realtime``, ``/v1/stream`` and a 404 for a WebSocket at any other path."""
    router = APIRouter()
    door = WebSocketDoor(ctx)
    cfg = ctx.cfg

    finals = UploadTranscriber(ctx)

    async def finalize(audio, options):  # a final: the upload pipeline, ahead of every upload
        caps = await ctx.capabilities()
        return await finals.transcribe(audio, options.resolve(caps), caps, priority=FINAL, pool=ctx.stream_pool)

    def session(emit, rate, options, turn_detection, partial_interval_ms, full_partials=False) -> StreamSession:
        return StreamSession(ctx.backend, emit, input_rate=rate, vad=LazyVad(turn_detection) if turn_detection else None,
                             options=options, partial_interval_ms=partial_interval_ms,
                             max_utterance_s=cfg.max_utterance_s, prefix_padding_ms=cfg.vad_prefix_padding_ms,
                             metrics=ctx.metrics, full_partials=full_partials, finalize=finalize,
                             chunked=ctx.backend.info.get("stream_partials") == "chunked")

    @router.websocket("/v1/realtime")
    async def realtime(ws: WebSocket):
        """Realtime transcription; ``?sample_rate=`` sets the input rate (default 24000, as OpenAI's pcm16)."""
        async def opening(emit, caps):
            try:
                rate = check_rate(ws.query_params["sample_rate"]) if "sample_rate" in ws.query_params else 24000
            except APIError as e:
                raise Refusal(e, "invalid sample_rate") from None
            td = default_turn_detection(cfg)
            s = session(emit, rate, stream_options(None, caps), td, cfg.partial_interval_ms)
            return Realtime(ctx, ws, emit, s, td, caps)

        await door.run(ws, opening)

    @router.websocket("/v1/stream")
    async def binary_stream(ws: WebSocket):
        """``?sample_rate=16000&language=en&vad=false&partial_interval_ms=500&partials=delta``."""
        async def opening(emit, caps):
            try:
                q = parse_stream_query(ws.query_params, caps, cfg)
            except FlashASRError as e:
                raise Refusal(e, "invalid query parameters") from None
            s = session(emit, q.rate, q.options, q.turn_detection, q.partial_interval_ms, q.full_partials)
            return Binary(ctx, ws, emit, s, q.turn_detection, caps)

        await door.run(ws, opening)

    router.add_websocket_route("/{path:path}", NoSuchRoute(ctx.metrics))  # last: any other path
    return router


class NoSuchRoute:
    """A raw ASGI app for a WebSocket at any other path: HTTP 404 with OpenAI's error JSON instead
    of the handshake (the ASGI denial-response extension, which uvicorn has), so a wrong path is not
    mistaken for a refused key; a server without the extension answers a bare 403."""

    def __init__(self, metrics):
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        await receive()  # websocket.connect
        self.metrics.requests.labels("ws", "404").inc()
        if "websocket.http.response" not in scope.get("extensions", {}):
            return await send({"type": "websocket.close", "code": 1008})
        err = APIError(f"no WebSocket route at {str(scope.get('path'))[:200]} (use /v1/realtime or /v1/stream)",
                       status=404, code="not_found")
        status, body = error_body(err)
        await JSONResponse(body, status_code=status)(scope, receive, send)
        await _connection_lost(receive)


async def _connection_lost(receive, timeout: float = 2.0) -> None:
    """Return once the connection of a denied handshake is gone (its second ``websocket.disconnect``:
    one when the denial is sent, one when the socket closes), at most ``timeout`` s. uvicorn 0.54's
    websockets-sansio protocol counts a denied handshake as complete only then; an app that returns
    earlier gets "ASGI callable returned without completing handshake" logged at ERROR (uvicorn
    pull request #3138)."""
    try:
        for _ in range(2):
            await asyncio.wait_for(receive(), timeout)
    except asyncio.TimeoutError:
        pass


__all__ = ["websocket_router", "WebSocketDoor", "NoSuchRoute", "Realtime", "Binary", "Refusal", "send_error",
           "parse_event"]
