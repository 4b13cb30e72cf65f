"""``GET /status``: what one front end and its engine are doing now, as one small JSON object.

The web page's server panel polls it (every 2 s); a dashboard or a person with ``curl`` can too.
It is open like ``/metrics`` (counts and timings, no transcripts). The figures come from
the same places as ``/metrics``: this front end's :class:`~.metrics.FrontendMetrics` and the
engine's Prometheus text (this process's scheduler in single mode, the engine process's over
its socket in multi mode), so the two never disagree.

======================  ==========================================================================
key                     value
======================  ==========================================================================
``status``              ``ready`` once the model is loaded and warmed, else ``loading``
``model``               ``name``, ``family``, ``device``, ``sample_rate`` (Hz), ``languages`` (codes the
                        language hint may take; None: the hint does not steer the model),
                        ``multilingual``, ``translates``, ``window_s`` (longest piece, s); None while
                        loading
``mode``                ``single`` or ``multi``; ``frontend_pid``
``limits``              ``max_upload_mb``, ``max_audio_s``, ``api_key_required``
``streams_live``        open WebSocket streams of this front end
``uploads_in_flight``   ``POST /v1/audio/*`` requests of this front end not answered yet
``engine``              ``requests_active`` (requests the engine holds: queued or running),
                        ``queue_depth`` (waveforms waiting for the model, by kind)
``latency_ms``          per stage (``request``: an upload from its last body byte to the reply;
                        ``partial``, ``final``: a stream's model call, queueing included; ``upload``,
                        ``decode``, ``plan``, ``transcribe``): ``n``, ``p50_ms``, ``p95_ms``,
                        ``last_ms`` over this front end's last :data:`~.metrics.RECENT` requests
``audio_seconds``       audio transcribed by this front end since start: ``offline``, ``stream``
``gpu_memory_bytes``    ``allocated``, ``reserved`` by torch on the engine's GPU; None on CPU
``uptime_s``            seconds since this front end started
======================  ==========================================================================
"""

from __future__ import annotations

import os
import time

from prometheus_client.parser import text_string_to_metric_families

from .context import ServeContext

UPLOAD_ENDPOINTS = ("/v1/audio/transcriptions", "/v1/audio/translations")


def samples(text: str) -> dict[str, list[tuple[dict, float]]]:
    """Prometheus text exposition -> ``{sample name: [(labels, value), ...]}``."""
    out: dict[str, list[tuple[dict, float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def _sum(found: dict, name: str, **labels) -> float:
    return sum(v for lab, v in found.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))


def _by_label(found: dict, name: str, label: str) -> dict[str, float]:
    return {lab.get(label, ""): v for lab, v in found.get(name, [])}


class StatusReporter:
    """Builds the ``/status`` object of one front end (``await reporter()``)."""

    def __init__(self, ctx: ServeContext):
        self.ctx = ctx
        self.started = time.monotonic()

    async def __call__(self) -> dict:
        ctx, b = self.ctx, self.ctx.backend
        front = samples(ctx.metrics.text().decode())
        engine = samples((await b.metrics_text()).decode()) if b.ready else {}
        gpu = _by_label(engine, "flashasr_gpu_memory_bytes", "kind")
        return {
            "status": "ready" if b.ready else "loading",
            "model": self._model(),
            "mode": b.mode,
            "frontend_pid": os.getpid(),
            "limits": {"max_upload_mb": ctx.cfg.max_upload_mb, "max_audio_s": ctx.cfg.max_audio_s,
                       "api_key_required": bool(ctx.cfg.api_key)},
            "streams_live": int(_sum(front, "flashasr_active_streams")),
            "uploads_in_flight": int(sum(_sum(front, "flashasr_http_requests_inflight", endpoint=e)
                                         for e in UPLOAD_ENDPOINTS)),
            "engine": {"requests_active": int(_sum(engine, "flashasr_engine_requests_active")),
                       "queue_depth": {k: int(v) for k, v in
                                       _by_label(engine, "flashasr_engine_queue_depth", "kind").items()}},
            "latency_ms": {k: w.summary() for k, w in sorted(ctx.metrics.recent.items())},
            "audio_seconds": {k: round(v, 3) for k, v in
                              _by_label(front, "flashasr_audio_seconds_total", "kind").items()},
            "gpu_memory_bytes": ({"allocated": int(gpu.get("allocated", 0)), "reserved": int(gpu.get("reserved", 0))}
                                 if gpu else None),
            "uptime_s": round(time.monotonic() - self.started, 1),
        }

    def _model(self) -> dict | None:
        b = self.ctx.backend
        caps = b.capabilities
        if caps is None:
            return None
        return {"name": self.ctx.model_name(), "family": caps.family,
                "device": b.info.get("device", self.ctx.cfg.device), "sample_rate": caps.sample_rate,
                "languages": None if caps.languages is None else sorted(caps.languages),
                "multilingual": caps.multilingual, "translates": caps.translates, "window_s": caps.window_s}


__all__ = ["StatusReporter", "samples", "UPLOAD_ENDPOINTS"]
