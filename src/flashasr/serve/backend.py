"""Where transcription runs: in this process (single mode) or in the engine process (multi mode).

Both backends expose the same coroutine :meth:`transcribe` (float32 [N] 16 kHz samples ->
:class:`~flashasr.types.Transcript`), ``ready``, ``info`` and ``metrics_text``.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os

import numpy as np

from .config import ServeConfig
from .errors import APIError
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
        self._task: asyncio.Task | None = None

    @property
    def ready(self) -> bool:
        return self.scheduler is not None

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._load())

    async def _load(self) -> None:
        from .engine_proc import load_and_warm

        try:
            if self.model is None:
                self.model = await asyncio.get_running_loop().run_in_executor(self.pool, load_and_warm, self.cfg)
        except Exception as e:  # noqa: BLE001
            self.error = f"{type(e).__name__}: {e}"
            log.error("model failed to load: %s", self.error)
            return
        m = self.model
        self.scheduler = BatchScheduler(m, max_batch=self.cfg.max_batch, batch_wait_s=self.cfg.batch_wait_ms / 1000)
        self.scheduler.start()
        self.info = {"model": getattr(m, "name", "model"), "family": getattr(m, "family", "unknown"),
                     "pid": os.getpid(), "device": self.cfg.device,
                     "translates": bool(getattr(m, "translates", False))}
        if self.cfg.gc_freeze:
            gc.collect()
            gc.freeze()  # start-up and warm-up objects leave the GC's scans

    async def wait_ready(self, timeout: float) -> bool:
        if self._task:
            await asyncio.wait_for(asyncio.shield(self._task), timeout)
        return self.ready

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
        if self.scheduler:
            await self.scheduler.stop()

    async def transcribe(self, samples: np.ndarray, *, language=None, word_timestamps=False, priority=OFFLINE,
                         coalesce_key=None, timeout=None, task="transcribe"):
        if self.scheduler is None:
            raise APIError("the model is still loading" if self.error is None else f"model failed: {self.error}",
                           status=503, code="model_not_ready")
        coro = self.scheduler.submit(samples, language=language, word_timestamps=word_timestamps,
                                     priority=priority, coalesce_key=coalesce_key, task=task)
        try:
            return await (asyncio.wait_for(coro, timeout) if timeout else coro)
        except asyncio.TimeoutError:
            raise APIError("transcription timed out", status=504, code="timeout") from None

    async def metrics_text(self) -> bytes:
        return self.scheduler.metrics.text() if self.scheduler else b""


class RemoteBackend:
    """Multi-process mode: transcription runs in the engine process, reached over :class:`EngineClient`."""

    mode = "multi"

    def __init__(self, cfg: ServeConfig, socket_path: str, metrics=None, supervisor=None):
        self.cfg = cfg
        self.client = EngineClient(socket_path, shm_threshold=cfg.shm_threshold_bytes, metrics=metrics)
        self.supervisor = supervisor

    @property
    def ready(self) -> bool:
        return self.client.ready

    @property
    def info(self) -> dict:
        d = dict(self.client.info)
        if self.supervisor is not None:
            d["engine_restarts"] = self.supervisor.restarts
        return d

    error = None

    async def start(self) -> None:
        await self.client.start()

    async def wait_ready(self, timeout: float) -> bool:
        return await self.client.wait_ready(timeout)

    async def stop(self) -> None:
        await self.client.close()

    async def transcribe(self, samples, *, language=None, word_timestamps=False, priority=OFFLINE,
                         coalesce_key=None, timeout=None, task="transcribe"):
        return await self.client.transcribe(samples, language=language, word_timestamps=word_timestamps,
                                            priority=priority, coalesce_key=coalesce_key, timeout=timeout,
                                            task=task)

    async def metrics_text(self) -> bytes:
        return await self.client.stats() if self.client.ready else b""
