"""Prometheus metrics of the front end and of the engine (each with its own registry).

In multi-process mode the engine's registry lives in the engine process; a front end
fetches its text exposition over the IPC socket and appends it to ``/metrics``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LAT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)


class FrontendMetrics:
    """HTTP/WebSocket side: request counts by status, audio seconds, stage latencies, streams."""

    def __init__(self):
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("flashasr_requests_total", "HTTP/WebSocket requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.audio_seconds = Counter("flashasr_audio_seconds_total", "Seconds of audio processed",
                                     ["kind"], registry=r)
        self.stage = Histogram("flashasr_stage_seconds", "Latency of request stages (front end)", ["stage"],
                               buckets=_LAT_BUCKETS, registry=r)
        self.streams = Gauge("flashasr_active_streams", "Open WebSocket streams", registry=r)
        self.inflight = Gauge("flashasr_engine_requests_inflight",
                              "Requests sent to the engine and not answered yet", registry=r)
        self.engine_restarts = Gauge("flashasr_engine_restarts", "Times the engine process was restarted "
                                     "(multi mode, supervising process only)", registry=r)

    def text(self) -> bytes:
        return generate_latest(self.registry)


class EngineMetrics:
    """Engine side: queue depth, batch sizes, queue/inference latency, GPU memory."""

    def __init__(self, device: str = "cpu"):
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.queue_depth = Gauge("flashasr_engine_queue_depth", "Waveforms waiting for the model", ["kind"],
                                 registry=r)
        self.batch_size = Histogram("flashasr_engine_batch_size", "Waveforms per model call", ["kind"],
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.stage = Histogram("flashasr_engine_stage_seconds", "Engine stage latency (queue wait, inference)",
                               ["stage"], buckets=_LAT_BUCKETS, registry=r)
        self.active = Gauge("flashasr_engine_requests_active", "Requests received by the engine and not "
                            "answered yet (queued or running)", registry=r)
        self.audio_seconds = Counter("flashasr_engine_audio_seconds_total", "Seconds of audio through the model",
                                     ["kind"], registry=r)
        self.gpu_memory = None
        if str(device).startswith("cuda"):
            try:
                import torch

                if torch.cuda.is_available():
                    g = Gauge("flashasr_gpu_memory_bytes", "GPU memory held by torch", ["kind"], registry=r)
                    g.labels("allocated").set_function(lambda: torch.cuda.memory_allocated())
                    g.labels("reserved").set_function(lambda: torch.cuda.memory_reserved())
                    self.gpu_memory = g
            except Exception:  # pragma: no cover - no torch / no CUDA
                pass

    def text(self) -> bytes:
        return generate_latest(self.registry)
