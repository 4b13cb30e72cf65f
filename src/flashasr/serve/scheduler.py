"""Batching scheduler in front of one model: streaming work first, offline work packed by length.

One asyncio task picks batches; the model runs in one dedicated thread (torch and
CTranslate2 release the GIL while they compute), so the event loop keeps serving
sockets while a batch runs. The model itself is never called from two threads.

Priorities (lower runs first):
  * ``FINAL`` (0): a stream's end-of-utterance transcript (someone waits on it now). While partial
    work is queued, finals gather for up to ``final_wait_s`` (or until ``max_batch`` of them wait)
    and the partials run meanwhile: with streams' finals arriving one by one, strict priority ran a
    final call for every few of them, back to back (2,000 streams at a 1 s cadence on the H200: 580
    final calls of 6.9 utterances in 20 s, 41 % of the engine's time, and the partials fell
    seconds behind; ``stream_scale_h200_scale1000_profile.json``). While chunked partials are late
    (the oldest queued one has waited ``PARTIALS_LATE_S``), finals gather for up to
    ``final_wait_max_s`` instead: a final call costs about 11 ms + 0.75 ms per utterance on an H100,
    so near saturation small final batches take the engine from the partials, which then fall
    seconds behind (``bench/bench_scheduler_sim.py``, ``scheduler_sim_vm_cost*.json``: 2,000 streams,
    p95 partial 97-101 -> 84-90 ms at the H100's measured costs, 490-665 -> 146 ms with the device
    1.3x slower, where time to final went 98-99 -> 128-133 ms). With nothing else queued a final
    runs at once;
  * ``PARTIAL`` (1): a stream's interim transcript; a newer partial of the same stream
    replaces a queued older one (``coalesce_key``), the older one resolves to ``None``;
  * ``OFFLINE`` (2): the pieces of uploads (:func:`flashasr.pipeline.plan_pieces` cut them in
    the CPU pool), in two classes:

    - *short requests* -- an upload (or waveform) of at most ``short_s`` seconds of audio (30 s:
      one window) -- go first, oldest first: a short request waits for the model call running
      and the short ones before it, never for the pieces of the long uploads in flight (with six
      90 s uploads in flight a 3 s upload waited 9.8 s on the 2-core VM, one piece of each);
    - *bulk*: the pieces of longer uploads, shared fairly among them by fair queuing over audio
      seconds: each piece gets a virtual start tag -- the scheduler's virtual time when its upload
      arrived plus the audio of the upload's earlier pieces -- and the piece with the smallest tag
      (then the oldest) leads the next batch; the virtual time then moves to the end of what that
      batch covered. Concurrent uploads thus get equal shares of the model's audio throughput,
      and a long upload keeps its share however many others arrive (the virtual time passes its
      next tag, where it wins as the older: nothing starves).

    Under a flood of short requests bulk work still gets one model call in every
    ``BULK_EVERY + 1`` (it never starves). A batch of short requests is the oldest one plus the
    short ones of equal options closest to its length, its free rows filled with bulk pieces no
    longer than its longest piece (no later answer); a bulk batch is its leader plus the pieces of
    equal options closest to its length (little padding; ties in fair order).

Items share a batch only when their options' ``decoding`` (language, task, word timestamps) is
equal. Streaming batches run through :func:`flashasr.pipeline.transcribe_pieces` in one model
call (one bad piece fails alone). An offline batch runs *in steps*
(:meth:`~flashasr.models.base.ASRModel.start_batch`: Whisper's steps are its rounds of windows,
one encoder and decoder pass each), one step per model call: between two steps the scheduler looks
at its queues again, so a streaming final or partial that arrives waits for at most the one step
running, never for a whole upload (an upload with ``segmentation=none`` is one piece of any length:
its seek loop runs one window per step). A started batch stays in the fair queue with its tag moved
on by the audio its step covered, so a short upload that arrives meanwhile goes before the rest of
a long one. A batch whose step raises is redone piece by piece (one bad piece fails alone).

Chunked streaming partials (:meth:`BatchScheduler.submit_chunk`, when a ``streamer`` is given:
:class:`flashasr.models.parakeet.streaming.ParakeetStreamer`) are ``PARTIAL`` items of their own
group: the new audio of many streams, one batched ``streamer.step`` per model call (up to
``stream_batch`` streams), never coalesced away (each carries audio the stream's state needs; a
stream has at most one in flight, its next one carries everything that arrived meanwhile).

With ``finals_with_chunks`` a due final batch and the queued chunks share one model call: the
finals' device work is queued first (:func:`~flashasr.pipeline.run.start_pieces`: on the GPU
engine its encoders on the model thread's stream, its decoder on a side stream), then the
streamer's step runs (its host work while the finals' encoders run; its graph on the same stream
after them, beside the finals' decoder), while a second thread reads the finals and answers them
the moment they are done, not after the step. A model without queued device work (no
``submit_batch``: the CPU) keeps finals in calls of their own (shared, a final would only wait for
the step).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as _wait_futures
from dataclasses import dataclass

import numpy as np

from ..options import TranscribeOptions
from ..pipeline.run import speech_kw, start_pieces, transcribe_pieces
from .metrics import EngineMetrics

log = logging.getLogger("flashasr.serve")

FINAL, PARTIAL, OFFLINE = 0, 1, 2
KIND = {FINAL: "final", PARTIAL: "partial", OFFLINE: "offline"}
SHORT_S = 30.0  # a request of at most this much audio is short: it goes before bulk pieces
BULK_EVERY = 3  # bulk work waiting gets a model call after at most this many short-request calls


@dataclass(slots=True)
class _Item:
    samples: np.ndarray  # one piece, float32 [n] at the model rate
    options: TranscribeOptions
    priority: int
    key: str | None
    fut: asyncio.Future
    t_enq: float
    seq: int = 0
    tag: float = 0.0  # virtual start time in audio seconds (fair order among uploads; see the module docstring)
    speech: tuple | None = None  # the piece's VAD speech spans (Piece.speech), when known
    short: bool = False  # a piece of a short request (see the module docstring)
    stream: str | None = None  # a chunked streaming partial: the stream's key (its batch is one streamer step)
    stream_new: bool = False   # ... and the first chunk of that stream (its state is created)
    group: tuple = ()  # items share a model call only within a group: options.decoding, or STREAM_GROUP


STREAM_GROUP = ("stream",)  # the group of chunked partials (one streamer step)
# queued chunked partials this old are late (the partial target is 100 ms): finals then gather for up
# to final_wait_max_s (see the module docstring)
PARTIALS_LATE_S = 0.080


@dataclass
class _Run:
    """An offline batch in steps: its items, the model's :class:`~flashasr.models.base.BatchRun`
    (made at the first step, on the model thread) and its place in the fair queue."""

    items: list[_Item]
    tag: float
    seq: int
    run: object = None
    steps: int = 0
    short: bool = False  # a batch of short requests (led by one)

    @property
    def live(self) -> bool:
        return any(not it.fut.done() for it in self.items)


def _take_group(q: list[_Item], group: tuple, room: int) -> list[_Item]:
    """The first ``room`` items of ``group`` in ``q``, in order; removed from ``q`` (in place)."""
    taken, rest = [], []
    for it in q:
        if it.group == group and len(taken) < room:
            taken.append(it)
        else:
            rest.append(it)
    q[:] = rest
    return taken


def _timed(fn, work):
    """``fn(work)`` on the model thread, with its start and end (``time.perf_counter``)."""
    t1 = time.perf_counter()
    r = fn(work)
    return r, t1, time.perf_counter()


class BatchScheduler:
    """Queue + batcher for one :class:`~flashasr.models.base.ASRModel`.

    Args:
        model: the loaded model; ``transcribe_batch`` is used for batches of > 1.
        max_batch: most waveforms per model call.
        short_s: requests of at most this many seconds of audio are short (see the module docstring).
        batch_wait_s: how long to wait for more offline work before running a partial batch.
        metrics: :class:`EngineMetrics` to update (queue depth, batch sizes, latencies).
        streamer: a :class:`~flashasr.models.parakeet.streaming.ParakeetStreamer` of ``model``
            for :meth:`submit_chunk` (None: chunked partials are refused).
        stream_batch: most streams in one streamer step.
        final_wait_max_s: longest a final waits for more finals while queued chunked partials are
            late (the oldest has waited :data:`PARTIALS_LATE_S`, and longer than ``partial_wait_s``);
            off when not larger than ``final_wait_s`` or when ``final_wait_s`` is 0 (see the module
            docstring).
        final_wait_s: longest a final waits for more finals while partial work is queued (0: finals
            always first; see the module docstring).
        partial_wait_s: longest queued chunked partials wait for more streams' chunks before a
            streamer step with fewer than ``stream_batch`` rows runs, when no other work is runnable
            (0: a step runs as soon as the model is free). A step's cost grows slowly with its rows
            (H200: 64 rows 12.4 ms, 256 rows 35.4 ms), so under load gathering trades a few ms of
            latency for several times the rows per step.
        switch_interval_s: the interpreter's GIL switch interval while the scheduler runs (restored
            by :meth:`stop`; None: CPython's 5 ms left alone). The model thread comes back from
            every CUDA wait needing the GIL while the event loop runs Python; at 5 ms it can wait
            that long each time (a job's model thread: 3,400x at 0.5 ms against 2,838x at 5 ms,
            :data:`flashasr.jobs.runner.JOB_SWITCH_INTERVAL_S`).
        finals_with_chunks: a due final batch shares its model call with the queued chunked
            partials (see the module docstring); the finals are answered when they are done.
    """

    def __init__(self, model, *, max_batch: int = 8, batch_wait_s: float = 0.002,
                 metrics: EngineMetrics | None = None, short_s: float = SHORT_S, streamer=None,
                 stream_batch: int = 256, final_wait_s: float = 0.0, partial_wait_s: float = 0.0,
                 switch_interval_s: float | None = None, finals_with_chunks: bool = False,
                 final_wait_max_s: float = 0.0):
        self.model = model
        self.streamer = streamer
        self.stream_batch = max(1, int(stream_batch))
        self.max_batch = max(1, int(max_batch))
        self.short_s = float(short_s)
        self._shorts_in_a_row = 0  # short-request calls since bulk work last had one
        self.batch_wait_s = batch_wait_s
        self.final_wait_s = max(0.0, float(final_wait_s))
        # (final_wait_s 0 keeps finals strictly first: the longer wait is off then too)
        self.final_wait_max_s = max(self.final_wait_s, float(final_wait_max_s)) if self.final_wait_s > 0 else 0.0
        self.partial_wait_s = max(0.0, float(partial_wait_s))
        self.switch_interval_s = switch_interval_s if switch_interval_s and switch_interval_s > 0 else None
        self._switch_before: float | None = None
        self.metrics = metrics or EngineMetrics(getattr(model, "device", "cpu"))
        if streamer is not None:
            self.metrics.watch_streamer(streamer)
        m, kinds = self.metrics, (FINAL, PARTIAL, OFFLINE)  # labelled children looked up once, not per item
        self._batch_size = {p: m.batch_size.labels(KIND[p]) for p in kinds}
        self._inference = {p: m.inference.labels(KIND[p]) for p in kinds}
        self._audio_s = {p: m.audio_seconds.labels(KIND[p]) for p in kinds}
        self._stage = {k: m.stage.labels(k) for k in ("queue", "inference", "handoff")}
        self.sample_rate = int(getattr(model, "sample_rate", 16000))
        self._queues: dict[int, list[_Item]] = {FINAL: [], PARTIAL: [], OFFLINE: []}
        for p in kinds:  # the queue depths are read when the metrics are (no gauge update per item)
            m.queue_depth.labels(KIND[p]).set_function(lambda q=self._queues, p=p: len(q[p]))
        self._runs: list[_Run] = []  # offline batches started and not finished
        self._partials: dict[str, _Item] = {}
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # start()'s (get_running_loop per item costs a getpid on 3.11)
        self._holding = False  # partials are gathering (_run): a chunk wakes it only when it fills a step
        self._task: asyncio.Task | None = None
        self._seq = itertools.count()
        self._vtime = 0.0  # virtual time (audio seconds) of the fair queue of uploads
        # one thread owns the model: no per-request threads, ever
        self._exec = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flashasr-model")
        self._exec.submit(lambda: None).result()  # start the thread now (constant thread count)
        self._inflight: Future | None = None  # the model call handed to the thread last
        self.busy = False
        # only where the finals' device work can be queued (start_pieces: a model with submit_batch): on the
        # CPU a shared call runs the finals, then the step, and the next final waits for that step (a trial: 40
        # streams on the dev VM, final p95 1.2-2.1 s -> 3.3-4.3 s)
        self.finals_with_chunks = (bool(finals_with_chunks) and streamer is not None
                                   and hasattr(model, "submit_batch"))
        # reads the finals of a shared call while the model thread runs the step (one thread, made once)
        self._finals_exec = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flashasr-finals") \
            if self.finals_with_chunks else None
        if self._finals_exec is not None:
            self._finals_exec.submit(lambda: None).result()

    # ------------------------------------------------------------------ public
    def start(self) -> None:
        if self.switch_interval_s is not None:
            self._switch_before = sys.getswitchinterval()
            sys.setswitchinterval(self.switch_interval_s)
        self._wake = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self._run(), name="flashasr-scheduler")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        for q in [*self._queues.values(), *(r.items for r in self._runs)]:
            for it in q:
                if not it.fut.done():
                    it.fut.cancel()
            q.clear()
        self._runs.clear()
        self._exec.shutdown(wait=False, cancel_futures=True)
        if self._finals_exec is not None:
            self._finals_exec.shutdown(wait=False, cancel_futures=True)
        if self._switch_before is not None:
            sys.setswitchinterval(self._switch_before)
            self._switch_before = None

    def fail_all(self, make_error) -> int:
        """Fail every item queued or in a started batch with a new ``make_error()`` each (the server
        is stopping); a model call running now still ends, its results are dropped. Returns the
        number of items failed."""
        n = 0
        for q in [*self._queues.values(), *(r.items for r in self._runs)]:
            for it in q:
                if not it.fut.done():
                    it.fut.set_exception(make_error())
                    n += 1
        if self._wake is not None:
            self._wake.set()  # the queues drop done items at the next pick
        return n

    def wait_idle(self, timeout: float) -> bool:
        """Block up to ``timeout`` s until the model call handed to the model thread last has ended
        (any thread; for the exit of a stopped server); whether it has."""
        f = self._inflight
        return f is None or f.done() or not _wait_futures([f], timeout).not_done

    def depth(self) -> int:
        return sum(len(q) for q in self._queues.values()) + sum(len(r.items) for r in self._runs)

    def _enqueue(self, samples: np.ndarray, options: TranscribeOptions, priority: int,
                 coalesce_key: str | None = None, tag: float | None = None, speech=None,
                 request_s: float | None = None) -> _Item:
        if samples.dtype != np.float32 or samples.ndim != 1:
            samples = np.ascontiguousarray(samples, dtype=np.float32).reshape(-1)
        if request_s is None:
            request_s = samples.size / self.sample_rate
        it = _Item(samples, options, priority, coalesce_key, (self._loop or asyncio.get_running_loop()).create_future(),
                   time.perf_counter(), next(self._seq), self._vtime if tag is None else tag, speech,
                   short=request_s <= self.short_s, group=options.decoding)
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

    def _forget(self, it: _Item) -> bool:
        """After its awaiter is gone: drop the coalescing entry, and a not-yet-started item (True:
        it was still queued)."""
        if it.key is not None and self._partials.get(it.key) is it:
            del self._partials[it.key]
        if not it.fut.done() or it.fut.cancelled():
            try:
                self._queues[it.priority].remove(it)
                return True
            except ValueError:
                pass
        return False

    async def submit(self, samples: np.ndarray, options: TranscribeOptions | None = None, *,
                     priority: int = OFFLINE, coalesce_key: str | None = None, speech=None, **changes):
        """Queue one waveform (float32 [N] at the model rate) and wait for its Transcript.

        ``options`` (:class:`~flashasr.options.TranscribeOptions`, ``**changes`` as keywords):
        batched only with items of equal ``options.decoding``. ``speech``: its VAD speech spans
        (sample ranges) when known.

        Returns ``None`` if a partial was superseded by a newer one of the same ``coalesce_key``.
        Cancelling the awaiting task removes a not-yet-started item from the queue.
        """
        it = self._enqueue(samples, TranscribeOptions.build(options, **changes), priority, coalesce_key,
                           speech=speech)
        self._wake.set()
        try:
            return await it.fut
        finally:
            self._forget(it)

    async def submit_pieces(self, samples: np.ndarray, pieces, options: TranscribeOptions, *,
                            priority: int = OFFLINE) -> list:
        """Queue the pieces ``samples[a:b]`` of one recording (views, no copy) and wait for all of them.

        Args:
            samples: float32 ``[N]`` at the model rate.
            pieces: ``[(start, end), ...]`` sample ranges (:func:`flashasr.pipeline.plan_pieces`;
                a :class:`~flashasr.pipeline.plan.Piece` brings its speech spans along).
            options: the recording's resolved options.
        Returns:
            one Transcript per piece, in order (times relative to each piece).
        Raises:
            the first piece's error (the other pieces are dropped from the queue).
        """
        if samples.dtype != np.float32 or samples.ndim != 1:
            samples = np.ascontiguousarray(samples, dtype=np.float32).reshape(-1)
        items, tag = [], self._vtime  # the upload's pieces follow each other in virtual time
        pieces = list(pieces)
        total = sum(b - a for a, b in pieces) / self.sample_rate  # the request's audio
        for p in pieces:
            a, b = p
            items.append(self._enqueue(samples[a:b], options, priority, tag=tag, speech=getattr(p, "speech", None),
                                       request_s=total))
            tag += (b - a) / self.sample_rate
        self._wake.set()
        try:
            return list(await asyncio.gather(*(it.fut for it in items)))
        finally:
            for it in items:
                if not it.fut.done():
                    it.fut.cancel()
                self._forget(it)

    async def submit_chunk(self, key: str, samples: np.ndarray, options: TranscribeOptions, *, new: bool = False):
        """Queue a stream's new audio (float32 [n]) for the next streamer step (``new``: its first
        chunk); returns its :class:`~flashasr.models.parakeet.streaming.StreamResult`. Raises its
        error (:class:`~flashasr.models.parakeet.streaming.StreamError`: closed or lost stream, no slot)."""
        it = self.queue_chunk(key, samples, options, new=new)
        try:
            return await it.fut
        finally:
            self._forget(it)

    def queue_chunk(self, key: str, samples: np.ndarray, options: TranscribeOptions, *, new: bool = False) -> _Item:
        """:meth:`submit_chunk` without a coroutine: the queued item, whose ``fut`` gets the
        StreamResult or the error; the caller owns it (:meth:`drop` it when its requester goes away).
        The engine process queues every stream chunk this way, from its receive loop, with a
        callback on ``fut`` for the reply: no task per chunk (at thousands of streams the event
        loop's work per chunk takes the GIL from the model thread's steps).

        While partials gather (``partial_wait_s``) a chunk wakes the scheduler only when it fills a
        step; other work wakes it at once.

        Raises:
            StreamError: the model has no chunked streaming partials.
        """
        if self.streamer is None:
            from ..models.parakeet.streaming import StreamError

            raise StreamError("this model has no chunked streaming partials")
        it = self._enqueue(samples, options, PARTIAL)
        it.stream, it.stream_new, it.group = key, bool(new), STREAM_GROUP
        if not self._holding or len(self._queues[PARTIAL]) >= self.stream_batch:
            self._wake.set()
        return it

    def drop(self, it: _Item) -> None:
        """Cancel a queued item whose requester went away (no reply will be sent): it leaves the
        queue; one already in a model call is cancelled and its result dropped."""
        it.fut.cancel()
        self._forget(it)

    def close_stream(self, key: str) -> None:
        """Drop a stream's chunked state, on the model thread after the work already handed to it
        (a chunk still queued was cancelled by its awaiter first)."""
        if self.streamer is not None:
            self._exec.submit(self.streamer.close, key)

    # ---------------------------------------------------------------- internal
    def _pick(self) -> tuple[str, object]:
        """The next model call: ``("batch", items)`` of streaming work (or ``("none", None)``), or
        ``("run", _Run)``: one step of an offline batch -- a started one or a new batch of queued
        pieces: short requests first (oldest first), then bulk in fair order (see the module
        docstring)."""
        finals = self._queues[FINAL] = [it for it in self._queues[FINAL] if not it.fut.done()]
        partials = self._queues[PARTIAL] = [it for it in self._queues[PARTIAL] if not it.fut.done()]
        if finals and (not partials or self._final_due(finals, partials)):
            fb = self._take_streaming(FINAL, finals)
            pq = self._queues[PARTIAL]  # what the finals' batch left (it takes no chunks: another group)
            if self.finals_with_chunks and pq and pq[0].stream is not None:
                return "pair", (fb, self._take_streaming(PARTIAL, pq))
            return "batch", fb
        if partials:
            return "batch", self._take_streaming(PARTIAL, partials)
        q = [it for it in self._queues[OFFLINE] if not it.fut.done()]
        self._queues[OFFLINE] = q
        self._runs = [r for r in self._runs if r.live]
        short_runs = [r for r in self._runs if r.short]
        bulk_runs = [r for r in self._runs if not r.short]
        shorts = [it for it in q if it.short]
        bulk = [it for it in q if not it.short]
        bulk_waits = bool(bulk or bulk_runs)
        if (short_runs or shorts) and not (bulk_waits and self._shorts_in_a_row >= BULK_EVERY):
            self._shorts_in_a_row = self._shorts_in_a_row + 1 if bulk_waits else 0
            if short_runs:
                return "run", min(short_runs, key=lambda r: r.seq)
            return "run", self._new_run(min(shorts, key=lambda it: it.seq), q, short=True)
        self._shorts_in_a_row = 0
        run = min(bulk_runs, key=lambda r: (r.tag, r.seq), default=None)
        anchor = min(bulk, key=lambda it: (it.tag, it.seq), default=None)
        if anchor is None or (run is not None and (run.tag, run.seq) <= (anchor.tag, anchor.seq)):
            return ("run", run) if run is not None else ("none", None)
        return "run", self._new_run(anchor, q, short=False)

    def _hold(self) -> float:
        """Seconds to let chunked partials gather before the next pick (``partial_wait_s``): 0 unless
        the only runnable work is fewer than ``stream_batch`` chunks younger than the wait (and finals
        not due yet)."""
        if self.partial_wait_s <= 0 or self._runs or any(not it.fut.done() for it in self._queues[OFFLINE]):
            return 0.0
        partials = [it for it in self._queues[PARTIAL] if not it.fut.done()]
        if not partials or len(partials) >= self.stream_batch or any(it.stream is None for it in partials):
            return 0.0
        now = time.perf_counter()
        wait = partials[0].t_enq + self.partial_wait_s - now
        finals = [it for it in self._queues[FINAL] if not it.fut.done()]
        if finals:
            if self._final_due(finals, partials):
                return 0.0
            wait = min(wait, finals[0].t_enq + self._final_wait(partials, now) - now)
        return max(0.0, wait)

    def _final_wait(self, partials: list[_Item], now: float) -> float:
        """How long finals may gather now: ``final_wait_max_s`` while the oldest queued chunked
        partial has waited :data:`PARTIALS_LATE_S` or more (and longer than ``partial_wait_s``:
        chunks the scheduler holds on purpose are not late), else ``final_wait_s``."""
        late = (partials and partials[0].stream is not None
                and now - partials[0].t_enq >= max(PARTIALS_LATE_S, self.partial_wait_s))
        return self.final_wait_max_s if late else self.final_wait_s

    def _final_due(self, finals: list[_Item], partials: list[_Item]) -> bool:
        """Finals run before queued partial work once the oldest has waited :meth:`_final_wait` or a
        full batch of them waits (see the module docstring)."""
        now = time.perf_counter()
        return len(finals) >= self.max_batch or now - finals[0].t_enq >= self._final_wait(partials, now)

    def _new_run(self, anchor: _Item, q: list[_Item], short: bool) -> _Run:
        """A new offline batch led by ``anchor``: a short request's takes the other short ones
        closest to its length (then the oldest), then bulk pieces no longer than its longest piece;
        a bulk one the pieces closest to the anchor's length (ties in fair order). All of equal
        options."""
        g = anchor.group
        same = [it for it in q if it is not anchor and it.group == g]
        n = len(anchor.samples)
        if short:
            batch = [anchor] + sorted((it for it in same if it.short),
                                      key=lambda it: (abs(len(it.samples) - n), it.seq))[: self.max_batch - 1]
            longest = max(len(it.samples) for it in batch)
            fill = sorted((it for it in same if not it.short and len(it.samples) <= longest),
                          key=lambda it: (abs(len(it.samples) - n), it.tag, it.seq))
            batch += fill[: self.max_batch - len(batch)]
        else:
            others = sorted((it for it in same if not it.short), key=lambda it: (abs(len(it.samples) - n), it.tag, it.seq))
            batch = [anchor] + others[: self.max_batch - 1]
        chosen = set(id(it) for it in batch)
        self._queues[OFFLINE] = [it for it in q if id(it) not in chosen]
        run = _Run(batch, anchor.tag, anchor.seq, short=short)
        self._runs.append(run)
        return run

    def _take_streaming(self, p: int, q: list[_Item]) -> list[_Item]:
        """A batch of finals (filled up with partials) or of partials: oldest first (chunked
        partials: up to ``stream_batch`` streams in one streamer step). One pass over the queue."""
        g = q[0].group
        batch = _take_group(q, g, self.stream_batch if q[0].stream else self.max_batch)
        self._queues[p] = q
        if p == FINAL and len(batch) < self.max_batch:  # streaming work shares the batch: partials fill it
            pq = [it for it in self._queues[PARTIAL] if not it.fut.done()]
            batch += _take_group(pq, g, self.max_batch - len(batch))
            self._queues[PARTIAL] = pq
        for it in batch:
            if it.key is not None and self._partials.get(it.key) is it:
                del self._partials[it.key]
        return batch

    def _infer(self, batch: list[_Item]) -> list:
        """One model call for the batch (model thread); per item a Transcript (a StreamResult for
        chunked partials) or its exception."""
        if batch[0].stream is not None:
            return self.streamer.step([(it.stream, it.samples, it.stream_new) for it in batch])
        return transcribe_pieces(self.model, [it.samples for it in batch], batch[0].options,
                                 [it.speech for it in batch])

    def _infer_pair(self, work: tuple[list[_Item], list[_Item]]) -> tuple[list, float]:
        """A final batch and a chunk step in one model call (model thread; see the module docstring):
        the chunks' results, and the seconds until the finals were answered (they are posted to the
        event loop by :meth:`_deliver` as soon as they are read)."""
        finals, chunks = work
        t1 = time.perf_counter()
        try:
            started = start_pieces(self.model, [it.samples for it in finals], finals[0].options,
                                   [it.speech for it in finals])
        except Exception as e:  # noqa: BLE001 - answered to the finals alone
            started = e

        def read() -> float:
            if isinstance(started, BaseException):
                res = [started] * len(finals)
            else:
                try:
                    res = started.result()
                except Exception as e:  # noqa: BLE001
                    res = [e] * len(finals)
            dt = time.perf_counter() - t1
            self._loop.call_soon_threadsafe(self._deliver, finals, res)
            return dt

        on_device = not isinstance(started, BaseException) and started.on_device
        reading = self._finals_exec.submit(read) if on_device else None
        dt_final = read() if reading is None else 0.0  # ran at once (failed, or redone): answered before the step
        try:
            out = self._infer(chunks)
        except Exception as e:  # noqa: BLE001
            out = [e] * len(chunks)
        if reading is not None:
            dt_final = reading.result()  # the finals are read before the next call reuses the engine
        return out, dt_final

    def _step(self, run: _Run) -> list | None:
        """One step of an offline batch (model thread): its results when it is done, else None. A
        batch that cannot start or whose step raises is redone piece by piece (one call)."""
        items = run.items
        try:
            if run.run is None:
                run.run = self.model.start_batch([it.samples for it in items], items[0].options,
                                                 **speech_kw(self.model, [it.speech for it in items]))
            run.steps += 1
            if not run.run.step():
                return None
            return list(run.run.results())
        except Exception:  # noqa: BLE001 - each piece alone says whose fault it is
            run.run = None
            return self._infer(items)

    async def _call(self, kind: str, work) -> tuple[list[_Item], list | None]:
        """Run one model call in the model thread: (its items, per item a result; None: a step of
        an offline batch that is not done yet)."""
        loop = asyncio.get_running_loop()
        items = work if kind == "batch" else work[0] + work[1] if kind == "pair" else work.items
        t0 = time.perf_counter()
        if kind != "run" or work.steps == 0:
            for it in items:
                self._stage["queue"].observe(t0 - it.t_enq)
        for part in (work if kind == "pair" else (items,)):
            self._batch_size[part[0].priority].observe(len(part))
        self.busy = True
        t1 = t2 = None
        fn = {"batch": self._infer, "run": self._step, "pair": self._infer_pair}[kind]
        dt_final = None
        try:
            self._inflight = self._exec.submit(_timed, fn, work)
            results, t1, t2 = await asyncio.wrap_future(self._inflight, loop=loop)
            if kind == "pair":  # the finals were answered already (_deliver): the chunks are left
                (results, dt_final), items = results, work[1]
        except Exception as e:  # noqa: BLE001
            results = [e] * len(items)  # (finals answered already are skipped by _deliver)
        finally:
            self.busy = False
        t3 = time.perf_counter()
        if t1 is None:
            t1 = t2 = t3
        dt = t2 - t1  # the call on the model thread
        self._stage["inference"].observe(dt)
        self._stage["handoff"].observe((t1 - t0) + (t3 - t2))  # waiting for the threads' handovers
        if kind == "pair":  # the call's time: the finals' part until they were read, the step's the rest
            if dt_final is not None:
                self._inference[FINAL].observe(min(dt, dt_final))
            self._inference[PARTIAL].observe(max(0.0, dt - (dt_final or 0.0)))
        else:
            self._inference[items[0].priority].observe(dt)
        if kind == "run":
            self._stepped(work, getattr(work.run, "audio_s", None), done=results is not None)
            if results is None:
                return items, None
        return items, results

    def _stepped(self, run: _Run, covered: float | None, done: bool) -> None:
        """After a step of ``run``: it moves on in the fair queue by the audio its step covered per
        item (``covered`` None: all of its items' audio), the virtual time with it; a finished run
        leaves the queue."""
        if covered is None:
            covered = sum(len(it.samples) for it in run.items) / self.sample_rate
        run.tag += max(covered / max(1, len(run.items)), 1e-6)
        if not run.short:  # short requests are outside the fair queue of bulk work
            self._vtime = max(self._vtime, run.tag)
        if done:
            self._runs = [r for r in self._runs if r is not run]

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while True:
                if not self._queues[FINAL] and not self._queues[PARTIAL] and not self._runs and \
                        0 < len(self._queues[OFFLINE]) < self.max_batch and self.batch_wait_s > 0:
                    await asyncio.sleep(self.batch_wait_s)  # let concurrent uploads join the batch
                hold = self._hold()
                if hold > 0:  # let more streams' chunks join the step; other work or a full step ends the wait
                    self._wake.clear()
                    self._holding = True
                    timer = asyncio.get_running_loop().call_later(hold, self._wake.set)
                    try:
                        await self._wake.wait()
                    finally:
                        self._holding = False
                        timer.cancel()
                    continue  # look again: a final, an upload or a full step runs now
                kind, work = self._pick()
                if kind == "none":
                    break
                items, results = await self._call(kind, work)
                if results is not None:
                    self._deliver(items, results)

    def _deliver(self, items: list[_Item], results: list) -> None:
        """Results (or exceptions) to their items' awaiters (event loop); audio counted by kind."""
        audio = dict.fromkeys(self._audio_s, 0)  # a final batch may carry partials too: each under its kind
        for it in items:
            audio[it.priority] += len(it.samples)
        for p, n in audio.items():
            if n:
                self._audio_s[p].inc(n / self.sample_rate)
        for it, r in zip(items, results):
            if it.fut.done():
                continue
            if isinstance(r, BaseException):
                it.fut.set_exception(r)
            else:
                it.fut.set_result(r)
