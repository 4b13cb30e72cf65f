"""Where transcription runs: in this process (single mode) or in the engine process (multi mode).

Both backends expose the same coroutines -- :meth:`transcribe` (one waveform, a stream's partial
or final: float32 [N] 16 kHz samples -> :class:`~flashasr.types.Transcript`),
:meth:`transcribe_pieces` (the pieces of one upload, cut by :func:`flashasr.pipeline.plan_pieces`:
-> one Transcript per piece) and :meth:`stream_chunk` (a stream's new audio for its chunked
partial -> :class:`~flashasr.models.parakeet.streaming.StreamResult`; :meth:`stream_close` drops
its state) -- with the request's :class:`~flashasr.options.TranscribeOptions`, and ``ready``,
``info`` (``stream_partials``: ``"chunked"`` when the model has a streamer, else ``"reencode"``),
``capabilities`` (the model's :class:`~flashasr.options.ModelCapabilities`, None until it is
loaded) and ``metrics_text``.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time

import numpy as np

from ..errors import FlashASRError
from ..options import ModelCapabilities, TranscribeOptions
from .config import ENGINE_WAIT_S, ServeConfig
from .errors import APIError, shutting_down
from .ipc import EngineClient
from .scheduler import OFFLINE, BatchScheduler

log = logging.getLogger("flashasr.serve")


class LocalBackend:
    """Single-process mode: the model and the batching scheduler live in the front end's process.

    The model loads in the CPU pool after the server starts listening, so ``/health``
    answers at once and ``/ready`` turns 200 once the model is loaded and warmed up.
    """

    mode = "single"

    def __init__(self, cfg: ServeConfig, pool, model=None):
        self.cfg = cfg
        self.pool = pool
        self.model = model
        self.scheduler: BatchScheduler | None = None
        self.info: dict = {}
        self.error: str | None = None
        self.on_fatal = None  # called when the model cannot be loaded (the app stops the server)
        self._task: asyncio.Task | None = None
        self._closing: asyncio.TimerHandle | None = None
        self._closed = False  # begin_shutdown's time has come: every request gets 503 'shutting down'

    @property
    def ready(self) -> bool:
        return self.scheduler is not None

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._load())

    async def _load(self) -> None:
        load_s = None  # a model handed in was loaded elsewhere
        try:
            if self.model is None:
                t0 = time.perf_counter()
                self.model = await asyncio.get_running_loop().run_in_executor(self.pool, load_and_warm, self.cfg)
                load_s = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001
            self.error = f"{type(e).__name__}: {e}"
            log.error("model failed to load: %s; stopping", self.error)
            if self.on_fatal is not None:  # a server that can never become ready stops (exit 2)
                self.on_fatal()
            return
        m = self.model
        t0 = time.perf_counter()
        streamer = make_streamer(m, self.cfg)
        self.scheduler = BatchScheduler(m, streamer=streamer, **self.cfg.scheduler_options)
        self.scheduler.start()
        self.info = {**model_info(m, self.cfg, streamer), "startup_s": startup_info(m, load_s, time.perf_counter() - t0)}
        if self.cfg.gc_freeze:
            gc.collect()
            gc.freeze()  # start-up and warm-up objects leave the GC's scans

    async def wait_ready(self, timeout: float) -> bool:
        if self._task:
            await asyncio.wait_for(asyncio.shield(self._task), timeout)
        return self.ready

    def begin_shutdown(self, close_after_s: float) -> None:
        """The server is stopping: ``close_after_s`` s from now every request still waiting for the
        model, and every one made after, fails with 503 'the server is shutting down'
        (:func:`~.errors.shutting_down`, as :meth:`RemoteBackend.begin_shutdown` does in multi mode),
        an answer before uvicorn's graceful timeout would cancel it without one. Idempotent."""
        if self._closing is None:
            self._closing = asyncio.get_running_loop().call_later(close_after_s, self._close)

    def _close(self) -> None:
        self._closed = True
        if self.scheduler is not None:
            n = self.scheduler.fail_all(shutting_down)
            if n:
                log.info("shutting down: %d piece(s) still waiting for the model get 503", n)

    def wait_idle(self, timeout: float) -> bool:
        """Block up to ``timeout`` s until no model call runs (:meth:`BatchScheduler.wait_idle`);
        whether none does."""
        return self.scheduler is None or self.scheduler.wait_idle(timeout)

    async def stop(self) -> None:
        if self._closing is not None:
            self._closing.cancel()
        if self._task:
            self._task.cancel()
        if self.scheduler:
            await self.scheduler.stop()

    @property
    def capabilities(self) -> ModelCapabilities | None:
        return self.model.capabilities if self.scheduler is not None else None

    def _scheduler(self) -> BatchScheduler:
        if self._closed:
            raise shutting_down()
        if self.scheduler is None:
            raise APIError("the model is still loading" if self.error is None else f"model failed: {self.error}",
                           status=503, code="model_not_ready")
        return self.scheduler

    async def transcribe(self, samples: np.ndarray, options: TranscribeOptions, *, priority: int = OFFLINE,
                         coalesce_key: str | None = None, timeout: float | None = None):
        """One waveform; None when a partial was superseded (see BatchScheduler.submit)."""
        sched = self._scheduler()
        return await self._counted(sched, sched.submit(samples, options, priority=priority, coalesce_key=coalesce_key),
                                   timeout)

    async def transcribe_pieces(self, samples: np.ndarray, pieces, options: TranscribeOptions, *,
                                priority: int = OFFLINE, timeout: float | None = None, segment: str | None = None) -> list:
        """The pieces of one recording (see BatchScheduler.submit_pieces): an upload's, or a stream
        final's (``priority=FINAL``). ``segment`` (a shared-memory segment holding ``samples``) is
        of no use in this process."""
        sched = self._scheduler()
        return await self._counted(sched, sched.submit_pieces(samples, pieces, options, priority=priority), timeout)

    async def stream_chunk(self, key: str, samples: np.ndarray, options: TranscribeOptions, *, new: bool = False,
                           timeout: float | None = None):
        """A stream's new audio through the chunked streamer (see BatchScheduler.submit_chunk)."""
        sched = self._scheduler()
        return await self._counted(sched, sched.submit_chunk(key, samples, options, new=new), timeout)

    def stream_close(self, key: str) -> None:
        """Drop a stream's chunked state (no reply; idempotent)."""
        if self.scheduler is not None:
            self.scheduler.close_stream(key)

    @staticmethod
    async def _counted(sched: BatchScheduler, coro, timeout: float | None):
        """``coro`` counted in ``flashasr_engine_requests_active`` while it runs (as the engine
        process counts its requests in multi mode)."""
        active = sched.metrics.active
        active.inc()
        try:
            return await _within(coro, timeout)
        finally:
            active.dec()

    async def metrics_text(self) -> bytes:
        return self.scheduler.metrics.text() if self.scheduler else b""


class RemoteBackend:
    """Multi-process mode: transcription runs in the engine process, reached over :class:`EngineClient`.

    ``supervisor``: front end #0's :class:`~.engine_proc.EngineSupervisor` (its restart count);
    ``engine``: what the supervisor knew when it started this worker, ``{"up": bool, "restarts":
    int}`` -- a worker replaced while the engine is up joins only once connected (:meth:`start`).
    """

    mode = "multi"

    def __init__(self, cfg: ServeConfig, socket_path: str, metrics=None, supervisor=None, engine: dict | None = None):
        self.cfg = cfg
        engine = engine or {}
        self.client = EngineClient(socket_path, shm_threshold=cfg.shm_threshold_bytes, metrics=metrics,
                                   connect_wait_s=ENGINE_WAIT_S, engine_seen=bool(engine.get("up")),
                                   engine_restarts=int(engine.get("restarts", 0)))
        self.supervisor = supervisor
        self._closing: asyncio.TimerHandle | None = None
        self._closer: asyncio.Task | None = None

    @property
    def ready(self) -> bool:
        return self.client.ready

    @property
    def info(self) -> dict:
        return {**self.client.info, "engine_restarts": self.engine_restarts}

    @property
    def engine_restarts(self) -> int:
        """Times the engine was restarted: the supervisor's count on front end #0, else the last
        HELLO's (the same once connected)."""
        return self.supervisor.restarts if self.supervisor is not None else self.client.engine_restarts

    def unready_info(self) -> dict:
        """What ``/ready`` adds while there is no engine connection: the reason a request would
        get (starting, restarting, shutting down) and the engine restarts known."""
        return {"reason": self.client.unavailable_reason(), "engine_restarts": self.engine_restarts}

    error = None

    async def start(self) -> None:
        """Connect to the engine in the background; a worker replaced while the engine is up
        (``engine["up"]``) waits for the connection first (up to ``ENGINE_WAIT_S``), so that the
        port's connections reaching it meanwhile wait in its backlog instead of getting 503."""
        await self.client.start()
        if self.client.engine_seen:
            await self.client.wait_ready(ENGINE_WAIT_S)

    async def wait_ready(self, timeout: float) -> bool:
        return await self.client.wait_ready(timeout)

    def begin_shutdown(self, close_after_s: float) -> None:
        """The server is stopping (its front ends before the engine): a lost engine is no restart
        from now on (:meth:`EngineClient.begin_shutdown`), and the requests still waiting for the
        engine ``close_after_s`` s later get 503 'shutting down' (:meth:`EngineClient.close`), an
        answer before uvicorn's graceful timeout would cancel them without one."""
        self.client.begin_shutdown()
        if self._closing is None:
            loop = asyncio.get_running_loop()
            self._closing = loop.call_later(close_after_s, self._close_soon, loop)

    def _close_soon(self, loop) -> None:
        self._closer = loop.create_task(self.client.close())

    async def stop(self) -> None:
        if self._closing is not None:
            self._closing.cancel()
        await self.client.close()

    @property
    def capabilities(self) -> ModelCapabilities | None:
        caps = self.client.info.get("capabilities")
        return ModelCapabilities.from_dict(caps) if caps else None

    async def transcribe(self, samples: np.ndarray, options: TranscribeOptions, *, priority: int = OFFLINE,
                         coalesce_key: str | None = None, timeout: float | None = None):
        got = await self.client.transcribe(samples, options, priority=priority, coalesce_key=coalesce_key,
                                           timeout=timeout)
        return None if got is None else got[0]

    async def transcribe_pieces(self, samples: np.ndarray, pieces, options: TranscribeOptions, *,
                                priority: int = OFFLINE, timeout: float | None = None, segment: str | None = None) -> list:
        """The pieces through the engine; ``segment``: the shared-memory segment whose first bytes
        are ``samples``, handed to the engine instead of a copy (the caller unlinks it after)."""
        return await self.client.transcribe(samples, options, pieces=pieces, priority=priority, timeout=timeout,
                                            segment=segment)

    async def stream_chunk(self, key: str, samples: np.ndarray, options: TranscribeOptions, *, new: bool = False,
                           timeout: float | None = None):
        return await self.client.stream_chunk(key, samples, options, new=new, timeout=timeout)

    def stream_close(self, key: str) -> None:
        self.client.stream_close(key)

    async def metrics_text(self) -> bytes:
        return await self.client.stats() if self.client.ready else b""


async def _within(coro, timeout: float | None):
    try:
        return await (asyncio.wait_for(coro, timeout) if timeout else coro)
    except asyncio.TimeoutError:
        raise APIError("transcription timed out", status=504, code="timeout") from None


def model_info(model, cfg: ServeConfig, streamer=None) -> dict:
    """What ``/ready``, ``/v1/models`` and the engine's HELLO say about the loaded model
    (``stream_partials``: how the streams' partials are computed, see :func:`make_streamer`)."""
    caps = model.capabilities
    info = {"model": caps.name, "family": caps.family, "sample_rate": caps.sample_rate, "pid": os.getpid(),
            "device": cfg.device, "translates": caps.translates, "capabilities": caps.to_dict(),
            "stream_partials": "chunked" if streamer is not None else "reencode"}
    if streamer is not None:
        info["stream_chunk"] = {"left_frames": streamer.L, "chunk_frames": streamer.C,
                                "frame_s": streamer.frame_seconds, "slots": streamer.pool.capacity}
    return info


def startup_info(model, load_s: float | None, streamer_s: float) -> dict:
    """Where a model's start-up went, as ``/ready`` shows it (``startup_s``): ``model_s`` (load and
    warm-up, :func:`load_and_warm`), ``streamer_s`` (the chunked streamer's captures), and what the
    model reports of its own start-up within ``model_s``: a GPU engine's build and graph warm-up
    (``engine_info["startup_s"]``: ``engine_build_s``, ``graph_warmup_s`` and, within the warm-up, the
    encoder profiles' and decoder graphs' captures, ``encoder_graphs_s`` / ``decoder_graphs_s``), a
    random-weight joint's calibration (``calibration["seconds"]``)."""
    out = {"model_s": None if load_s is None else round(load_s, 1), "streamer_s": round(streamer_s, 1)}
    engine = getattr(model, "engine_info", None)
    if isinstance(engine, dict) and isinstance(engine.get("startup_s"), dict):
        out.update({f"{k}_s": v for k, v in engine["startup_s"].items()})
    calibration = getattr(model, "calibration", None)
    if isinstance(calibration, dict) and "seconds" in calibration:
        out["calibration_s"] = calibration["seconds"]
    return out


def make_streamer(model, cfg: ServeConfig):
    """The chunked streamer for the model's partials, or None (re-encoded partials): ``--stream-partials
    reencode``, or a model without one (Whisper: its encoder takes fixed 30 s windows with absolute
    positions, nothing to cache per frame), or a model whose configuration the streamer refuses."""
    if cfg.stream_partials == "reencode" or not hasattr(model, "make_streamer"):
        if cfg.stream_partials == "chunked":
            log.warning("--stream-partials chunked: %s has no chunked streaming; partials re-encode",
                        getattr(model, "name", "the model"))
        return None
    try:
        streamer = model.make_streamer(cfg.streaming_config())
    except FlashASRError as e:
        log.warning("chunked streaming partials unavailable (%s); partials re-encode", e)
        return None
    if cfg.warmup:
        try:
            streamer.warmup()
            oom = getattr(streamer, "capture_oom", False)
        except Exception as e:  # noqa: BLE001 - out of memory only; anything else is a fault to see
            if type(e).__name__ != "OutOfMemoryError":
                raise
            oom = True
        if oom:  # its eager steps would fail too, and take the finals' memory: finals first, partials re-encode
            log.error("chunked streaming partials need more GPU memory than is free (%d stream slots, %.2f s of "
                      "left context, %d row buckets): partials re-encode instead; lower --stream-slots, "
                      "--stream-left-s or --stream-buckets-per-octave", cfg.stream_slots, cfg.stream_left_s,
                      len(getattr(streamer, "buckets", ())))
            del streamer
            _free_device_cache(model)
            return None
    return streamer


def _free_device_cache(model) -> None:
    """Give the memory of a dropped streamer's graphs and states back to the device (CUDA only)."""
    if str(getattr(model, "device", "cpu")).startswith("cuda"):
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()


def load_and_warm(cfg: ServeConfig):
    """Load the configured model behind its engine and run it once on 1 s of low noise (first-call
    costs paid now)."""
    from ..pipeline.engines import load_model

    model = load_model(cfg.model, device=cfg.device, dtype=cfg.dtype, engine=cfg.engine)
    if cfg.warmup:
        rng = np.random.default_rng(0)
        model.transcribe_waveform((rng.standard_normal(16000) * 1e-3).astype(np.float32))
    return model
