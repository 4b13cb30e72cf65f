"""The OpenAI-compatible HTTP + WebSocket app: :func:`create_app` assembles it from its roles.

==================  ==========================================================================
module              role
==================  ==========================================================================
:mod:`.app`         the app: lifespan (CPU pool, backend), error JSON, request counting and the
                    access log, routers
:mod:`.context`     what the doors share: config, metrics, CPU pool, backend, model capabilities
:mod:`.cpu_pool`    the CPU pool: decode and VAD jobs, short requests' first
:mod:`.routes`      HTTP routes (``/health``, ``/ready``, ``/metrics``, ``/status``, ``/v1/models``,
                    ``/v1/audio/transcriptions``, ``/v1/audio/translations``), the API key check
:mod:`.status`      ``/status``: the front end's and engine's figures as one JSON object
:mod:`.web`         the web page for people: ``GET /`` and its files under ``/ui/`` (``static/``)
:mod:`.offline`     the serving layer of uploads: options, decode, plan (VAD), pieces through
                    the backend, merge, reply
:mod:`.protocol`    requests into objects: the upload form, Realtime session updates, the
                    ``/v1/stream`` query; session views and SSE events
:mod:`.websocket`   ``WS /v1/realtime`` (OpenAI Realtime transcription, JSON events, base64 PCM16)
                    and ``WS /v1/stream?sample_rate=16000`` (raw PCM16 frames in, JSON events out)
:mod:`.stream`      a live stream's session (resampling, server VAD, partials, finals)
:mod:`.backend`     where transcription runs: this process or the engine process
:mod:`.shutdown`    the graceful stop: streams deliver their committed finals, requests cut
                    short get 503 'shutting down' before uvicorn's grace ends
:mod:`.process`     running it: sockets, uvicorn, single and multi mode (:func:`main` here hands
                    it :func:`create_app`)
==================  ==========================================================================

Process layout (see docs/SERVING.md): ``--mode single`` runs everything in one process;
``--mode multi`` runs one engine process (model + batching scheduler) and ``--workers``
front-end processes talking to it over persistent Unix sockets (:mod:`.ipc`).
``python -m flashasr.serve.app`` runs :func:`main` (``flashasr serve``).
"""

from __future__ import annotations

import gc
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..errors import FlashASRError
from .config import ACCESS_LOGGER, ServeConfig
from .context import ServeContext
from .cpu_pool import CPUPool
from .errors import APIError, error_body
from .metrics import FrontendMetrics
from .process import main as _serve_main
from .routes import http_router
from .shutdown import ShutdownGuard, Stopping
from .web import web_router
from .websocket import websocket_router

log = logging.getLogger("flashasr.serve")
access_log = logging.getLogger(ACCESS_LOGGER)

HTTP_ENDPOINTS = ("/v1/audio/transcriptions", "/v1/audio/translations", "/v1/models", "/health", "/ready",
                  "/metrics", "/status", "/")


def create_app(cfg: ServeConfig, backend_factory=None) -> FastAPI:
    """Build the ASGI app.

    Args:
        cfg: server configuration.
        backend_factory: ``f(cfg, pool, metrics) -> backend`` (LocalBackend or RemoteBackend);
            default: :class:`~.backend.LocalBackend` (single-process mode).
    Returns:
        the app; ``app.state.flashasr`` is ``{"pool", "backend"}`` once started,
        ``app.state.metrics`` the :class:`~.metrics.FrontendMetrics`, ``app.state.stopping`` its
        :class:`~.shutdown.Stopping` (:meth:`~.shutdown.Stopping.begin` when the server begins to
        stop), ``app.state.cfg`` ``cfg``.
    """
    metrics = FrontendMetrics()
    stopping = Stopping()
    ctx = ServeContext(cfg, metrics, {}, stopping)

    @asynccontextmanager
    async def lifespan(app):
        pool = CPUPool(max(1, cfg.cpu_threads), "flashasr-cpu")  # short requests' decode and VAD first
        stream_pool = CPUPool(1, "flashasr-stream")  # finals' VAD: never behind an upload's decode
        if backend_factory is None:
            from .backend import LocalBackend

            backend = LocalBackend(cfg, pool)
        else:
            backend = backend_factory(cfg, pool, metrics)
        ctx.state.update(pool=pool, stream_pool=stream_pool, backend=backend)
        if hasattr(backend, "on_fatal") and getattr(app.state, "shutdown", None) is not None:
            from .process import EXIT_MODEL_FAILED

            backend.on_fatal = lambda: app.state.shutdown(EXIT_MODEL_FAILED)
        await backend.start()
        if getattr(backend, "mode", "") == "multi" and cfg.gc_freeze:
            gc.collect()
            gc.freeze()  # the front end's start-up objects leave the GC's scans
        try:
            yield
        finally:
            await backend.stop()
            pool.shutdown(wait=False, cancel_futures=True)
            stream_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="flashasr", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.flashasr = ctx.state
    app.state.stopping = stopping
    app.state.metrics = metrics
    app.state.cfg = cfg
    app.add_exception_handler(FlashASRError, _flashasr_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(ClientDisconnect, _client_gone)
    app.include_router(http_router(ctx))
    app.include_router(web_router())
    app.include_router(websocket_router(ctx))
    app.add_middleware(ShutdownGuard, stopping=stopping)  # inside the request log: it logs the 503
    app.add_middleware(_RequestLog, metrics=metrics, access_log=cfg.access_log)
    return app


def error_response(err: BaseException) -> JSONResponse:
    """OpenAI's error JSON with the error's HTTP status (401 adds ``WWW-Authenticate``)."""
    status, body = error_body(err)
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(body, status_code=status, headers=headers)


async def _flashasr_error(request, exc: FlashASRError) -> JSONResponse:
    return error_response(exc)


async def _http_error(request, exc: StarletteHTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
    return error_response(APIError(str(exc.detail), status=exc.status_code, code=code))


async def _client_gone(request, exc: ClientDisconnect) -> Response:
    """A client that left before its body ended: one INFO line, no traceback, 499 (nobody reads it)."""
    received = getattr(exc, "received", None)  # upload.ClientGone knows how much arrived
    log.info("client %s disconnected during upload (%s bytes received)", _peer(request.scope),
             "?" if received is None else received)
    return Response(status_code=499)


def _peer(scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "-"


class _RequestLog:
    """ASGI middleware, one pass per HTTP request: ``flashasr_requests_total{endpoint, status}``,
    ``flashasr_http_requests_inflight{endpoint}`` while it runs and, when ``access_log``, one INFO
    line on ``flashasr.serve.access``:
    ``127.0.0.1:50412 "POST /v1/audio/transcriptions" 200 812.4 ms`` (client, method, path without
    the query, status (499: the client left first), time to the end of the response). An exception
    no handler answered (before the response started) is logged with its traceback and answered
    with OpenAI's error JSON, 500 ``internal_error``."""

    def __init__(self, app, metrics: FrontendMetrics, access_log: bool = True):
        self.app = app
        self.metrics = metrics
        self.access_log = access_log

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 0
        t0 = time.perf_counter()
        path = scope.get("path", "")
        endpoint = path if path in HTTP_ENDPOINTS else "other"
        inflight = self.metrics.http_inflight.labels(endpoint)
        inflight.inc()

        async def _send(msg):
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
            await send(msg)

        try:
            await self.app(scope, receive, _send)
        except Exception as e:  # noqa: BLE001 - an error no handler answered (a model's own failure)
            if status:  # the response had started: nothing more can be said to the client
                raise
            log.error("unhandled error answering %s %s", scope.get("method", ""), path, exc_info=e)
            # OpenAI's error JSON (500 internal_error) instead of Starlette's bare text 500, which also
            # dropped the connection; the log and the metric say 500, not 499
            await error_response(e)(scope, receive, _send)
        finally:
            inflight.dec()
            self.metrics.requests.labels(endpoint, str(status or 499)).inc()
            if self.access_log:
                access_log.info('%s "%s %s" %d %.1f ms', _peer(scope), scope.get("method", ""), path, status or 499,
                                (time.perf_counter() - t0) * 1000)


def main(argv: list[str] | None = None) -> int:
    """``flashasr serve`` (the CLI dispatches here): :func:`.process.main` serving :func:`create_app`.
    Returns the exit status."""
    from ..malloc import pin_mmap_threshold

    pin_mmap_threshold()  # also for ``python -m flashasr.serve.app`` (see flashasr.malloc)
    return _serve_main(argv, create_app, _run_ray)


def _run_ray(cfg: ServeConfig, make_app) -> int:
    """``--ray``: :func:`.ray_serve.run_ray` (imported only then: Ray is an optional extra)."""
    from .ray_serve import run_ray

    return run_ray(cfg, make_app)


__all__ = ["create_app", "error_response", "main"]

if __name__ == "__main__":
    raise SystemExit(main())
