"""A front end's graceful stop: what every door does between the first SIGINT/SIGTERM and the
end of uvicorn's grace (``G`` = :data:`~.process.GRACE_S`, 5 s), the same in single and multi mode.

==========  ================================================================================
seconds     what happens (:meth:`Stopping.begin` starts the clock, on the event loop)
==========  ================================================================================
0           uvicorn takes no new connections. Each WebSocket session stops reading the client
            and waits for the finals it has committed (audio not committed is dropped, as on a
            close); once they are out it is closed ``1001`` "server shutting down"
            (:data:`GOING_AWAY`). uvicorn's own shutdown of the connections (and its ``1012``
            for any WebSocket still open) waits until every session has closed, at most until
            ``G - 0.5``. HTTP requests go on.
``G - 1``   the backend's cut (:data:`MODEL_CUT_S`): every request still waiting for the model
            fails with 503 ``engine_unavailable`` "the server is shutting down"
            (:func:`~.errors.shutting_down`): an upload gets it as its reply, a stream final as
            ``...transcription.failed``.
``G - 0.5`` the last cut (:data:`LAST_CUT_S`): an HTTP request whose response has not started
            (its body still arriving, its decode or VAD still running) is cancelled and answered
            with the same 503 (:class:`ShutdownGuard`); a stream final still not out gets its
            ``...failed`` with that error and the session closes.
``G``       uvicorn cancels what is left: nothing, unless a response already started is still
            being sent.
==========  ================================================================================

So no request of a stopping server ends in a 500 and a traceback (uvicorn's cancellation), and no
committed final goes unanswered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math

from starlette.responses import JSONResponse

from .errors import error_body, shutting_down

log = logging.getLogger("flashasr.serve")

MODEL_CUT_S = 1.0  # before the grace ends: requests waiting for the model get 503 'shutting down'
LAST_CUT_S = 0.5   # before the grace ends: HTTP requests with no response yet get it, streams close
GOING_AWAY = 1001  # WebSocket close code of a stopping server (RFC 6455 7.4.1: "a server going down")


class Stopping:
    """One front end's stop, shared by its doors (``app.state.stopping``); see the module docstring.

    Attributes:
        begun: the stop has begun (:meth:`begin`).
    """

    def __init__(self) -> None:
        self.begun = False
        self._cut_at = math.inf       # loop time of the last cut
        self._watchers: set[asyncio.Future] = set()  # one per live WebSocket session
        self._sessions_done: asyncio.Event | None = None
        self.requests: dict[asyncio.Task, "_Guarded"] = {}  # HTTP requests in flight (ShutdownGuard)

    def begin(self, grace_s: float, backend=None) -> None:
        """Start the stop (idempotent): WebSocket sessions wind down now, ``backend.begin_shutdown``
        cuts the model's requests at ``grace_s - MODEL_CUT_S`` s, the last cut comes at ``grace_s -
        LAST_CUT_S`` s. Runs on the event loop."""
        if self.begun:
            return
        self.begun = True
        loop = asyncio.get_running_loop()
        if hasattr(backend, "begin_shutdown"):
            backend.begin_shutdown(max(0.0, grace_s - MODEL_CUT_S))
        last = max(0.0, grace_s - LAST_CUT_S)
        self._cut_at = loop.time() + last
        loop.call_later(last, self._last_cut)
        for fut in self._watchers:
            if not fut.done():
                fut.set_result(None)

    def left(self) -> float:
        """Seconds until the last cut (``inf`` before the stop begins, 0 after the cut)."""
        if not self.begun:
            return math.inf
        return max(0.0, self._cut_at - asyncio.get_running_loop().time())

    # ------------------------------------------------------------------ WebSocket sessions
    @contextlib.contextmanager
    def session(self):
        """``with stopping.session() as stop:`` around a WebSocket session: ``stop`` is a future
        done once the stop begins (at once if it has); :meth:`sessions_closed` waits for the
        sessions inside such a block."""
        fut = asyncio.get_running_loop().create_future()
        if self.begun:
            fut.set_result(None)
        self._watchers.add(fut)
        try:
            yield fut
        finally:
            self._watchers.discard(fut)
            if not fut.done():
                fut.cancel()
            if not self._watchers and self._sessions_done is not None:
                self._sessions_done.set()

    async def sessions_closed(self, margin_s: float = 0.25) -> None:
        """Wait until every WebSocket session has ended, at most until ``margin_s`` after the last
        cut (a session closes itself by then); at once when the stop has not begun (nothing tells
        the sessions to close)."""
        if not self._watchers or not self.begun:
            return
        self._sessions_done = asyncio.Event()
        try:
            await asyncio.wait_for(self._sessions_done.wait(), self.left() + margin_s)
        except asyncio.TimeoutError:
            log.info("shutting down: %d stream(s) still open at the cut", len(self._watchers))

    # ------------------------------------------------------------------ HTTP requests
    def _last_cut(self) -> None:
        """Every HTTP request whose response has not started is cancelled; its guard answers 503."""
        cut = [task for task, req in self.requests.items() if not req.started and not task.done()]
        if cut:
            log.info("shutting down: %d HTTP request(s) without a response yet get 503", len(cut))
        for task in cut:
            self.requests[task].cut = True
            task.cancel()


class _Guarded:
    """One HTTP request under :class:`ShutdownGuard`: whether its response has started."""

    def __init__(self, send) -> None:
        self._send = send
        self.started = False
        self.cut = False

    async def send(self, msg) -> None:
        if msg["type"] == "http.response.start":
            self.started = True
        await self._send(msg)


class ShutdownGuard:
    """ASGI middleware for HTTP: each request runs as a task of its own that the last cut of a
    stopping server (:meth:`Stopping._last_cut`) may cancel; a request so cancelled is answered
    with 503 ``engine_unavailable`` "the server is shutting down" (OpenAI's error JSON,
    ``Connection: close``) instead of uvicorn's 500 and traceback at the end of its grace.
    WebSockets and lifespan events pass through."""

    def __init__(self, app, stopping: Stopping) -> None:
        self.app = app
        self.stopping = stopping

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        req = _Guarded(send)
        task = asyncio.get_running_loop().create_task(self.app(scope, receive, req.send))
        self.stopping.requests[task] = req
        try:
            await asyncio.wait([task])
        except asyncio.CancelledError:  # uvicorn gave up on the request: so does its task
            task.cancel()
            raise
        finally:
            self.stopping.requests.pop(task, None)
        if task.cancelled() and req.cut:
            status, body = error_body(shutting_down())
            return await JSONResponse(body, status_code=status, headers={"Connection": "close"})(scope, receive, send)
        return task.result()


__all__ = ["Stopping", "ShutdownGuard", "GOING_AWAY", "MODEL_CUT_S", "LAST_CUT_S"]
