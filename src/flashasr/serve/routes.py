"""The HTTP routes (thin: each hands its request to the layer that serves it) and the API key check.

==================================  ====================================================
route                               answered by
==================================  ====================================================
``GET /health``                     the process is alive
``GET /ready``                      the backend: 200 once the model is loaded and warmed
``GET /metrics``                    front-end + engine Prometheus text
``GET /status``                     :class:`~.status.StatusReporter`: the same figures as one JSON object
``GET /v1/models``                  the loaded model's name
``POST /v1/audio/transcriptions``   :class:`~.offline.UploadTranscriber`, task ``transcribe``
``POST /v1/audio/translations``     :class:`~.offline.UploadTranscriber`, task ``translate``
==================================  ====================================================

The WebSocket routes are in :mod:`.websocket`, the web page (``GET /``) in :mod:`.web`.
"""

from __future__ import annotations

import hmac
import os

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from .context import ServeContext
from .errors import APIError
from .offline import UploadTranscriber
from .status import StatusReporter


def check_auth(api_key: str | None, headers, subprotocols=(), query=None) -> None:
    """Accept the request when no key is configured or it carries the key: ``Authorization: Bearer
    KEY``, a WebSocket subprotocol ``openai-insecure-api-key.KEY`` or ``?api_key=KEY``.

    Raises:
        APIError (401 ``invalid_api_key``).
    """
    if not api_key:
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
    if got is None or not hmac.compare_digest(got.encode(), api_key.encode()):
        raise APIError("missing or invalid API key (send 'Authorization: Bearer KEY')", status=401,
                       code="invalid_api_key", type="invalid_request_error")


def http_router(ctx: ServeContext) -> APIRouter:
    """The HTTP routes of one front end."""
    router = APIRouter()
    uploads = UploadTranscriber(ctx)
    status = StatusReporter(ctx)

    @router.get("/health")
    async def health():
        return {"status": "ok"}

    @router.get("/ready")
    async def ready():
        b = ctx.backend
        if b.ready:
            return {"status": "ready", "mode": b.mode, "frontend_pid": os.getpid(), **b.info}
        body = {"status": "loading", "mode": b.mode}
        if getattr(b, "error", None):
            body["error"] = b.error
        sup = getattr(b, "supervisor", None)
        if sup is not None:
            body["engine_restarts"] = sup.restarts
        return JSONResponse(body, status_code=503)

    @router.get("/metrics")
    async def metrics():
        text = ctx.metrics.text() + await ctx.backend.metrics_text()
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @router.get("/status")
    async def status_json():
        """Model, streams, requests in flight, recent latency percentiles, GPU memory (:mod:`.status`)."""
        return await status()

    @router.get("/v1/models")
    async def models(request: Request):
        check_auth(ctx.cfg.api_key, request.headers)
        model = {"id": ctx.model_name(), "object": "model", "created": 0, "owned_by": "flashasr"}
        caps = ctx.backend.capabilities
        if caps is not None:  # what the request options do with this model (an extension of OpenAI's object)
            model["flashasr"] = {"family": caps.family, "languages": None if caps.languages is None else
                                 sorted(caps.languages), "translates": caps.translates, "prompt": caps.prompts,
                                 "temperature": caps.temperature, "window_s": caps.window_s}
        return {"object": "list", "data": [model]}

    @router.post("/v1/audio/transcriptions")
    async def transcriptions(request: Request):
        """OpenAI ``audio.transcriptions.create`` (form fields: :func:`.protocol.parse_upload`)."""
        check_auth(ctx.cfg.api_key, request.headers)
        return await uploads(request, "transcribe")

    @router.post("/v1/audio/translations")
    async def translations(request: Request):
        """OpenAI ``audio.translations.create``: English text from speech in any language the
        model knows (Whisper's translate task; multilingual Whisper models only, else 400
        ``unsupported_task``). Same form fields and response formats as transcriptions;
        ``language``, if given, names the SOURCE language."""
        check_auth(ctx.cfg.api_key, request.headers)
        return await uploads(request, "translate")

    return router


__all__ = ["http_router", "check_auth"]
