"""The HTTP routes (thin: each hands its request to the layer that serves it) and the API key check.

==================================  ====================================================
route                               answered by
==================================  ====================================================
``GET /health``                     the process is alive
``GET /ready``                      the backend: 200 once the model is loaded and warmed
``GET /metrics``                    front-end + engine Prometheus text
``GET /status``                     :class:`~.status.StatusReporter`: the same figures as one JSON object
``GET /v1/models``                  the loaded model's name
``GET /v1/models/{id}``             the same entry by its id (404 ``model_not_found`` for another)
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

OPENAI_MODEL_NAMES = frozenset({"whisper-1", "gpt-4o-transcribe", "gpt-4o-mini-transcribe"})  # clients send these


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
        body = {"status": "loading", "mode": b.mode, "frontend_pid": os.getpid()}
        if getattr(b, "error", None):
            body["error"] = b.error
        if hasattr(b, "unready_info"):  # multi mode: why, and the engine's restarts (every front end)
            body.update(b.unready_info())
        return JSONResponse(body, status_code=503)

    @router.get("/metrics")
    async def metrics():
        text = ctx.metrics.text() + await ctx.backend.metrics_text()
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @router.get("/status")
    async def status_json():
        """Model, streams, requests in flight, recent latency percentiles, GPU memory (:mod:`.status`)."""
        return await status()

    def model_object() -> dict:
        """OpenAI's model object for the loaded model, with what the request options do with it
        (``flashasr``: an extension of OpenAI's object)."""
        model = {"id": ctx.model_name(), "object": "model", "created": 0, "owned_by": "flashasr"}
        caps = ctx.backend.capabilities
        if caps is not None:
            model["flashasr"] = {"family": caps.family, "languages": None if caps.languages is None else
                                 sorted(caps.languages), "translates": caps.translates, "prompt": caps.prompts,
                                 "temperature": caps.temperature, "window_s": caps.window_s}
        return model

    @router.get("/v1/models")
    async def models(request: Request):
        """OpenAI ``models.list``: the one loaded model."""
        check_auth(ctx.cfg.api_key, request.headers)
        return {"object": "list", "data": [model_object()]}

    @router.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        """OpenAI ``models.retrieve``: the list's entry for its id, and for the names of OpenAI's
        transcription models (``whisper-1``, ...: the ``model`` a request names is accepted and the
        loaded model serves it, so retrieving it answers the loaded model, as ``served_by``); any
        other id is OpenAI's 404 ``model_not_found`` (param ``model``)."""
        check_auth(ctx.cfg.api_key, request.headers)
        if model_id in OPENAI_MODEL_NAMES:
            return model_object() | {"id": model_id, "served_by": ctx.model_name()}
        if model_id == (ctx.cfg.model or "tiny.en"):  # the name it was started with (and announced)
            return model_object()
        if model_id != ctx.model_name():
            raise APIError(f"the model {model_id[:100]!r} does not exist; this server serves "
                           f"{ctx.model_name()!r} (GET /v1/models)", status=404, code="model_not_found",
                           param="model")
        return model_object()

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
