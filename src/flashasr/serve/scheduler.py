"""Batching scheduler in front of one model: streaming work first, offline work packed by length.

One asyncio task picks batches; the model runs in one dedicated thread (torch and
CTranslate2 release the GIL while they compute), so the event loop keeps serving
sockets while a batch runs. The model itself is never called from two threads.

Priorities (lower runs first):
  * ``FINAL`` (0): a stream's end-of-utterance transcript (someone waits on it now);
  * ``PARTIAL`` (1): a stream's interim transcript; a newer partial of the same stream
    replaces a queued older one (``coalesce_key``), the older one resolves to ``None``;
  * ``OFFLINE`` (2): the pieces of uploads (:func:`flashasr.pipeline.plan_pieces` cut them in
    the CPU pool), shared fairly among uploads by fair queuing over audio seconds: each piece gets
    a virtual start tag -- the scheduler's virtual time when its upload arrived plus the audio of
    the upload's earlier pieces -- and the piece with the smallest tag (then the oldest) leads the
    next batch; the virtual time then moves to the end of that piece (its tag + its seconds).
    Concurrent uploads thus get equal shares of the model's audio throughput: a short upload
    waits for about one batch in flight, not for a 4-hour upload queued before it, and a long
    upload keeps its share however many short ones arrive (the virtual time passes its next tag,
    where it wins as the older: nothing starves). Single waveforms arriving together go oldest
    first. The batch is the leader plus the pieces of equal options closest to its length
    (little padding; ties in fair order).

Items share a batch only when their options' ``decoding`` (language, task, word timestamps) is
equal; the batch runs through :func:`flashasr.pipeline.transcribe_pieces` (one bad piece fails
alone).

Chunked streaming partials (:meth:`BatchScheduler.submit_chunk`, when a ``streamer`` is given:
:class:`flashasr.models.parakeet.streaming.ParakeetStreamer`) are ``PARTIAL`` items of their own
group: the new audio of many streams, one batched ``streamer.step`` per model call (up to
``stream_batch`` streams), never coalesced away (each carries audio the stream's state needs; a
stream has at most one in flight, its next one carries everything that arrived meanwhile).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ..options import TranscribeOptions
from ..pipeline.run import transcribe_pieces
from .metrics import EngineMetrics

log = logging.getLogger("flashasr.serve")

FINAL, PARTIAL, OFFLINE = 0, 1, 2
KIND = {FINAL: "final", PARTIAL: "partial", OFFLINE: "offline"}


@dataclass
class _Item:
    samples: np.ndarray  # one piece, float32 [n] at the model rate
    options: TranscribeOptions
    priority: int
    key: str | None
    fut: asyncio.Future
    t_enq: float
    seq: int = 0
    tag: float = 0.0  # virtual start time in audio seconds (fair order among uploads; see the module docstring)
    stream: str | None = None  # a chunked streaming partial: the stream's key (its batch is one streamer step)
    stream_new: bool = False   # ... and the first chunk of that stream (its state is created)

    @property
    def group(self) -> tuple:
        return ("stream",) if self.stream is not None else self.options.decoding


class BatchScheduler:
    """Queue + batcher for one :class:`~flashasr.models.base.ASRModel`.

    Args:
        model: the loaded model; ``transcribe_batch`` is used for batches of > 1.
        max_batch: most waveforms per model call.
        batch_wait_s: how long to wait for more offline work before running a partial batch.
        metrics: :class:`EngineMetrics` to update (queue depth, batch sizes, latencies).
        streamer: a :class:`~flashasr.models.parakeet.streaming.ParakeetStreamer` of ``model``
            for :meth:`submit_chunk` (None: chunked partials are refused).
        stream_batch: most streams in one streamer step.
    """

    def __init__(self, model, *, max_batch: int = 8, batch_wait_s: float = 0.002,
                 metrics: EngineMetrics | None = None, streamer=None, stream_batch: int = 256):
        self.model = model
        self.streamer = streamer
        self.stream_batch = max(1, int(stream_batch))
        self.max_batch = max(1, int(max_batch))
        self.batch_wait_s = batch_wait_s
        self.metrics = metrics or EngineMetrics(getattr(model, "device", "cpu"))
        self.sample_rate = int(getattr(model, "sample_rate", 16000))
        self._queues: dict[int, list[_Item]] = {FINAL: [], PARTIAL: [], OFFLINE: []}
        self._partials: dict[str, _Item] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._seq = itertools.count()
        self._vtime = 0.0  # virtual time (audio seconds) of the fair queue of uploads
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

    def _enqueue(self, samples: np.ndarray, options: TranscribeOptions, priority: int,
                 coalesce_key: str | None = None, tag: float | None = None) -> _Item:
        if samples.dtype != np.float32 or samples.ndim != 1:
            samples = np.ascontiguousarray(samples, dtype=np.float32).reshape(-1)
        it = _Item(samples, options, priority, coalesce_key, asyncio.get_running_loop().create_future(),
                   time.perf_counter(), next(self._seq), self._vtime if tag is None else tag)
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
        return it

    def _forget(self, it: _Item) -> None:
        """After its awaiter is gone: drop the coalescing entry, and a not-yet-started item."""
        if it.key is not None and self._partials.get(it.key) is it:
            del self._partials[it.key]
        if not it.fut.done() or it.fut.cancelled():
            try:
                self._queues[it.priority].remove(it)
            except ValueError:
                pass

    async def submit(self, samples: np.ndarray, options: TranscribeOptions | None = None, *,
                     priority: int = OFFLINE, coalesce_key: str | None = None, **changes):
        """Queue one waveform (float32 [N] at the model rate) and wait for its Transcript.

        ``options`` (:class:`~flashasr.options.TranscribeOptions`, ``**changes`` as keywords):
        batched only with items of equal ``options.decoding``.

        Returns ``None`` if a partial was superseded by a newer one of the same ``coalesce_key``.
        Cancelling the awaiting task removes a not-yet-started item from the queue.
        """
        it = self._enqueue(samples, TranscribeOptions.build(options, **changes), priority, coalesce_key)
        self._gauge()
        self._wake.set()
        try:
            return await it.fut
        finally:
            self._forget(it)
            self._gauge()

    async def submit_pieces(self, samples: np.ndarray, pieces, options: TranscribeOptions, *,
                            priority: int = OFFLINE) -> list:
        """Queue the pieces ``samples[a:b]`` of one recording (views, no copy) and wait for all of them.

        Args:
            samples: float32 ``[N]`` at the model rate.
            pieces: ``[(start, end), ...]`` sample ranges (:func:`flashasr.pipeline.plan_pieces`).
            options: the recording's resolved options.
        Returns:
            one Transcript per piece, in order (times relative to each piece).
        Raises:
            the first piece's error (the other pieces are dropped from the queue).
        """
        if samples.dtype != np.float32 or samples.ndim != 1:
            samples = np.ascontiguousarray(samples, dtype=np.float32).reshape(-1)
        items, tag = [], self._vtime  # the upload's pieces follow each other in virtual time
        for a, b in pieces:
            items.append(self._enqueue(samples[a:b], options, priority, tag=tag))
            tag += (b - a) / self.sample_rate
        self._gauge()
        self._wake.set()
        try:
            return list(await asyncio.gather(*(it.fut for it in items)))
        finally:
            for it in items:
                if not it.fut.done():
                    it.fut.cancel()
                self._forget(it)
            self._gauge()

    async def submit_chunk(self, key: str, samples: np.ndarray, options: TranscribeOptions, *, new: bool = False):
        """Queue a stream's new audio (float32 [n]) for the next streamer step (``new``: its first
        chunk); returns its :class:`~flashasr.models.parakeet.streaming.StreamResult`. Raises its
        error (:class:`~flashasr.models.parakeet.streaming.StreamError`: closed or lost stream, no slot)."""
        if self.streamer is None:
            from ..models.parakeet.streaming import StreamError

            raise StreamError("this model has no chunked streaming partials")
        it = self._enqueue(samples, options, PARTIAL)
        it.stream, it.stream_new = key, bool(new)
        self._gauge()
        self._wake.set()
        try:
            return await it.fut
        finally:
            self._forget(it)
            self._gauge()

    def close_stream(self, key: str) -> None:
        """Drop a stream's chunked state, on the model thread after the work already handed to it
        (a chunk still queued was cancelled by its awaiter first)."""
        if self.streamer is not None:
            self._exec.submit(self.streamer.close, key)

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
            # streaming: oldest first; offline: the smallest virtual start tag (fair among uploads)
            anchor = min(q, key=lambda it: (it.tag, it.seq)) if p == OFFLINE else q[0]
            others = [it for it in q if it is not anchor and it.group == anchor.group]
            if p == OFFLINE:  # pack by length: the items closest to the anchor's, ties in fair order
                self._vtime = max(self._vtime, anchor.tag + len(anchor.samples) / self.sample_rate)
                n = len(anchor.samples)
                others.sort(key=lambda it: (abs(len(it.samples) - n), it.tag, it.seq))
            batch = [anchor] + others[: (self.stream_batch if anchor.stream else self.max_batch) - 1]
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

    def _infer(self, batch: list[_Item]) -> list:
        """One model call for the batch (model thread); per item a Transcript (a StreamResult for
        chunked partials) or its exception."""
        if batch[0].stream is not None:
            return self.streamer.step([(it.stream, it.samples, it.stream_new) for it in batch])
        return transcribe_pieces(self.model, [it.samples for it in batch], batch[0].options)

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
