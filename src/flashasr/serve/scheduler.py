"""Batching scheduler in front of one model: streaming work first, offline work packed by length.

One asyncio task picks batches; the model runs in one dedicated thread (torch and
CTranslate2 release the GIL while they compute), so the event loop keeps serving
sockets while a batch runs. The model itself is never called from two threads.

Priorities (lower runs first):
  * ``FINAL`` (0): a stream's end-of-utterance transcript (someone waits on it now);
  * ``PARTIAL`` (1): a stream's interim transcript; a newer partial of the same stream
    replaces a queued older one (``coalesce_key``), the older one resolves to ``None``;
  * ``OFFLINE`` (2): uploads; batched with waveforms of similar length (sorted by
    length, anchored on the oldest waiting item so nothing starves).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from .metrics import EngineMetrics

log = logging.getLogger("flashasr.serve")

FINAL, PARTIAL, OFFLINE = 0, 1, 2
KIND = {FINAL: "final", PARTIAL: "partial", OFFLINE: "offline"}


@dataclass
class _Item:
    samples: np.ndarray
    language: str | None
    word_timestamps: bool
    priority: int
    key: str | None
    fut: asyncio.Future
    t_enq: float
    seq: int = 0
    on_done: object = None
    task: str = "transcribe"

    @property
    def group(self):
        return (self.language, self.word_timestamps, self.task)


class BatchScheduler:
    """Queue + batcher for one :class:`~flashasr.models.base.ASRModel`.

    Args:
        model: the loaded model; ``transcribe_batch`` is used for batches of > 1.
        max_batch: most waveforms per model call.
        batch_wait_s: how long to wait for more offline work before running a partial batch.
        metrics: :class:`EngineMetrics` to update (queue depth, batch sizes, latencies).
    """

    def __init__(self, model, *, max_batch: int = 8, batch_wait_s: float = 0.002,
                 metrics: EngineMetrics | None = None):
        self.model = model
        self.max_batch = max(1, int(max_batch))
        self.batch_wait_s = batch_wait_s
        self.metrics = metrics or EngineMetrics(getattr(model, "device", "cpu"))
        self.sample_rate = int(getattr(model, "sample_rate", 16000))
        self._queues: dict[int, list[_Item]] = {FINAL: [], PARTIAL: [], OFFLINE: []}
        self._partials: dict[str, _Item] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._seq = itertools.count()
        # one thread owns the model: no per-request threads, ever
        self._exec = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flashasr-model")
        self._exec.submit(lambda: None).result()  # start the thread now (constant thread count)
        self.busy = False

    # ------------------------------------------------------------------ public
    def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="flashasr-scheduler")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        for q in self._queues.values():
            for it in q:
                if not it.fut.done():
                    it.fut.cancel()
            q.clear()
        self._exec.shutdown(wait=False, cancel_futures=True)

    def depth(self) -> int:
        return sum(len(q) for q in self._queues.values())

    async def submit(self, samples: np.ndarray, *, language: str | None = None, word_timestamps: bool = False,
                     priority: int = OFFLINE, coalesce_key: str | None = None, task: str = "transcribe"):
        """Queue one waveform (float32 [N] at the model rate) and wait for its Transcript.

        ``task``: "transcribe" or "translate" (batched only with items of the same language,
        word-timestamp setting and task).

        Returns ``None`` if a partial was superseded by a newer one of the same ``coalesce_key``.
        Cancelling the awaiting task removes a not-yet-started item from the queue.
        """
        if samples.dtype != np.float32 or samples.ndim != 1:
            samples = np.ascontiguousarray(samples, dtype=np.float32).reshape(-1)
        loop = asyncio.get_running_loop()
        it = _Item(samples, language, bool(word_timestamps), priority, coalesce_key, loop.create_future(),
                   time.perf_counter(), next(self._seq), task=task)
        if priority == PARTIAL and coalesce_key is not None:
            old = self._partials.pop(coalesce_key, None)
            if old is not None and not old.fut.done():
                try:
                    self._queues[PARTIAL].remove(old)
                except ValueError:
                    pass
                old.fut.set_result(None)
            self._partials[coalesce_key] = it
        self._queues[priority].append(it)
        self._gauge()
        self._wake.set()
        try:
            return await it.fut
        finally:
            if it.key is not None and self._partials.get(it.key) is it:
                del self._partials[it.key]
            if not it.fut.done() or it.fut.cancelled():
                try:
                    self._queues[priority].remove(it)
                except ValueError:
                    pass
                self._gauge()

    # ---------------------------------------------------------------- internal
    def _gauge(self) -> None:
        for p, q in self._queues.items():
            self.metrics.queue_depth.labels(KIND[p]).set(len(q))

    def _pick(self) -> list[_Item]:
        for p in (FINAL, PARTIAL, OFFLINE):
            q = [it for it in self._queues[p] if not it.fut.done()]
            self._queues[p] = q
            if not q:
                continue
            anchor = q[0]  # oldest first: nothing starves
            same = [it for it in q if it.group == anchor.group]
            if p == OFFLINE and len(same) > 1:
                # pack by length: the anchor plus the items closest to its length
                n = len(anchor.samples)
                same.sort(key=lambda it: abs(len(it.samples) - n))
            batch = same[: self.max_batch]
            chosen = set(id(it) for it in batch)
            self._queues[p] = [it for it in q if id(it) not in chosen]
            if p == FINAL and len(batch) < self.max_batch:  # streaming work shares the batch: partials fill it
                pq = [it for it in self._queues[PARTIAL] if not it.fut.done()]
                extra = [it for it in pq if it.group == anchor.group][: self.max_batch - len(batch)]
                taken = set(id(it) for it in extra)
                self._queues[PARTIAL] = [it for it in pq if id(it) not in taken]
                batch += extra
            for it in batch:
                if it.key is not None and self._partials.get(it.key) is it:
                    del self._partials[it.key]
            return batch
        return []

    def _infer(self, batch: list[_Item]):
        wavs = [it.samples for it in batch]
        lang, wt, task = batch[0].group
        kw = {"task": task} if task != "transcribe" else {}  # models without a task argument still work
        if len(wavs) == 1:
            return [self.model.transcribe_waveform(wavs[0], language=lang, word_timestamps=wt, **kw)]
        try:
            return self.model.transcribe_batch(wavs, language=lang, word_timestamps=wt, **kw)
        except Exception:
            # isolate the failing input: one bad waveform must not fail its batch mates
            out = []
            for w in wavs:
                try:
                    out.append(self.model.transcribe_waveform(w, language=lang, word_timestamps=wt, **kw))
                except Exception as e:  # noqa: BLE001
                    out.append(e)
            return out

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while True:
                if not self._queues[FINAL] and not self._queues[PARTIAL] and \
                        0 < len(self._queues[OFFLINE]) < self.max_batch and self.batch_wait_s > 0:
                    await asyncio.sleep(self.batch_wait_s)  # let concurrent uploads join the batch
                batch = self._pick()
                self._gauge()
                if not batch:
                    break
                t0 = time.perf_counter()
                kind = KIND[batch[0].priority]
                for it in batch:
                    self.metrics.stage.labels("queue").observe(t0 - it.t_enq)
                self.metrics.batch_size.labels(kind).observe(len(batch))
                self.busy = True
                try:
                    results = await loop.run_in_executor(self._exec, self._infer, batch)
                except Exception as e:  # noqa: BLE001
                    results = [e] * len(batch)
                finally:
                    self.busy = False
                dt = time.perf_counter() - t0
                self.metrics.stage.labels("inference").observe(dt)
                for it in batch:  # a final batch may carry partials too: count each under its own kind
                    self.metrics.audio_seconds.labels(KIND[it.priority]).inc(len(it.samples) / self.sample_rate)
                for it, r in zip(batch, results):
                    if it.fut.done():
                        continue
                    if isinstance(r, BaseException):
                        it.fut.set_exception(r)
                    else:
                        it.fut.set_result(r)
