"""Prometheus metrics of the front end and of the engine (each with its own registry).

In multi-process mode the engine's registry lives in the engine process; a front end
fetches its text exposition over the IPC socket and appends it to ``/metrics``.

Besides the histograms (fixed buckets, for Prometheus), the front end keeps the last
:data:`RECENT` latencies of each stage (:class:`LatencyWindow`): exact p50/p95 of recent work for
``GET /status`` and the web page's server panel.
"""

from __future__ import annotations

import math
import threading
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

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
                                     "(multi mode: the supervisor's count, on every front end from the "
                                     "engine's HELLO)", registry=r)
        self.http_inflight = Gauge("flashasr_http_requests_inflight", "HTTP requests received and not answered "
                                   "yet, by endpoint", ["endpoint"], registry=r)
        self.recent: dict[str, LatencyWindow] = {}

    def observe(self, stage: str, seconds: float) -> None:
        """One latency of ``stage`` (seconds): the ``flashasr_stage_seconds`` histogram and the recent window."""
        self.stage.labels(stage).observe(seconds)
        w = self.recent.get(stage)
        if w is None:
            w = self.recent.setdefault(stage, LatencyWindow())
        w.add(seconds)

    def text(self) -> bytes:
        return generate_latest(self.registry)


RECENT = 256  # latencies kept per stage for the recent percentiles


class LatencyWindow:
    """The last ``size`` latencies of one stage (seconds), with exact percentiles over them.

    Thread-safe (observations come from the event loop; readers may be elsewhere).
    """

    def __init__(self, size: int = RECENT):
        self._values: deque = deque(maxlen=size)
        self._lock = threading.Lock()

    def add(self, seconds: float) -> None:
        with self._lock:
            self._values.append(float(seconds))

    def summary(self) -> dict:
        """``{"n", "p50_ms", "p95_ms", "last_ms"}`` over the window (nearest-rank percentiles; the
        ``*_ms`` values are None while the window is empty)."""
        with self._lock:
            vals = list(self._values)
        if not vals:
            return {"n": 0, "p50_ms": None, "p95_ms": None, "last_ms": None}
        s = sorted(vals)

        def rank(q: float) -> float:
            return round(s[max(0, math.ceil(q * len(s)) - 1)] * 1000, 1)

        return {"n": len(s), "p50_ms": rank(0.50), "p95_ms": rank(0.95), "last_ms": round(vals[-1] * 1000, 1)}


class StreamerCollector:
    """Prometheus collector of a chunked streamer, read when the metrics are:

    * ``flashasr_stream_slots{kind="capacity"|"live"}`` (gauge): the state pool; it doubles when
      full, which replaces its tensors and makes every bucket's graph re-capture on its next use;
    * ``flashasr_stream_graph_captures_total`` (counter): CUDA graphs of the step captured since the
      engine started (the warm-up's, then re-captures; 0 on the CPU);
    * ``flashasr_stream_work_total{kind}`` (counter): the streamer's counters since start: ``steps``
      (device steps; a call whose streams lag by more than one chunk runs several), ``rows`` (stream
      rows over all steps), ``encoder_frames`` (new frames encoded), ``padded_frames`` (frames
      computed, bucket and chunk padding included).

    The counters start again from 0 when the engine restarts (a counter reset to Prometheus)."""

    WORK = ("steps", "rows", "encoder_frames", "padded_frames")

    def __init__(self, streamer):
        self.streamer = streamer

    def describe(self):  # names are fixed; nothing to compute at registration
        return [GaugeMetricFamily("flashasr_stream_slots", "", labels=["kind"]),
                CounterMetricFamily("flashasr_stream_graph_captures", ""),
                CounterMetricFamily("flashasr_stream_work", "", labels=["kind"])]

    def collect(self):  # never fails a metrics read: a streamer without a pool or counters shows zeros
        st = self.streamer
        pool = getattr(st, "pool", None)
        capacity = getattr(pool, "capacity", 0)
        slots = GaugeMetricFamily("flashasr_stream_slots", "Chunked streaming state slots", labels=["kind"])
        slots.add_metric(["capacity"], capacity)
        slots.add_metric(["live"], capacity - len(getattr(pool, "free", ())))
        captures = CounterMetricFamily("flashasr_stream_graph_captures",
                                       "CUDA graphs of the streaming step captured since the engine started")
        captures.add_metric([], getattr(st, "captures", 0))
        work = CounterMetricFamily("flashasr_stream_work", "Chunked streaming work since the engine started",
                                   labels=["kind"])
        counters = getattr(st, "counters", {})
        for k in self.WORK:
            work.add_metric([k], counters.get(k, 0))
        return [slots, captures, work]


class EngineMetrics:
    """Engine side: queue depth, batch sizes, queue/inference latency, GPU memory."""

    def __init__(self, device: str = "cpu"):
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.queue_depth = Gauge("flashasr_engine_queue_depth", "Waveforms waiting for the model", ["kind"],
                                 registry=r)
        self.batch_size = Histogram("flashasr_engine_batch_size", "Waveforms per model call", ["kind"],
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        # stages: queue (wait for a model call), inference (the call on the model thread), handoff (a call's
        # wait for the thread handovers: event loop -> model thread -> event loop)
        self.stage = Histogram("flashasr_engine_stage_seconds", "Engine stage latency (queue wait, inference, "
                               "handoff between the event loop and the model thread)",
                               ["stage"], buckets=_LAT_BUCKETS, registry=r)
        self.inference = Histogram("flashasr_engine_inference_seconds", "Model call time by the kind of work "
                                   "it ran (final / partial / offline)", ["kind"], buckets=_LAT_BUCKETS, registry=r)
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

    def watch_streamer(self, streamer) -> None:
        """Export the chunked streamer's state pool, graphs and work, read when the metrics are
        (:class:`StreamerCollector`). The scheduler calls this for the streamer it is given."""
        self.registry.register(StreamerCollector(streamer))

    def text(self) -> bytes:
        return generate_latest(self.registry)
