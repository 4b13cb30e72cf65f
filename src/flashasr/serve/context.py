"""What every door of one front-end process shares: the config, the metrics, the server's stop, the
CPU pool and the backend (the last two exist once the app's lifespan has started them)."""

from __future__ import annotations

from ..options import ModelCapabilities
from .config import ENGINE_WAIT_S, ServeConfig
from .errors import APIError, EngineUnavailable
from .metrics import FrontendMetrics
from .shutdown import Stopping


class ServeContext:
    """Args:
        cfg: the server's configuration.
        metrics: the front end's :class:`~.metrics.FrontendMetrics`.
        state: ``{"pool": CPUPool, "stream_pool": CPUPool, "backend": LocalBackend |
            RemoteBackend}``, filled by the lifespan (``app.state.flashasr``).
        stopping: the front end's :class:`~.shutdown.Stopping` (``app.state.stopping``).
    """

    def __init__(self, cfg: ServeConfig, metrics: FrontendMetrics, state: dict, stopping: Stopping | None = None):
        self.cfg = cfg
        self.metrics = metrics
        self.state = state
        self.stopping = stopping or Stopping()

    @property
    def backend(self):
        return self.state["backend"]

    @property
    def pool(self):
        return self.state["pool"]

    @property
    def stream_pool(self):
        """One thread for the VAD of streaming finals (never queued behind an upload's decode)."""
        return self.state.get("stream_pool") or self.state["pool"]

    async def capabilities(self) -> ModelCapabilities:
        """The loaded model's capabilities. Multi and Ray mode: when the engine (model replica) is not
        connected yet, waits up to :data:`ENGINE_WAIT_S` for it (a front end that has just started, or
        one whose engine restarts, connects on its own a moment after the port takes requests).

        Raises:
            EngineUnavailable (503): multi mode, still not connected after the wait; the message says
                whether the engine is starting, restarting or the server shutting down.
            APIError (503 ``model_not_ready``): single mode, the model is still loading or failed;
                Ray mode, no model replica is ready.
        """
        b = self.backend
        caps = b.capabilities or await self.engine_connected()
        if caps is not None:
            return caps
        if getattr(b, "mode", "") == "multi":
            raise EngineUnavailable(b.client.unavailable_reason())
        err = getattr(b, "error", None)
        if getattr(b, "mode", "") == "ray":
            raise APIError("no model replica is ready yet; retry shortly", status=503, code="model_not_ready")
        raise APIError("the model is still loading" if err is None else f"model failed: {err}", status=503,
                       code="model_not_ready")

    async def engine_connected(self) -> ModelCapabilities | None:
        """Multi and Ray mode: wait up to :data:`ENGINE_WAIT_S` for the engine connection (model
        replica) when there is none; returns the capabilities then, None if it did not come (or
        single mode, still loading). Never raises."""
        b = self.backend
        if b.capabilities is None and getattr(b, "mode", "") in ("multi", "ray"):
            await b.wait_ready(ENGINE_WAIT_S)
        return b.capabilities

    def model_name(self) -> str:
        return self.backend.info.get("model") or (self.cfg.model or "whisper-tiny.en")
