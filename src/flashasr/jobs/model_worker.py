"""The job's model thread: batches of pieces through the model while the main thread prepares the next.

The conductor (main thread) hands over one batch at a time (:meth:`ModelWorker.submit`: at most
one running and one waiting); this thread runs it through
:func:`flashasr.pipeline.transcribe_pieces` (one model call, with the pieces' speech spans when the
batch carries them, :class:`~flashasr.jobs.batcher.Waves`; one bad piece fails alone), waits for
the GPU on CUDA (so ``busy_s`` holds the GPU work) and hands the results back
(:meth:`ModelWorker.take_done`), waking the conductor. The GPU so never waits for the Python
around it: admitting decoded files, planning their pieces, routing results and writing outputs
all happen while a batch runs (before, the main thread did them between model calls: the model
was busy 46 % of the job's wall time on the H200, ``bench/results/offline_e2e_h200_baseline.json``).

The model is called from this one thread only (the engines keep their own lock anyway). A model
in a process of its own (:class:`~flashasr.pipeline.model_process.ModelProcess`) gets each batch
the moment it is handed over (``start_pieces``) and a second thread collects the answers: that
process maps and checks the samples of the waiting batch while it runs the one before, so the GPU
does not wait for them between calls (on the H100, about 0.15 s per 512-piece call went to the
work around the engine: mapping, checking, transcripts, the round trip).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque

from ..options import TranscribeOptions
from ..pipeline import transcribe_pieces
from .interrupts import join


class ModelWorker:
    """One thread that owns the model calls of a job.

    Args:
        model: an :class:`~flashasr.models.base.ASRModel`.
        wake: set whenever a batch is done (the conductor waits on it).
        synchronize_cuda: ``torch.cuda.synchronize()`` after each call (accounting).

    Attributes:
        busy_s: wall seconds inside model calls; ``cpu_s``: this thread's CPU seconds in them;
        ``remote_cpu_s``: the CPU seconds of a model running in a process of its own
        (:class:`~flashasr.pipeline.model_process.ModelProcess`) in this job's calls;
        ``stage_cpu_s``: what the model says its host work went to during the job (its
        ``stage_cpu_s`` counters, e.g. ``features_upload``, ``detokenize``; see
        :class:`~flashasr.models.base.ASRModel`); ``in_flight``: batches submitted and not yet
        taken back; ``batches_done``: batches finished so far; ``calls``: per batch the model ran
        (finished, or failed and stopped the thread) ``(start, seconds, pieces, audio seconds)``,
        ``start`` a ``time.perf_counter()`` value (the job's timeline of model calls: where the GPU
        waited); ``timings``: per call the model's ``last_timings`` (the GPU engine's own split of
        the call: ``host_prep``, ``encoder_gpu``, ``decoder_gpu``, ``wait``, ``total``), or None.
    """

    def __init__(self, model, *, wake: threading.Event, synchronize_cuda: bool = False):
        self.model = model
        self._rate = float(getattr(model, "sample_rate", 16000) or 16000)
        self.wake = wake
        self.synchronize_cuda = synchronize_cuda
        self.busy_s = 0.0
        self.cpu_s = 0.0
        self._stage0 = dict(getattr(model, "stage_cpu_s", None) or {})
        self._remote0 = float(getattr(model, "remote_cpu_s", 0.0) or 0.0)
        self._bytes0 = (getattr(model, "shared_bytes", 0), getattr(model, "copied_bytes", 0))
        self.in_flight = 0
        self.batches_done = 0
        self.calls: list[tuple[float, float, int, float]] = []
        self.timings: list[dict | None] = []
        self.error: BaseException | None = None
        self._todo: queue.Queue = queue.Queue()
        self._done: deque = deque()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, name="flashasr-model", daemon=True)]
        if getattr(model, "isolates_pieces", False) and hasattr(model, "start_pieces"):
            # a model process: this thread sends each batch as soon as it is handed over, the
            # collector takes the answers; the process prepares the next batch while one runs
            self._sent: queue.Queue = queue.Queue()
            self._last_end = 0.0
            self._threads = [threading.Thread(target=self._send_loop, name="flashasr-model", daemon=True),
                             threading.Thread(target=self._collect_loop, name="flashasr-model-answers", daemon=True)]
        for t in self._threads:
            t.start()

    @property
    def idle(self) -> bool:
        return self.in_flight == 0

    def has_room(self) -> bool:
        """Whether another batch may be handed over now (one running and one waiting at most)."""
        return self.in_flight < 2

    def submit(self, token, waves: list, options: TranscribeOptions) -> None:
        """Queue one batch; ``token`` comes back with its results."""
        self.in_flight += 1
        self._todo.put((token, waves, options))

    def take_done(self) -> list[tuple[object, list]]:
        """``[(token, per piece a Transcript or its exception)]`` of the batches done since the last call.

        Raises:
            the error that stopped the thread (not a piece's own failure, which comes back as its result).
        """
        with self._lock:
            got = list(self._done)
            self._done.clear()
        self.in_flight -= len(got)
        if self.error is not None:
            raise self.error
        return got

    def stop(self) -> None:
        """Finish the batch running (a model call cannot be cut short), drop the waiting one (a model
        process runs the one it already prepared too), end the thread."""
        while True:
            try:
                self._todo.get_nowait()
            except queue.Empty:
                break
        self._todo.put(None)
        for t in self._threads:
            join(t)  # in slices: a second Ctrl-C that kills a hung model process is acted on at once

    def _run(self) -> None:
        while True:
            job = self._todo.get()
            if job is None:
                return
            token, waves, options = job
            t0, c0 = time.perf_counter(), time.thread_time()
            error = None
            try:
                outs = transcribe_pieces(self.model, waves, options, getattr(waves, "speech", None))
                self._synchronize()
            except BaseException as e:  # noqa: BLE001 - not a piece's failure: the job must stop
                error = e
            dt = time.perf_counter() - t0  # a failed call ran too: its time and pieces count
            self.busy_s += dt
            self.cpu_s += time.thread_time() - c0
            self.calls.append((t0, dt, len(waves), sum(len(w) for w in waves) / self._rate))
            self.timings.append(_rounded(getattr(self.model, "last_timings", None)) if error is None else None)
            if error is not None:
                self._failed(error)
                return
            self._finished(token, outs)

    def _finished(self, token, outs: list) -> None:
        with self._lock:
            self._done.append((token, outs))
            self.batches_done += 1
        self.wake.set()

    def _failed(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self.wake.set()

    def _send_loop(self) -> None:
        """Model process: hand each batch over at once (``start_pieces``); the collector waits."""
        while True:
            job = self._todo.get()
            if job is None:
                self._sent.put(None)
                return
            token, waves, options = job
            t0 = time.perf_counter()
            try:
                pending = self.model.start_pieces(waves, options, getattr(waves, "speech", None))
            except BaseException as e:  # noqa: BLE001 - the process is gone: the job must stop
                self._failed(e)
                self._sent.put(None)
                return
            self._sent.put((token, waves, t0, pending))

    def _collect_loop(self) -> None:
        """Model process: the answers, in order. A call's time runs from when it was sent, or from
        the end of the call before it if that was later (calls are timed back to back, not overlapping)."""
        while True:
            got = self._sent.get()
            if got is None:
                return
            token, waves, sent, pending = got
            c0 = time.thread_time()
            error = None
            try:
                outs = pending.result()
            except BaseException as e:  # noqa: BLE001 - not a piece's failure: the job must stop
                error = e
            end = time.perf_counter()
            t0 = max(sent, self._last_end)
            self._last_end = end
            self.busy_s += end - t0
            self.cpu_s += time.thread_time() - c0
            self.calls.append((t0, end - t0, len(waves), sum(len(w) for w in waves) / self._rate))
            self.timings.append(_rounded(getattr(self.model, "last_timings", None)) if error is None else None)
            if error is not None:
                self._failed(error)
                return
            self._finished(token, outs)

    def process_info(self) -> dict | None:
        """For a model in a process of its own: ``{"pid", "shared_mb", "copied_mb"}`` of this job
        (see :class:`~flashasr.jobs.report.JobReport`); else None."""
        if not getattr(self.model, "isolates_pieces", False):
            return None
        return {"pid": getattr(self.model, "pid", None),
                "shared_mb": round((getattr(self.model, "shared_bytes", 0) - self._bytes0[0]) / 1e6, 1),
                "copied_mb": round((getattr(self.model, "copied_bytes", 0) - self._bytes0[1]) / 1e6, 1)}

    @property
    def remote_cpu_s(self) -> float:
        """CPU seconds of the model's own process in this job's calls (0 for a model in this process)."""
        return float(getattr(self.model, "remote_cpu_s", 0.0) or 0.0) - self._remote0

    @property
    def stage_cpu_s(self) -> dict[str, float]:
        now = getattr(self.model, "stage_cpu_s", None) or {}
        return {k: v - self._stage0.get(k, 0.0) for k, v in now.items()}

    def _synchronize(self) -> None:
        if not self.synchronize_cuda:
            return
        try:
            import torch

            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001 - no usable CUDA: nothing to wait for
            pass


def _rounded(t: dict | None) -> dict | None:
    """An engine's timings of one call (seconds), rounded for the report; None stays None."""
    if not t:
        return None
    return {k: round(float(v), 4) for k, v in t.items() if isinstance(v, (int, float))}


__all__ = ["ModelWorker"]
