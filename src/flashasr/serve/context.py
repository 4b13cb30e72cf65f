"""What every door of one front-end process shares: the config, the metrics, the CPU pool and the
backend (the last two exist once the app's lifespan has started them)."""

from __future__ import annotations

from ..options import ModelCapabilities
from .config import ServeConfig
from .errors import APIError, EngineUnavailable
from .metrics import FrontendMetrics


class ServeContext:
    """Args:
        cfg: the server's configuration.
        metrics: the front end's :class:`~.metrics.FrontendMetrics`.
        state: ``{"pool": CPUPool, "stream_pool": CPUPool, "backend": LocalBackend |
            RemoteBackend}``, filled by the lifespan (``app.state.flashasr``).
    """

    def __init__(self, cfg: ServeConfig, metrics: FrontendMetrics, state: dict):
        self.cfg = cfg
        self.metrics = metrics
        self.state = state

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

    def capabilities(self) -> ModelCapabilities:
        """The loaded model's capabilities.

        Raises:
            EngineUnavailable (503): multi mode, the engine is not connected (starting, restarting).
            APIError (503 ``model_not_ready``): single mode, the model is still loading or failed.
        """
        b = self.backend
        caps = b.capabilities
        if caps is not None:
            return caps
        if getattr(b, "mode", "") == "multi":
            raise EngineUnavailable()
        err = getattr(b, "error", None)
        raise APIError("the model is still loading" if err is None else f"model failed: {err}", status=503,
                       code="model_not_ready")

    def model_name(self) -> str:
        return self.backend.info.get("model") or (self.cfg.model or "whisper-tiny.en")
