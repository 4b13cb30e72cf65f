"""``flashasr serve --ray [ADDRESS]``: the same server on Ray Serve, one model replica per GPU.

::

    client --HTTP / WebSocket--> Ingress replica (--workers of them; each: the app of create_app,
       |                         our uvicorn on --host:--port with SO_REUSEPORT: routes, errors,
       |                         metrics, uploads' decode + VAD cutting, streams' resampling + VAD)
       |   RayBackend: DeploymentHandle calls; the samples cross once (Ray's object store)
       v
    ModelReplica (autoscaled between --ray-min-replicas and --ray-max-replicas on the requests it
                  holds; num_gpus=1 each on CUDA): the model behind its engine + our BatchScheduler
                  (finals, partials, the pieces of many uploads in one model call, up to --max-batch)

* **One hop for audio**: the ingress answers HTTP itself (Serve's own HTTP proxy is not started:
  through it an upload would cross proxy -> ingress -> replica), so decoded samples go from the
  process that received the bytes straight to the replica that transcribes them.
* **Streams stay on one replica**: every request of a WebSocket session carries the session's
  key (set per connection by :class:`_SessionKey`, inherited by the session's tasks) and
  :class:`~.ray_router.StreamAffinityRouter` sends them all to the replica its first one landed on.
* **Batching across requests** inside each replica: :class:`~.scheduler.BatchScheduler`, exactly as
  in single and multi mode (``--max-batch``; Serve's ``max_ongoing_requests`` is set far above
  it so requests reach the scheduler instead of waiting at the handle).
* **Autoscaling on queue depth**: Serve's autoscaler on the requests each replica holds (queued in
  its scheduler or running, plus those waiting at the handles) against
  ``--ray-target-ongoing`` (default 4 x ``--max-batch``), between the min and max replicas.
* **The same errors and metrics**: the routes are the app's; a replica's error comes back as its
  code, status and message (:class:`~.errors.APIError`); a replica that dies fails its in-flight
  requests at once with 503 ``engine_unavailable`` (as the engine process does in multi mode) and
  Serve starts another. ``/metrics`` = the ingress's front-end metrics + the replicas' engine
  metrics summed (:func:`merge_metrics`: counters, gauges and histograms add up across replicas).
  Each replica publishes its info and metrics to a small named actor (:class:`MetricsHub`) that
  the ingress reads (0.1 s after a request ends, else once a second); ``/ready`` lists the live
  replicas.

The driver (this command) starts Serve, deploys the application, prints where it listens and
waits; Ctrl-C / SIGTERM deletes the application (exit 0). A model that cannot load: exit 2.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import replace

import numpy as np

from ..options import ModelCapabilities, TranscribeOptions
from .config import ServeConfig
from .errors import APIError, EngineUnavailable

log = logging.getLogger("flashasr.serve")

APP_NAME = "flashasr"
HUB_NAMESPACE = "flashasr"
PUSH_INTERVAL_S = 1.0  # how often an idle replica publishes its info and metrics
PUSH_AFTER_S = 0.1  # a busy one: this long after a request ends (at most ten times a second)
STALE_S = 5.0  # a replica silent this long is not counted (died, or its node is gone)

#: The WebSocket session of the current task (None outside one): the routing key of its requests.
SESSION: contextvars.ContextVar = contextvars.ContextVar("flashasr_session", default=None)


class _SessionKey:
    """ASGI middleware: each WebSocket connection runs with its own :data:`SESSION` key, which
    the tasks its stream session spawns (partials, finals) inherit."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "websocket":
            return await self.app(scope, receive, send)
        token = SESSION.set(uuid.uuid4().hex)
        try:
            return await self.app(scope, receive, send)
        finally:
            SESSION.reset(token)


# ----------------------------------------------------------------------------- metrics
def merge_metrics(texts: list[str]) -> bytes:
    """Prometheus text expositions of several replicas -> one, every sample with equal name and
    labels summed (``*_created`` timestamps: the earliest). Counters, gauges and histogram buckets,
    counts and sums of identical buckets all add up across replicas."""
    from prometheus_client.parser import text_string_to_metric_families

    fams: dict[str, tuple[str, str, dict]] = {}
    for text in texts:
        for fam in text_string_to_metric_families(text):
            name = fam.name + "_total" if fam.type == "counter" else fam.name
            _doc, _typ, vals = fams.setdefault(name, (fam.documentation, fam.type, {}))
            for s in fam.samples:
                k = (s.name, tuple(sorted(s.labels.items())))
                if s.name.endswith("_created"):
                    vals[k] = min(vals.get(k, s.value), s.value)
                else:
                    vals[k] = vals.get(k, 0.0) + s.value
    lines = []
    for name, (doc, typ, vals) in fams.items():
        lines += [f"# HELP {name} {_escape(doc, help_text=True)}", f"# TYPE {name} {typ}"]
        for (sname, labels), v in vals.items():
            lab = ",".join(f'{k}="{_escape(val)}"' for k, val in labels)
            lines.append(f"{sname}{{{lab}}} {_value(v)}" if lab else f"{sname} {_value(v)}")
    return ("\n".join(lines) + "\n").encode() if lines else b""


def _escape(s: str, help_text: bool = False) -> str:
    s = s.replace("\\", "\\\\").replace("\n", "\\n")
    return s if help_text else s.replace('"', '\\"')


def _value(v: float) -> str:
    return repr(float(v)) if v == v and abs(v) != float("inf") else ("NaN" if v != v else ("+Inf" if v > 0 else "-Inf"))


class MetricsHub:
    """A Ray actor (one per server): the latest info and metrics text each model replica published."""

    def __init__(self):
        self.latest: dict[str, tuple[float, dict, str]] = {}

    def publish(self, replica: str, info: dict, metrics: str) -> None:
        self.latest[replica] = (time.time(), info, metrics)

    def forget(self, replica: str) -> None:
        self.latest.pop(replica, None)

    def snapshot(self) -> list[tuple[dict, str]]:
        """``[(info, metrics text)]`` of the replicas heard from within :data:`STALE_S`."""
        now = time.time()
        for k, (t, _i, _m) in list(self.latest.items()):
            if now - t > 10 * STALE_S:
                del self.latest[k]
        return [(i, m) for t, i, m in self.latest.values() if now - t <= STALE_S]


# ----------------------------------------------------------------------------- the model replica
class ModelReplica:
    """A Serve deployment class: the model and its :class:`~.scheduler.BatchScheduler` (built in
    the replica's event loop), publishing to the :class:`MetricsHub` named ``hub``."""

    async def __init__(self, cfg: dict, hub: str):
        import ray
        from ray import serve

        from .backend import load_and_warm, model_info
        from .metrics import EngineMetrics
        from .scheduler import BatchScheduler

        self.cfg = ServeConfig.from_dict(cfg)
        self.model = load_and_warm(self.cfg)
        self.caps = self.model.capabilities
        self.metrics = EngineMetrics(self.cfg.device)
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.info = {**model_info(self.model, self.cfg), "replica": self.replica,
                     "node": ray.util.get_node_ip_address()}
        self.scheduler = BatchScheduler(self.model, metrics=self.metrics, **self.cfg.scheduler_options)
        self.scheduler.start()
        self.hub = ray.get_actor(hub, namespace=HUB_NAMESPACE)
        self._changed = asyncio.Event()
        await self._publish()
        self._task = asyncio.get_running_loop().create_task(self._push())

    async def _publish(self) -> None:
        await self.hub.publish.remote(self.replica, self.info, self.metrics.text().decode())

    async def _push(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._changed.wait(), PUSH_INTERVAL_S)
                await asyncio.sleep(PUSH_AFTER_S)  # what ends meanwhile goes in the same publish
            except asyncio.TimeoutError:
                pass
            self._changed.clear()
            try:
                await self._publish()
            except Exception:  # noqa: BLE001 - the driver (and its hub) went away; the replica goes on
                pass

    def check_health(self) -> None:
        """Serve's health check: the scheduler's task must be alive."""
        t = self.scheduler._task
        if t is None or t.done():
            raise RuntimeError("the batching scheduler stopped")

    async def transcribe(self, samples: np.ndarray, options: dict, priority: int = 2,
                         coalesce_key: str | None = None, affinity: str | None = None) -> dict:
        """One waveform (float32 ``[N]`` at the model rate): ``{"transcripts": [t]}``,
        ``{"superseded": True}`` (a newer partial replaced it) or ``{"error": ...}``."""
        return await self._run(self.scheduler.submit(np.array(samples, np.float32), self._options(options),
                                                     priority=priority, coalesce_key=coalesce_key), single=True)

    async def transcribe_pieces(self, samples: np.ndarray, pieces, options: dict, priority: int = 2,
                                affinity: str | None = None) -> dict:
        """The pieces ``[(start, end)]`` of one upload or stream final (:class:`~flashasr.pipeline.plan.Piece`
        s with their speech spans): ``{"transcripts": [one per piece]}`` or ``{"error": ...}``."""
        return await self._run(self.scheduler.submit_pieces(np.array(samples, np.float32), pieces,
                                                            self._options(options), priority=priority), single=False)

    def _options(self, options: dict) -> TranscribeOptions:
        return TranscribeOptions.from_dict(options).resolve(self.caps)

    async def _run(self, coro, single: bool) -> dict:
        from ..errors import FlashASRError

        self.metrics.active.inc()
        try:
            got = await coro
        except FlashASRError as e:
            return {"error": {"code": e.code, "message": e.message, "param": getattr(e, "param", None),
                              "status": int(getattr(e, "status", 500) or 500)}}
        except Exception as e:  # noqa: BLE001 - an engine failure: a 500 naming its type, logged here
            log.exception("replica failure")
            return {"error": {"code": "internal_error", "message": f"engine error ({type(e).__name__})", "status": 500}}
        finally:
            self.metrics.active.dec()
            self._changed.set()
        if single and got is None:
            return {"superseded": True}
        return {"transcripts": [got] if single else list(got)}


# ----------------------------------------------------------------------------- the ingress
class RayBackend:
    """The app's backend in an ingress replica: the model replicas behind a DeploymentHandle (the
    same coroutines as :class:`~.backend.LocalBackend`; see :mod:`.backend`)."""

    mode = "ray"
    error = None

    def __init__(self, cfg: ServeConfig, handle, hub: str, metrics=None):
        self.cfg, self.handle, self.hub_name, self.metrics = cfg, handle, hub, metrics
        self.replicas: list[tuple[dict, str]] = []
        self._task: asyncio.Task | None = None
        self._hub = None

    @property
    def ready(self) -> bool:
        return bool(self.replicas)

    @property
    def info(self) -> dict:
        if not self.replicas:
            return {}
        return {**self.replicas[0][0], "replicas": [{k: i.get(k) for k in ("replica", "pid", "node")}
                                                   for i, _m in self.replicas]}

    @property
    def capabilities(self) -> ModelCapabilities | None:
        return ModelCapabilities.from_dict(self.replicas[0][0]["capabilities"]) if self.replicas else None

    async def start(self) -> None:
        import ray

        self._hub = ray.get_actor(self.hub_name, namespace=HUB_NAMESPACE)
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            try:
                self.replicas = await self._hub.snapshot.remote()
            except Exception as e:  # noqa: BLE001 - the hub is gone: the server is stopping
                log.debug("metrics hub unreachable: %s", e)
            await asyncio.sleep(0.25 if not self.replicas else PUSH_INTERVAL_S)

    async def wait_ready(self, timeout: float) -> bool:
        t_end = time.monotonic() + timeout
        while not self.ready and time.monotonic() < t_end:
            await asyncio.sleep(0.1)
        return self.ready

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def transcribe(self, samples: np.ndarray, options: TranscribeOptions, *, priority: int = 2,
                         coalesce_key: str | None = None, timeout: float | None = None):
        got = await self._call("transcribe", samples, options.to_dict(), int(priority), coalesce_key,
                               timeout=timeout)
        return None if got.get("superseded") else got["transcripts"][0]

    async def transcribe_pieces(self, samples: np.ndarray, pieces, options: TranscribeOptions, *,
                                priority: int = 2, timeout: float | None = None, segment: str | None = None) -> list:
        from ..pipeline.plan import Piece

        pieces = [Piece(p[0], p[1], getattr(p, "speech", None)) for p in pieces]  # the spans travel along
        got = await self._call("transcribe_pieces", samples, pieces, options.to_dict(), int(priority),
                               timeout=timeout)
        return got["transcripts"]

    async def _call(self, method: str, *args, timeout: float | None) -> dict:
        """One replica call; its error as an APIError, a dead replica as 503 ``engine_unavailable``."""
        from ray import exceptions as rex

        resp = getattr(self.handle, method).remote(*args, affinity=SESSION.get())
        if self.metrics is not None:
            self.metrics.inflight.inc()
        try:
            got = await asyncio.wait_for(_result(resp), timeout) if timeout else await resp
        except asyncio.TimeoutError:
            resp.cancel()
            raise APIError("transcription timed out", status=504, code="timeout") from None
        except asyncio.CancelledError:
            resp.cancel()
            raise
        except (rex.RayActorError, rex.ActorUnavailableError, rex.WorkerCrashedError, rex.ObjectLostError) as e:
            log.warning("model replica lost during a request: %s", type(e).__name__)
            raise EngineUnavailable("the model replica serving this request died; retry shortly") from None
        finally:
            if self.metrics is not None:
                self.metrics.inflight.dec()
        if "error" in got:
            e = got["error"]
            raise APIError(e.get("message", "engine error"), status=int(e.get("status", 500)),
                           code=e.get("code", "internal_error"), param=e.get("param"))
        return got

    async def metrics_text(self) -> bytes:
        """The replicas' engine metrics summed (:func:`merge_metrics`), as the hub has them now
        (each replica publishes within :data:`PUSH_AFTER_S` of a request's end)."""
        try:
            self.replicas = await asyncio.wait_for(self._hub.snapshot.remote(), 5)
        except Exception as e:  # noqa: BLE001 - the hub is gone (stopping): the last copy
            log.debug("metrics hub unreachable: %s", e)
        return merge_metrics([m for _i, m in self.replicas])


async def _result(resp):
    return await resp


class Ingress:
    """A Serve deployment class: the app ``make_app`` builds (:func:`~.app.create_app`) with a :class:`RayBackend`,
    served by our uvicorn on ``cfg.host:cfg.port`` (``SO_REUSEPORT``: the ingress replicas of one
    node share the port) in a thread of its own."""

    def __init__(self, cfg: dict, model, hub: str, make_app):
        from .process import _configure_logging, _raise_fd_limit

        self.cfg = ServeConfig.from_dict(cfg)
        _configure_logging(self.cfg)
        _raise_fd_limit()
        app = make_app(self.cfg, backend_factory=lambda c, pool, metrics: RayBackend(c, model, hub, metrics))
        app.add_middleware(_SessionKey)
        self.sock = _listen(self.cfg.host, self.cfg.port)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._serve, args=(app,), name="flashasr-ingress", daemon=True)
        self.thread.start()

    def _serve(self, app) -> None:
        from .process import _run_loop, _serve

        try:
            _run_loop(_serve(self.cfg, app, self.sock))
        except BaseException as e:  # noqa: BLE001 - reported by check_health
            self.error = e
        if self.error is None:
            self.error = RuntimeError("the HTTP server stopped")

    def check_health(self) -> None:
        if self.error is not None or not self.thread.is_alive():
            raise RuntimeError(f"ingress HTTP server down: {self.error}")

    def address(self) -> tuple[str, int]:
        import ray

        return ray.util.get_node_ip_address(), self.sock.getsockname()[1]


def _listen(host: str, port: int) -> socket.socket:
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(fam, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind((host, port))
    s.listen(4096)
    s.setblocking(False)
    return s


# ----------------------------------------------------------------------------- the driver
def build_application(cfg: ServeConfig, hub: str, resources: dict, make_app):
    """The Serve application: ``Ingress`` (``cfg.workers`` replicas) bound to ``ModelReplica``
    (autoscaled; one GPU each on CUDA)."""
    from ray import serve
    from ray.serve.config import AutoscalingConfig, RequestRouterConfig

    from .ray_router import StreamAffinityRouter

    gpu = str(cfg.device).startswith("cuda")
    lo = int(cfg.ray_min_replicas)
    hi = int(cfg.ray_max_replicas or (max(lo, int(resources.get("GPU", 0))) if gpu else lo))
    target = float(cfg.ray_target_ongoing or 4 * cfg.batch_limit)
    model = serve.deployment(ModelReplica, name="ModelReplica").options(
        ray_actor_options={"num_gpus": 1, "num_cpus": 1} if gpu else {"num_cpus": 1},
        max_ongoing_requests=max(1000, int(8 * target)),
        autoscaling_config=AutoscalingConfig(min_replicas=lo, max_replicas=max(lo, hi), initial_replicas=lo,
                                             target_ongoing_requests=target, upscale_delay_s=10,
                                             downscale_delay_s=120),
        request_router_config=RequestRouterConfig(request_router_class=StreamAffinityRouter,
                                                  request_router_kwargs={"ttl_s": 2 * cfg.ws_idle_timeout_s}),
        health_check_period_s=2, health_check_timeout_s=30, graceful_shutdown_timeout_s=5,
        max_constructor_retry_count=3)  # a model that does not load: give up (exit 2) after 3 tries
    ingress = serve.deployment(Ingress, name="Ingress").options(
        num_replicas=int(cfg.workers), ray_actor_options={"num_cpus": 1}, max_ongoing_requests=10,
        health_check_period_s=2, graceful_shutdown_timeout_s=5)
    cfg_d = cfg.to_dict()
    return ingress.bind(cfg_d, model.bind(cfg_d, hub), hub, make_app)


def run_ray(cfg: ServeConfig, make_app) -> int:
    """Serve on Ray until SIGINT/SIGTERM (see the module docstring); returns the exit status (0,
    or 2 when the application cannot be deployed, e.g. the model does not load)."""
    import signal

    import ray
    from ray import serve

    from ..ray_cluster import connect
    from .process import EXIT_MODEL_FAILED, _configure_logging

    _configure_logging(cfg)
    resources = connect(None if cfg.ray in (None, "default") else cfg.ray)
    if str(cfg.device).startswith("cuda") and resources.get("GPU", 0) < cfg.ray_min_replicas:
        log.error("--device %s with --ray-min-replicas %d: the Ray cluster has %g GPU(s)", cfg.device,
                  cfg.ray_min_replicas, resources.get("GPU", 0))
        return EXIT_MODEL_FAILED
    if not cfg.port:  # one free port for every ingress replica of this node
        with socket.socket() as s:
            s.bind((cfg.host, 0))
            cfg = replace(cfg, port=s.getsockname()[1])
    hub_name = f"flashasr-hub-{uuid.uuid4().hex[:8]}"
    hub = ray.remote(num_cpus=0)(MetricsHub).options(name=hub_name, namespace=HUB_NAMESPACE).remote()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(proxy_location="Disabled")
        handle = serve.run(build_application(cfg, hub_name, resources, make_app), name=APP_NAME, route_prefix=None)
        host, port = handle.address.remote().result(timeout_s=60)
    except Exception as e:  # noqa: BLE001 - a model that does not load, a port in use, ...
        log.error("the Ray Serve application could not be deployed: %s", e)
        _shutdown(serve)
        return EXIT_MODEL_FAILED
    import sys

    shown = cfg.host if cfg.host not in ("0.0.0.0", "::") else host
    print(f"flashasr serve: listening on http://{shown}:{port} (model {cfg.model or 'tiny.en'}, ray mode: "
          f"{cfg.workers} ingress replica(s), {cfg.ray_min_replicas}+ model replica(s)); /ready answers 200 once a "
          "model replica is up; Ctrl-C stops", file=sys.stderr, flush=True)
    while not stop.wait(0.5):
        pass
    _shutdown(serve)
    ray.kill(hub)
    return 0


def _shutdown(serve) -> None:
    try:
        serve.delete(APP_NAME)
        serve.shutdown()
    except Exception as e:  # noqa: BLE001 - the cluster is going away anyway
        log.debug("serve shutdown: %s", e)


__all__ = ["run_ray", "build_application", "merge_metrics", "RayBackend", "ModelReplica", "Ingress", "MetricsHub",
           "SESSION"]
