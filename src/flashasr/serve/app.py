"""OpenAI-compatible HTTP + WebSocket front end, and ``flashasr serve`` (:func:`main`).

Endpoints:
  * ``POST /v1/audio/transcriptions``: multipart upload (OpenAI ``audio.transcriptions.create``),
    response_format json | text | srt | vtt | verbose_json, ``timestamp_granularities[]``,
    ``stream=true`` -> Server-Sent Events ``transcript.text.delta`` / ``transcript.text.done``.
  * ``POST /v1/audio/translations``: the same upload, English text out (OpenAI
    ``audio.translations.create``; multilingual Whisper models, else 400 ``unsupported_task``).
  * ``GET /v1/models``; ``GET /health`` (alive); ``GET /ready`` (model loaded and warmed);
    ``GET /metrics`` (Prometheus text).
  * ``WS /v1/realtime``: OpenAI Realtime transcription protocol (JSON events, base64 PCM16).
  * ``WS /v1/stream?sample_rate=16000``: lean binary mode (raw PCM16 frames in, JSON events out).

Process layout (see docs/SERVING.md): ``--mode single`` runs everything in one process;
``--mode multi`` runs one engine process (model + batching scheduler) and ``--workers``
front-end processes talking to it over persistent Unix sockets (:mod:`.ipc`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import gc
import hmac
import itertools
import json
import logging
import os
import re
import socket
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import FlashASRError
from ..formats import FORMATS, render
from .config import ServeConfig, parse_args
from .errors import APIError, error_body
from .metrics import FrontendMetrics
from .scheduler import OFFLINE
from .stream import StreamSession, VadAdapter, check_rate
from .upload import read_multipart

log = logging.getLogger("flashasr.serve")

_LANG = re.compile(r"^[a-z]{2,3}(-[A-Za-z]{2,4})?$")
_TRUE = ("true", "1", "yes", "on")
_DRAIN_BYTES = 64 << 20   # after a 413 we keep reading (and discarding) this much so the client sees the reply
_DRAIN_SECONDS = 5.0


def _prestarted_pool(n: int, name: str) -> ThreadPoolExecutor:
    """A fixed pool whose threads exist from the start (the thread count never moves later)."""
    pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix=name)
    barrier = threading.Barrier(n)
    for f in [pool.submit(barrier.wait, 10) for _ in range(n)]:
        f.result()
    return pool


class _CountRequests:
    """ASGI middleware: ``flashasr_requests_total{endpoint, status}`` for HTTP requests."""

    def __init__(self, app, metrics: FrontendMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = {"code": 0}

        async def _send(msg):
            if msg["type"] == "http.response.start":
                status["code"] = msg["status"]
            await send(msg)

        try:
            await self.app(scope, receive, _send)
        finally:
            path = scope.get("path", "")
            ep = path if path in ("/v1/audio/transcriptions", "/v1/audio/translations", "/v1/models", "/health",
                                  "/ready", "/metrics") \
                else "other"
            self.metrics.requests.labels(ep, str(status["code"] or 499)).inc()


def _err_response(err: BaseException) -> JSONResponse:
    status, body = error_body(err)
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(body, status_code=status, headers=headers)


def create_app(cfg: ServeConfig, backend_factory=None) -> FastAPI:
    """Build the ASGI app.

    Args:
        cfg: server configuration.
        backend_factory: ``f(cfg, pool, metrics) -> backend`` (LocalBackend or RemoteBackend);
            default: :class:`~.backend.LocalBackend` (single-process mode).
    """
    metrics = FrontendMetrics()
    state: dict = {}

    @asynccontextmanager
    async def lifespan(app):
        pool = _prestarted_pool(max(1, cfg.cpu_threads), "flashasr-cpu")
        if backend_factory is None:
            from .backend import LocalBackend

            backend = LocalBackend(cfg, pool)
        else:
            backend = backend_factory(cfg, pool, metrics)
        state.update(pool=pool, backend=backend)
        await backend.start()
        if getattr(backend, "mode", "") == "multi" and cfg.gc_freeze:
            gc.collect()
            gc.freeze()  # the front end's start-up objects leave the GC's scans
        try:
            yield
        finally:
            await backend.stop()
            pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="flashasr", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.flashasr = state
    app.state.metrics = metrics
    app.state.cfg = cfg

    @app.exception_handler(FlashASRError)
    async def _flash_err(request, exc):
        return _err_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_err(request, exc):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
        return _err_response(APIError(str(exc.detail), status=exc.status_code, code=code))

    def check_auth(headers, subprotocols=(), query=None) -> None:
        if not cfg.api_key:
            return
        got = None
        h = headers.get("authorization", "")
        if h[:7].lower() == "bearer ":
            got = h[7:].strip()
        for sp in subprotocols:
            if sp.startswith("openai-insecure-api-key."):
                got = sp.split(".", 1)[1]
        if got is None and query is not None:
            got = query.get("api_key")
        if got is None or not hmac.compare_digest(got.encode(), cfg.api_key.encode()):
            raise APIError("missing or invalid API key (send 'Authorization: Bearer KEY')", status=401,
                           code="invalid_api_key", type="invalid_request_error")

    def backend():
        return state["backend"]

    # ------------------------------------------------------------ plain endpoints
    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        b = backend()
        if b.ready:
            return {"status": "ready", "mode": b.mode, "frontend_pid": os.getpid(), **b.info}
        body = {"status": "loading", "mode": b.mode}
        if getattr(b, "error", None):
            body["error"] = b.error
        sup = getattr(b, "supervisor", None)
        if sup is not None:
            body["engine_restarts"] = sup.restarts
        return JSONResponse(body, status_code=503)

    @app.get("/metrics")
    async def metrics_ep():
        text = metrics.text() + await backend().metrics_text()
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request):
        check_auth(request.headers)
        name = backend().info.get("model") or (cfg.model or "whisper-tiny.en")
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "flashasr"}]}

    # ------------------------------------------------------------ transcriptions
    async def _drain(request: Request) -> None:
        """Read and discard the rest of a rejected body (bounded), so the client gets our reply."""
        n, t_end = 0, time.monotonic() + _DRAIN_SECONDS
        while n < _DRAIN_BYTES:
            left = t_end - time.monotonic()
            if left <= 0:
                return
            try:
                msg = await asyncio.wait_for(request.receive(), left)
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001
                return
            if msg["type"] != "http.request":
                return
            n += len(msg.get("body", b""))
            if not msg.get("more_body", False):
                return

    async def _until_disconnect(request: Request) -> None:
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                return

    @app.post("/v1/audio/transcriptions")
    async def transcriptions(request: Request):
        return await _audio_request(request, "transcribe")

    @app.post("/v1/audio/translations")
    async def translations(request: Request):
        """OpenAI ``audio.translations.create``: English text from speech in any language the
        model knows (Whisper's translate task; multilingual Whisper models only, else 400
        ``unsupported_task``). Same form fields and response formats as transcriptions;
        ``language``, if given, names the SOURCE language."""
        return await _audio_request(request, "translate")

    async def _audio_request(request: Request, task: str):
        check_auth(request.headers)
        if task == "translate" and backend().info.get("translates") is False:
            from ..errors import UnsupportedTaskError

            await _drain(request)
            raise UnsupportedTaskError(f"model {backend().info.get('model')} cannot translate (translation to "
                                       f"English needs a multilingual Whisper model, e.g. --model base)")
        t0 = time.perf_counter()
        try:
            up = await read_multipart(request, max_bytes=cfg.max_upload_bytes, body_timeout=cfg.body_timeout_s)
        except APIError as e:
            if e.status == 413:
                await _drain(request)
            raise
        with up:
            metrics.stage.labels("upload").observe(time.perf_counter() - t0)
            if up.file is None:
                raise APIError("missing 'file' part (multipart field 'file' with a filename)", param="file")
            if up.file_size == 0:
                from ..errors import EmptyAudioError

                raise EmptyAudioError(f"uploaded file {up.filename!r} is empty (0 bytes)")
            fmt = up.get("response_format") or "json"
            if fmt not in FORMATS:
                raise APIError(f"response_format must be one of {', '.join(FORMATS)}; got {fmt!r}",
                               param="response_format", code="unsupported_response_format")
            gran = up.getlist("timestamp_granularities[]") + up.getlist("timestamp_granularities")
            bad = [g for g in gran if g not in ("word", "segment")]
            if bad:
                raise APIError(f"timestamp_granularities must be 'segment' and/or 'word'; got {bad[0]!r}",
                               param="timestamp_granularities[]")
            words = "word" in gran
            language = (up.get("language") or "").strip() or None
            if language is not None and not _LANG.match(language):
                raise APIError(f"language must be an ISO 639-1 code such as 'en'; got {language!r}", param="language")
            temp = up.get("temperature")
            if temp not in (None, ""):
                try:
                    tv = float(temp)
                except ValueError:
                    tv = -1.0
                if not 0.0 <= tv <= 1.0:
                    raise APIError(f"temperature must be a number in [0, 1]; got {temp!r}", param="temperature")
            stream = (up.get("stream") or "").strip().lower() in _TRUE
            t1 = time.perf_counter()
            loop = asyncio.get_running_loop()
            wav = await loop.run_in_executor(state["pool"], _decode, up)
        metrics.stage.labels("decode").observe(time.perf_counter() - t1)
        t2 = time.perf_counter()
        work = loop.create_task(backend().transcribe(wav.samples, language=language, word_timestamps=words,
                                                     priority=OFFLINE, timeout=cfg.request_timeout_s, task=task))
        watch = loop.create_task(_until_disconnect(request))
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work not in done:  # the client went away: drop the work (engine gets CANCEL)
            work.cancel()
            return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
        watch.cancel()
        transcript = work.result()
        transcript.duration = wav.duration
        metrics.stage.labels("transcribe").observe(time.perf_counter() - t2)
        metrics.audio_seconds.labels("offline").inc(wav.duration)
        if stream:
            return StreamingResponse(_sse(transcript), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        body = render(transcript, fmt, words=words if fmt == "verbose_json" else None)
        if fmt in ("json", "verbose_json"):
            return Response(body, media_type="application/json")
        return PlainTextResponse(body)

    def _decode(up):
        """Container decode + resample to 16 kHz (runs in the CPU pool; PyAV and soxr release the GIL)."""
        from ..audio import load_audio
        from ..errors import AudioError

        try:
            return load_audio(up.file, target_rate=16000, max_duration=cfg.max_audio_s)
        except AudioError as e:
            msg = str(e)
            if msg.startswith("<") and ">" in msg:  # name the upload, not our temp file object
                msg = f"uploaded file {up.filename!r}" + msg[msg.index(">") + 1:]
            err = AudioError(msg, code=e.code)
            raise err from None

    def _sse_pieces(transcript) -> list[str]:
        """One delta per segment, cut out of the final text itself, so the deltas concatenate to
        exactly the ``done`` text (segment texts carry their own leading spaces, or none)."""
        done = transcript.text.strip()
        pieces, pos = [], 0
        for seg in transcript.segments:
            t = (seg.text or "").strip()
            i = done.find(t, pos) if t else -1
            if i < 0:
                continue
            pieces.append(done[pos:i + len(t)])
            pos = i + len(t)
        if pos < len(done):
            pieces.append(done[pos:])
        return [p for p in pieces if p]

    async def _sse(transcript):
        for p in _sse_pieces(transcript):
            yield "data: " + json.dumps({"type": "transcript.text.delta", "delta": p}, ensure_ascii=False) + "\n\n"
        yield "data: " + json.dumps({"type": "transcript.text.done", "text": transcript.text.strip()},
                                    ensure_ascii=False) + "\n\n"

    # ------------------------------------------------------------ WebSockets
    ws_ids = itertools.count(1)

    async def _ws_open(ws: WebSocket) -> bool:
        protos = list(ws.scope.get("subprotocols") or [])
        try:
            check_auth(ws.headers, protos, ws.query_params)
        except APIError:
            await ws.close(code=1008, reason="invalid API key")
            metrics.requests.labels("ws", "401").inc()
            return False
        await ws.accept(subprotocol="realtime" if "realtime" in protos else None)
        metrics.requests.labels("ws", "101").inc()
        metrics.streams.inc()
        return True

    def _make_emit(ws: WebSocket):
        lock = asyncio.Lock()
        n = itertools.count(1)
        prefix = f"event_{next(ws_ids)}_"

        async def emit(ev: dict) -> None:
            ev = {"event_id": prefix + str(next(n)), **ev}
            data = json.dumps(ev, ensure_ascii=False, separators=(",", ":"))
            async with lock:
                await asyncio.wait_for(ws.send_text(data), cfg.send_timeout_s)

        return emit

    def _session_view(s: StreamSession, vad_cfg) -> dict:
        return {"id": s.id, "object": "realtime.transcription_session", "input_audio_format": "pcm16",
                "input_audio_sample_rate": s.resampler.rate,
                "input_audio_transcription": {"model": backend().info.get("model"), "language": s.language},
                "turn_detection": vad_cfg, "partial_interval_ms": s.partial_interval * 1000 // 16000}

    def _apply_session(s: StreamSession, sess: dict, vad_cfg):
        """Apply a session.update / transcription_session.update body; returns the new turn_detection."""
        if not isinstance(sess, dict):
            raise APIError("'session' must be an object", param="session")
        audio_in = ((sess.get("audio") or {}).get("input") or {}) if isinstance(sess.get("audio"), dict) else {}
        fmt = sess.get("input_audio_format")
        rate = sess.get("input_audio_sample_rate")
        f2 = audio_in.get("format")
        if fmt is not None and fmt != "pcm16":
            raise APIError(f"input_audio_format {fmt!r} is not supported; use 'pcm16'", param="input_audio_format",
                           code="unsupported_format")
        if isinstance(f2, dict):
            if f2.get("type", "audio/pcm") != "audio/pcm":
                raise APIError(f"audio format {f2.get('type')!r} is not supported; use 'audio/pcm'",
                               param="audio.input.format", code="unsupported_format")
            rate = f2.get("rate", rate)
        tr = sess.get("input_audio_transcription") or audio_in.get("transcription") or {}
        if "language" in tr:
            lang = tr.get("language") or None
            if lang is not None and not _LANG.match(str(lang)):
                raise APIError(f"language must be an ISO 639-1 code; got {lang!r}", param="language")
            s.language = lang
        if rate is not None:
            r = check_rate(rate)
            if r != s.resampler.rate:
                from .stream import Resampler

                s.resampler = Resampler(r)
        pi = sess.get("partial_interval_ms", tr.get("partial_interval_ms"))
        if pi is not None:
            try:
                s.partial_interval = max(0, int(float(pi) * 16))
            except (TypeError, ValueError):
                raise APIError("partial_interval_ms must be a number", param="partial_interval_ms") from None
        td_present = "turn_detection" in sess or "turn_detection" in audio_in
        if td_present:
            td = sess["turn_detection"] if "turn_detection" in sess else audio_in["turn_detection"]
            if td is None:
                s.vad, vad_cfg = None, None
                s.in_speech = False
            else:
                if not isinstance(td, dict) or td.get("type", "server_vad") != "server_vad":
                    raise APIError("turn_detection must be null or {'type': 'server_vad', ...}",
                                   param="turn_detection")
                try:
                    vad_cfg = {"type": "server_vad", "threshold": float(td.get("threshold", cfg.vad_threshold)),
                               "prefix_padding_ms": int(td.get("prefix_padding_ms", cfg.vad_prefix_padding_ms)),
                               "silence_duration_ms": int(td.get("silence_duration_ms",
                                                                 cfg.vad_silence_duration_ms))}
                except (TypeError, ValueError):
                    vad_cfg = None
                if vad_cfg is None or not 0.0 < vad_cfg["threshold"] < 1.0 or not (
                        0 <= vad_cfg["prefix_padding_ms"] <= 5000 and 0 < vad_cfg["silence_duration_ms"] <= 10000):
                    raise APIError("turn_detection: threshold must be in (0, 1), prefix_padding_ms in [0, 5000], "
                                   "silence_duration_ms in (0, 10000]", param="turn_detection")
                s.prefix = vad_cfg["prefix_padding_ms"] * 16
                s.vad = _LazyVad(vad_cfg)
        return vad_cfg

    async def _ws_error(emit, err: BaseException, client_event_id=None) -> None:
        _, body = error_body(err)
        e = dict(body["error"])
        if e["type"] == "server_error" and e["code"] == "internal_error":
            log.exception("websocket handler error", exc_info=err)
        e["event_id"] = client_event_id
        await emit({"type": "error", "error": e})

    async def _receive(ws: WebSocket):
        try:
            return await asyncio.wait_for(ws.receive(), cfg.ws_idle_timeout_s)
        except asyncio.TimeoutError:
            return None

    @app.websocket("/v1/realtime")
    async def realtime(ws: WebSocket):
        if not await _ws_open(ws):
            return
        emit = _make_emit(ws)
        vad_cfg = {"type": "server_vad", "threshold": cfg.vad_threshold,
                   "prefix_padding_ms": cfg.vad_prefix_padding_ms, "silence_duration_ms": cfg.vad_silence_duration_ms}
        rate = 24000
        try:
            if "sample_rate" in ws.query_params:
                rate = check_rate(ws.query_params["sample_rate"])
        except APIError as e:
            await _ws_error(emit, e)
            await ws.close(code=1008, reason="invalid sample_rate")
            metrics.streams.dec()
            return
        s = StreamSession(backend(), emit, input_rate=rate, vad=_LazyVad(vad_cfg), partial_interval_ms=cfg.partial_interval_ms,
                          max_utterance_s=cfg.max_utterance_s, prefix_padding_ms=cfg.vad_prefix_padding_ms,
                          metrics=metrics)
        ga = False
        try:
            await emit({"type": "transcription_session.created", "session": _session_view(s, vad_cfg)})
            while True:
                msg = await _receive(ws)
                if msg is None:
                    await ws.close(code=1000, reason="idle timeout")
                    break
                if msg["type"] == "websocket.disconnect":
                    break
                text = msg.get("text")
                if text is None:
                    await _ws_error(emit, APIError("binary frames are not part of the Realtime protocol; send JSON "
                                                   "events (or use /v1/stream for raw PCM)", code="invalid_request"))
                    continue
                eid = None
                try:
                    ev = json.loads(text)
                    if not isinstance(ev, dict) or not isinstance(ev.get("type"), str):
                        raise APIError("every event must be a JSON object with a string 'type'", param="type")
                    eid = ev.get("event_id")
                    typ = ev["type"]
                    if typ == "input_audio_buffer.append":
                        audio = ev.get("audio")
                        if not isinstance(audio, str):
                            raise APIError("'audio' must be a base64 string", param="audio")
                        try:
                            pcm = base64.b64decode(audio, validate=True)
                        except (binascii.Error, ValueError):
                            raise APIError("'audio' is not valid base64", param="audio") from None
                        await s.append_pcm16(pcm)
                    elif typ == "input_audio_buffer.commit":
                        await s.commit()
                    elif typ == "input_audio_buffer.clear":
                        await s.clear()
                    elif typ in ("transcription_session.update", "session.update"):
                        ga = typ == "session.update"
                        vad_cfg = _apply_session(s, ev.get("session") or {}, vad_cfg)
                        await emit({"type": "session.updated" if ga else "transcription_session.updated",
                                    "session": _session_view(s, vad_cfg)})
                    else:
                        raise APIError(f"unknown event type {typ!r}", param="type", code="unknown_event")
                except (ValueError, APIError, FlashASRError) as e:
                    if isinstance(e, ValueError) and not isinstance(e, FlashASRError):
                        e = APIError(f"malformed JSON event: {e}", code="invalid_json")
                    await _ws_error(emit, e, eid)
        except (asyncio.TimeoutError, RuntimeError, ConnectionError) as e:
            log.info("realtime stream ended: %s", e)
        except Exception as e:  # noqa: BLE001
            if type(e).__name__ not in ("WebSocketDisconnect", "ClientDisconnected"):
                log.exception("realtime stream failed")
        finally:
            await s.close()
            metrics.streams.dec()

    @app.websocket("/v1/stream")
    async def binary_stream(ws: WebSocket):
        if not await _ws_open(ws):
            return
        emit = _make_emit(ws)
        q = ws.query_params
        try:
            rate = check_rate(q.get("sample_rate", "16000"))
            lang = q.get("language") or None
            if lang is not None and not _LANG.match(lang):
                raise APIError(f"language must be an ISO 639-1 code; got {lang!r}", param="language")
            use_vad = (q.get("vad") or "false").lower() in _TRUE
            pi = float(q.get("partial_interval_ms", cfg.partial_interval_ms))
            full = (q.get("partials") or "delta").lower() == "full"
        except (APIError, ValueError) as e:
            await _ws_error(emit, e if isinstance(e, APIError) else APIError(str(e)))
            await ws.close(code=1008, reason="invalid query parameters")
            metrics.streams.dec()
            return
        vad_cfg = {"type": "server_vad", "threshold": cfg.vad_threshold,
                   "prefix_padding_ms": cfg.vad_prefix_padding_ms,
                   "silence_duration_ms": cfg.vad_silence_duration_ms} if use_vad else None
        s = StreamSession(backend(), emit, input_rate=rate, vad=_LazyVad(vad_cfg) if use_vad else None, language=lang,
                          partial_interval_ms=pi, max_utterance_s=cfg.max_utterance_s,
                          prefix_padding_ms=cfg.vad_prefix_padding_ms, metrics=metrics, full_partials=full)
        try:
            await emit({"type": "session.created", "session": _session_view(s, vad_cfg)})
            while True:
                msg = await _receive(ws)
                if msg is None:
                    await ws.close(code=1000, reason="idle timeout")
                    break
                if msg["type"] == "websocket.disconnect":
                    break
                if msg.get("bytes") is not None:
                    await s.append_pcm16(msg["bytes"])
                    continue
                try:
                    try:
                        ev = json.loads(msg.get("text") or "")
                    except ValueError as e:
                        raise APIError(f"malformed JSON control message: {e}", code="invalid_json") from None
                    typ = ev.get("type") if isinstance(ev, dict) else None
                    if typ in ("commit", "input_audio_buffer.commit"):
                        await s.commit()
                    elif typ in ("clear", "input_audio_buffer.clear"):
                        await s.clear()
                    elif typ == "close":
                        await s.drain(cfg.request_timeout_s)
                        await ws.close(code=1000)
                        break
                    else:
                        raise APIError(f"unknown control message {typ!r}; use commit, clear or close",
                                       param="type", code="unknown_event")
                except (APIError, FlashASRError) as e:
                    await _ws_error(emit, e)
        except (asyncio.TimeoutError, RuntimeError, ConnectionError) as e:
            log.info("binary stream ended: %s", e)
        except Exception as e:  # noqa: BLE001
            if type(e).__name__ not in ("WebSocketDisconnect", "ClientDisconnected"):
                log.exception("binary stream failed")
        finally:
            await s.close()
            metrics.streams.dec()

    app.add_middleware(_CountRequests, metrics=metrics)
    return app


class _LazyVad:
    """Creates the VAD on the first audio (idle connections cost no VAD state)."""

    def __init__(self, vad_cfg: dict):
        self.cfg = vad_cfg
        self._vad = None

    def process(self, x, start: int):
        if self._vad is None:
            self._vad = VadAdapter(self.cfg["threshold"], self.cfg["prefix_padding_ms"],
                                   self.cfg["silence_duration_ms"])
        return self._vad.process(x, start)


# ------------------------------------------------------------------ running
def _listen_socket(host: str, port: int, reuse_port: bool) -> socket.socket:
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(fam, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind((host, port))
    s.listen(4096)
    s.setblocking(False)
    return s


async def _serve(cfg: ServeConfig, app, sock: socket.socket) -> None:
    import uvicorn

    ucfg = uvicorn.Config(app, loop="none", lifespan="on", log_level=cfg.log_level, access_log=False,
                          ws_max_size=16 << 20, timeout_keep_alive=30, backlog=4096,
                          timeout_graceful_shutdown=5)
    server = uvicorn.Server(ucfg)
    await server.serve(sockets=[sock])


def _run_loop(coro) -> None:
    try:
        import uvloop

        uvloop.run(coro)
    except ImportError:  # pragma: no cover
        asyncio.run(coro)


def _remote_factory(path: str, supervisor=None):
    def make(cfg, pool, metrics):
        from .backend import RemoteBackend

        return RemoteBackend(cfg, path, metrics=metrics, supervisor=supervisor)

    return make


def frontend_main(cfg_dict: dict, path: str) -> None:
    """Entry point of an extra front-end worker process (multi mode, ``--workers`` > 1)."""
    from .engine_proc import die_with_parent

    die_with_parent()
    cfg = ServeConfig.from_dict(cfg_dict)
    logging.basicConfig(level=cfg.log_level.upper())
    _raise_fd_limit()
    sock = _listen_socket(cfg.host, cfg.port, reuse_port=True)
    _run_loop(_serve(cfg, create_app(cfg, _remote_factory(path)), sock))


def _raise_fd_limit() -> None:
    """Thousands of WebSockets need thousands of fds: lift the soft limit to the hard one."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY:
            hard = 1 << 20
        if soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError):  # pragma: no cover
        pass


def _announce(cfg: ServeConfig, sock) -> None:
    """One start-up line on stderr: where the server listens (the port may have been 0)."""
    import sys

    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"flashasr serve: listening on http://{shown}:{port} (model {cfg.model or 'tiny.en'}, "
          f"{cfg.mode} mode); /ready answers 200 once the model is loaded and warmed; Ctrl-C stops",
          file=sys.stderr, flush=True)


def run(cfg: ServeConfig) -> None:
    """Serve until SIGINT/SIGTERM in the configured process layout."""
    logging.basicConfig(level=cfg.log_level.upper())
    _raise_fd_limit()
    if cfg.mode == "single":
        sock = _listen_socket(cfg.host, cfg.port, reuse_port=False)
        _announce(cfg, sock)
        _run_loop(_serve(cfg, create_app(cfg), sock))
        return
    import multiprocessing as mp

    from .engine_proc import EngineSupervisor
    from .ipc import cleanup_stale_segments

    cleanup_stale_segments()  # shared memory left by crashed front ends of earlier runs

    tmpdir = None
    path = cfg.engine_socket
    if path is None:
        tmpdir = tempfile.mkdtemp(prefix="flashasr-")
        path = os.path.join(tmpdir, "engine.sock")
    sock = _listen_socket(cfg.host, cfg.port, reuse_port=cfg.workers > 1)
    _announce(cfg, sock)
    ctx = mp.get_context("spawn")
    workers = []

    stopping = []

    def start_worker(loop) -> None:
        p = ctx.Process(target=frontend_main, args=(cfg.to_dict(), path), name="flashasr-frontend", daemon=True)
        p.start()
        workers.append(p)

        def on_exit():  # a front-end worker died: replace it (its clients' connections are gone)
            loop.remove_reader(p.sentinel)
            p.join(0)
            workers.remove(p)
            cleanup_stale_segments()  # its pooled shared memory
            if not stopping:
                log.warning("front-end worker %s exited (code %s); starting another", p.pid, p.exitcode)
                loop.call_later(0.5, start_worker, loop)

        loop.add_reader(p.sentinel, on_exit)

    async def main_async():
        sup = EngineSupervisor(cfg, path)
        sup.start()
        loop = asyncio.get_running_loop()
        for _ in range(cfg.workers - 1):
            start_worker(loop)
        app = create_app(cfg, _remote_factory(path, sup))
        sup.metrics = app.state.metrics
        try:
            await _serve(cfg, app, sock)
        finally:
            stopping.append(True)
            for p in list(workers):
                loop.remove_reader(p.sentinel)
            sup.stop()

    try:
        _run_loop(main_async())
    finally:
        for p in workers:
            p.terminate()
        for p in workers:
            p.join(5)
        if tmpdir:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            os.rmdir(tmpdir)


def main(argv: list[str] | None = None) -> int:
    """``flashasr serve`` entry point (the CLI dispatches here). Returns the exit status."""
    import sys

    cfg = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        run(cfg)
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
