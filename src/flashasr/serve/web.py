"""The web page for people: ``GET /`` and its files under ``/ui/``.

The page (``static/``: plain HTML, CSS and JavaScript shipped as package data; no CDN, no
external fonts or scripts) is a client of the public protocols only:

================================  ==========================================================
page part                         talks to
================================  ==========================================================
File tab (upload, transcript,     ``POST /v1/audio/transcriptions`` (``verbose_json`` with
segment playback, downloads)      segment and word times; the ``Server-Timing`` reply header
                                  gives the request's speed factor)
Live tab (microphone)             ``WS /v1/realtime?sample_rate=16000``: an AudioWorklet
                                  (``pcm-worklet.js``) resamples the microphone to the
                                  session's declared rate and sends PCM16 frames of 20 ms
                                  as ``input_audio_buffer.append``
Server panel                      ``GET /status`` (:mod:`.status`) every 2 s
API key (when the server has one) ``Authorization: Bearer`` over HTTP, the
                                  ``openai-insecure-api-key.KEY`` subprotocol (or
                                  ``?api_key=``) on the WebSocket
================================  ==========================================================

Files are served from a fixed list read at start-up (the names in ``static/``), never from a
path the client builds; each with its content type and ``Cache-Control: no-cache`` (a browser
revalidates, so a new version of the page is seen at once).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

from .errors import APIError

STATIC = Path(__file__).resolve().parent / "static"
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml", ".png": "image/png", ".txt": "text/plain"}
HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}


def page_files(folder: Path = STATIC) -> dict[str, Path]:
    """``{file name: path}`` of the page's files (those with a known content type)."""
    if not folder.is_dir():
        return {}
    return {p.name: p for p in sorted(folder.iterdir()) if p.is_file() and p.suffix in TYPES}


def web_router(folder: Path = STATIC) -> APIRouter:
    """``GET /`` (``index.html``) and ``GET /ui/{name}`` (any other file of the page).

    Raises (as replies):
        APIError 404 ``not_found`` for a name that is not one of the page's files; 503
        ``page_missing`` at ``/`` when the package was installed without its page.
    """
    router = APIRouter()
    files = page_files(folder)

    def send(name: str) -> FileResponse:
        p = files[name]
        return FileResponse(p, media_type=TYPES[p.suffix], headers=HEADERS)

    @router.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def index():
        if "index.html" not in files:
            raise APIError(f"the web page is not installed (no index.html in {folder})", status=503,
                           code="page_missing")
        return send("index.html")

    @router.api_route("/ui/{name}", methods=["GET", "HEAD"], include_in_schema=False)
    async def asset(name: str):
        if name not in files:
            raise APIError(f"no page file named {name[:100]!r}", status=404, code="not_found")
        return send(name)

    return router


__all__ = ["web_router", "page_files", "STATIC"]
