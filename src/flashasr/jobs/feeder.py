"""The job's CPU stage: decode + resample + segmentation of whole files in a worker pool, fed
ahead of the model with bounded memory.

One file through :func:`prepare_file` (in a worker thread, or a forked worker process)::

    path --decode (PyAV + soxr; downmix)--> samples float32 [N] at caps.sample_rate
         --pipeline.plan_pieces(samples, options, caps, split=...)--> pieces [(start, end)] in samples
         --> Prepared(samples, pieces, t0, decode CPU s, segmentation CPU s, wall s) | DecodeFailure(code, message)

:class:`DecodeFeeder` keeps that stage ahead of the main thread (which runs the model):

* **Prefetch and back-pressure**: at most ``2 x workers`` files are being decoded, and no new decode
  starts while the decoded-but-unfinished audio (``buffered``, samples) exceeds ``max_buffered``
  (unless nothing decoded is held: one file longer than the budget still goes through). Memory is
  bounded whatever the number of inputs.
* **Feeding from the pool's completion callbacks** as well as from the main thread, so the workers
  keep decoding while the main thread is inside a model call (with a main-thread-only feeder they
  drained the files in flight and idled: measured on the H200 machine, pool 48 % busy, GPU 42 %).
  Decoded audio counts against ``max_buffered`` from the moment its decode finishes.
* **Worker processes** (``cpu_pool="process"``, the CUDA default) avoid the GIL that PyAV's
  per-frame Python and the VAD's framing hold. They are forked (as PyTorch's DataLoader does with
  a CUDA parent; spawn would re-import the caller's main module) with SIGINT blocked, so a Ctrl-C
  that lands inside fork's lock hooks is not swallowed; it is delivered at :meth:`DecodeFeeder.start`.
* **A dying worker process** (killed, out of memory, a native crash) breaks the whole pool and every
  file in flight fails with it, innocent or not. Those files become *suspects*: each gets one more
  try ALONE in a fresh pool (nothing else in flight), so a second death names the culprit
  (``decode_worker_died``) and never an innocent file. Each culprit explains up to two pool deaths;
  after more than 3 unexplained deaths (an OOM killer, a broken environment) the feeder falls back
  to threads.

Errors cross the process boundary as plain strings (:class:`DecodeFailure`), so any exception type
does. All state lives on the :class:`DecodeFeeder` object, guarded by its ``lock``.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
import time
from collections import deque
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from ..errors import EmptyAudioError, FlashASRError
from ..options import ModelCapabilities, TranscribeOptions
from ..pipeline import plan_pieces


@dataclass
class Prepared:
    """A decoded, planned file. ``samples`` float32 ``[N]`` at the model rate; ``pieces`` sample
    ranges from :func:`flashasr.pipeline.plan_pieces` (empty: no speech; None: not planned yet); ``t0``
    ``time.perf_counter()`` at the start of the decode (CLOCK_MONOTONIC: comparable across
    processes on Linux); CPU and wall seconds of the stage."""

    samples: np.ndarray
    pieces: list[tuple[int, int]] | None
    t0: float
    decode_cpu_s: float
    vad_cpu_s: float
    wall_s: float


@dataclass
class DecodeFailure:
    """A file the CPU stage could not prepare: a stable error ``code`` and a ``message``."""

    code: str
    message: str


def error_of(e: BaseException, path: Path) -> tuple[str, str]:
    """(code, message) for a per-file failure (decode or model)."""
    if isinstance(e, FlashASRError):
        return e.code, str(e)
    if isinstance(e, PermissionError):
        return "unreadable_input", f"cannot read {path}: permission denied"
    if isinstance(e, FileNotFoundError):
        return "input_not_found", f"{path}: no such file"
    if isinstance(e, IsADirectoryError):
        return "invalid_input", f"{path} is a directory"
    if isinstance(e, OSError):
        return "unreadable_input", f"cannot read {path}: {e.strerror or e}"
    return "internal_error", f"{type(e).__name__}: {e}"


def default_decode(path: str, target_rate: int, workers: int = 1):
    """:func:`flashasr.audio.load_audio` (container decode, downmix, resample to ``target_rate``);
    with ``workers`` > 1, :func:`flashasr.audio.load_audio_parallel` (one long file's time ranges
    on that many threads, the same samples)."""
    from ..audio import load_audio, load_audio_parallel

    if workers > 1:
        return load_audio_parallel(path, target_rate=target_rate, workers=workers)
    return load_audio(path, target_rate=target_rate)


def prepare_file(path: str, options: TranscribeOptions, caps: ModelCapabilities,
                 decode: Callable | None = None, split: Callable | None = None,
                 plan: bool = True, shared: bool = False, decode_workers: int = 1) -> Prepared | DecodeFailure:
    """The CPU stage for one file: decode + resample (+ downmix), then :func:`plan_pieces`.

    Runs in a decode thread or in a forked worker process (then ``decode``/``split`` are None and
    the module's :func:`default_decode` / the pipeline's VAD splitter are used).
    ``decode(path, rate)`` returns an object with ``.samples``; ``split(samples, rate, max_s,
    method)`` is :func:`plan_pieces`' ``split=`` hook. ``plan=False``: decode only
    (``Prepared.pieces`` None; the main process plans many files at once, the VAD on the GPU).
    ``shared=True`` (worker processes): the samples go back in a shared-memory segment
    (``Prepared.samples`` is then its :func:`flashasr.shm.put_array` handle, turned back into an
    array by the feeder), not pickled through the pool's pipe. ``decode_workers`` > 1: the default
    decode splits the file over that many threads (:func:`default_decode`).
    """
    t0 = time.perf_counter()
    try:
        c0 = time.thread_time()
        if decode is None and decode_workers > 1:
            wav = default_decode(path, caps.sample_rate, decode_workers)
        else:
            wav = (decode or default_decode)(path, caps.sample_rate)
        samples = np.ascontiguousarray(np.asarray(wav.samples, dtype=np.float32).reshape(-1))
        if samples.size == 0:
            raise EmptyAudioError(f"{path}: the file holds no audio samples")
        c1 = time.thread_time()
        pieces = plan_pieces(samples, options, caps, split=split) if plan else None
        c2 = time.thread_time()
        if shared:
            from ..shm import put_array

            samples = put_array(samples)
    except KeyboardInterrupt:
        raise
    except Exception as e:  # noqa: BLE001 - reported per file
        return DecodeFailure(*error_of(e, Path(path)))
    return Prepared(samples, pieces, t0, c1 - c0, c2 - c1, time.perf_counter() - t0)


def worker_init() -> None:
    """Decode worker process: one thread per library (the pool is the parallelism); Ctrl-C is
    the parent's to handle."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the CLI's handler (a traceback when the pool stops us)
    for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[v] = "1"


def block_sigint() -> bool:
    """Block SIGINT in this thread (main thread of a Unix process only); True if it did."""
    import signal

    if not hasattr(signal, "pthread_sigmask") or threading.current_thread() is not threading.main_thread():
        return False
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    return True


def unblock_sigint() -> None:
    """Undo :func:`block_sigint`; a SIGINT that arrived meanwhile is delivered now."""
    import signal

    if hasattr(signal, "pthread_sigmask") and threading.current_thread() is threading.main_thread():
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


class DecodeFeeder:
    """Decodes and plans the files of ``todo`` in a worker pool, ahead of the main thread.

    Args:
        paths: input paths, indexed by file number.
        todo: file numbers to prepare, in order.
        options, caps: the job's resolved options (segmentation, ``max_segment_s``) and the model's
            capabilities (rate, window), passed to :func:`prepare_file`.
        workers: pool size; ``cpu_pool``: ``"thread"`` or ``"process"``.
        max_buffered: decoded-but-unfinished audio (samples) above which no new decode starts.
        decode, split: :func:`prepare_file`'s hooks (threads only).
        plan: whether the workers plan the pieces (False: decode only, see :func:`prepare_file`).
        decode_workers: threads that decode one file (> 1 only when the job has fewer files than
            cores: many files already fill them), see :func:`prepare_file`.

    The main thread calls :meth:`start` (inside its ``try``: a Ctrl-C held back while forking is
    raised there), then loops over :meth:`maintain`, :meth:`take_ready`, :meth:`release` (a file
    finished: its audio leaves the budget) and :meth:`wait`; :meth:`stop` on interrupt,
    :meth:`shutdown` at the end. The pool is created (forked) in the constructor, before the job
    starts any thread of its own.
    """

    def __init__(self, paths: list[str], todo: Iterable[int], *, options: TranscribeOptions,
                 caps: ModelCapabilities, workers: int, cpu_pool: str, max_buffered: int,
                 decode: Callable | None = None, split: Callable | None = None, plan: bool = True,
                 decode_workers: int = 1):
        self.paths = paths
        self.todo: deque[int] = deque(todo)
        self.options, self.caps = options, caps
        self.decode, self.split, self.plan = decode, split, plan
        self.decode_workers = max(1, int(decode_workers))
        self.workers = workers
        self.cpu_pool = cpu_pool
        self.prefetch = max(2, 2 * workers)
        self.max_buffered = max_buffered
        self.lock = threading.RLock()
        self.wake = threading.Event()
        self.futures: dict[cf.Future, int] = {}
        self.ready: deque = deque()  # (file number, Prepared | DecodeFailure), not yet taken
        self.buffered = 0  # samples decoded and not yet released
        self.held = 0  # files decoded and not yet released
        self.suspects: deque[int] = deque()  # in flight at a worker death: retried alone
        self.solo: set[int] = set()  # a suspect decoding alone
        self.stopping = False
        self.broken = False
        self.restarts = 0
        self.culprits = 0
        self.started = False
        self._feeding = threading.local()
        self.pool = self._new_pool()

    # ------------------------------------------------------------------ the pool
    def _new_pool(self) -> cf.Executor:
        if self.cpu_pool != "process":
            return cf.ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="flashasr-decode")
        import multiprocessing as mp

        from ..shm import cleanup_stale_segments

        cleanup_stale_segments()  # samples of workers that died in an earlier job (or pool)

        # Ctrl-C held back while forking (a SIGINT landing inside fork's lock hooks was swallowed and
        # the job ran on); a pending one is raised when start() (or a later replacement) unblocks it
        masked = block_sigint()
        try:
            pool = cf.ProcessPoolExecutor(max_workers=self.workers, mp_context=mp.get_context("fork"),
                                          initializer=worker_init)
            pool.submit(int).result()  # fork every worker now
        except BaseException:
            if masked:
                unblock_sigint()
            raise
        if masked and self.started:  # the first pool is unblocked by start(), inside the caller's try
            unblock_sigint()
        return pool

    def _replace_pool(self) -> None:
        """After a worker process died: kill the broken pool's processes (a survivor would block
        forever on its result pipe), then a fresh pool (threads after more than 3 deaths that no
        culprit file explains)."""
        with self.lock:
            if not self.broken or self.futures:
                return  # wait until every future of the broken pool has reported
            old = self.pool
            for proc in list(getattr(old, "_processes", {}).values() or []):
                try:
                    proc.kill()
                except Exception:  # noqa: BLE001 - already gone
                    pass
            old.shutdown(wait=False, cancel_futures=True)
            self.restarts += 1
            if self.restarts - 2 * self.culprits > 3:
                self.cpu_pool = "thread"
            self.pool = self._new_pool()
            self.broken = False

    # ------------------------------------------------------------------ feeding
    def _room(self) -> bool:
        """Whether another decode may start now (callers hold the lock)."""
        if self.stopping or self.broken:
            return False
        if self.solo:
            return False  # a suspect is decoding: alone, so that a death names it
        if self.suspects:
            return not self.futures  # the next suspect starts once nothing else is in flight
        return (bool(self.todo) and len(self.futures) < self.prefetch
                and (self.buffered < self.max_buffered or (not self.held and not self.ready)))

    def refill(self) -> None:
        """Start decodes while there is room (main thread and completion callbacks)."""
        if getattr(self._feeding, "busy", False):  # a decode finished inside our own submit: the loop goes on
            return
        self._feeding.busy = True
        try:
            with self.lock:
                while self._room():
                    self._submit_next()
        finally:
            self._feeding.busy = False

    def _submit_next(self) -> None:
        suspect = bool(self.suspects)
        queue = self.suspects if suspect else self.todo
        i = queue.popleft()
        try:
            f = self.pool.submit(prepare_file, self.paths[i], self.options, self.caps, self.decode, self.split,
                                 self.plan, self.cpu_pool == "process", self.decode_workers)
        except BrokenProcessPool:  # replaced by the main thread (maintain)
            queue.appendleft(i)
            self.broken = True
            self.wake.set()
            return
        except Exception as e:  # noqa: BLE001
            self.ready.append((i, DecodeFailure(*error_of(e, Path(self.paths[i])))))
            self.wake.set()
            return
        self.futures[f] = i
        if suspect:
            self.solo.add(i)
        f.add_done_callback(self._on_done)

    def _on_done(self, f: cf.Future) -> None:
        with self.lock:
            i = self.futures.pop(f, None)
            if i is None:
                return
            try:
                got = f.result()
            except BrokenProcessPool:
                self.broken = True
                if i not in self.solo and not self.stopping:
                    self.suspects.append(i)  # one more try, alone, in the fresh pool
                    self.wake.set()
                    return
                self.culprits += 1
                got = DecodeFailure("decode_worker_died",
                                    f"{self.paths[i]}: the decode worker process died while decoding this file "
                                    "(twice, the second time with no other file in flight); it was killed or "
                                    "crashed")
            except BaseException as e:  # noqa: BLE001 - a cancelled decode, ...
                got = DecodeFailure(*error_of(e, Path(self.paths[i])))
            if isinstance(got, Prepared) and isinstance(got.samples, tuple):
                got = self._take_shared(i, got)
            self.solo.discard(i)
            self.ready.append((i, got))
            if isinstance(got, Prepared):
                self.buffered += got.samples.size
                self.held += 1
        self.wake.set()
        self.refill()

    def _take_shared(self, i: int, got: Prepared) -> Prepared | DecodeFailure:
        """A worker's shared-memory samples mapped here (no copy; the segment's name is gone)."""
        from ..shm import take_array

        try:
            got.samples = take_array(*got.samples)
        except OSError as e:
            return DecodeFailure("internal_error", f"{self.paths[i]}: decoded samples lost in transit: {e}")
        return got

    # ------------------------------------------------------------------ the main thread's calls
    def start(self) -> None:
        """Deliver a Ctrl-C held back while forking, then start the first decodes."""
        self.started = True
        unblock_sigint()
        self.refill()

    def maintain(self) -> None:
        """Replace a broken pool once all its futures reported, and feed the fresh one."""
        if self.broken:
            self._replace_pool()
            self.refill()

    def take_ready(self) -> list[tuple[int, Prepared | DecodeFailure]]:
        """Prepared files (and failures) since the last call, in completion order."""
        with self.lock:
            got = list(self.ready)
            self.ready.clear()
        return got

    def release(self, n_samples: int) -> None:
        """A prepared file is finished: its ``n_samples`` leave the memory budget."""
        with self.lock:
            self.buffered -= n_samples
            self.held -= 1

    def nothing_coming(self) -> bool:
        """No decode in flight or ready, and none may start (inputs exhausted or the memory
        budget full): waiting for more pieces would only idle the model."""
        with self.lock:
            return not self.futures and not self.ready and not self._room()

    def exhausted(self) -> bool:
        """Every file was handed out and taken back (nothing in flight, queued or to retry)."""
        with self.lock:
            return not (self.futures or self.ready or self.todo or self.suspects or self.broken)

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for a decode to finish; False when the wait timed out."""
        self.wake.clear()
        with self.lock:
            if self.ready:
                return True
        return self.wake.wait(timeout=timeout)

    def stop(self) -> None:
        """Start nothing more; cancel the decodes not yet running (on interrupt)."""
        with self.lock:
            self.stopping = True
            for f in list(self.futures):
                f.cancel()

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


__all__ = ["DecodeFeeder", "Prepared", "DecodeFailure", "prepare_file", "default_decode", "error_of",
           "worker_init", "block_sigint", "unblock_sigint"]
