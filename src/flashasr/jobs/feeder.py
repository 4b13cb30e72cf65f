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
* **A dying worker process** (killed, out of memory, a native crash) is replaced at once
  (:class:`~flashasr.jobs.procpool.ForkedWorkers`), which knows the file it was decoding: that
  file gets one more try and, if it kills a worker again, fails alone (``decode_worker_died``);
  the files queued behind it never started and simply go again. After more than 3 deaths that no
  such file explains (an OOM killer, a broken environment) the feeder falls back to threads.

Errors cross the process boundary as plain strings (:class:`DecodeFailure`), so any exception type
does. All state lives on the :class:`DecodeFeeder` object, guarded by its ``lock``.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
import time
from collections import deque
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
    processes on Linux); CPU and wall seconds of the stage: ``decode_cpu_s`` (container decode,
    downmix and resampling, of which ``resample_cpu_s`` in soxr), ``vad_cpu_s``,
    ``transport_cpu_s`` (copying the samples into shared memory); ``warnings``: what the decode
    tolerated (:meth:`flashasr.audio.DecodedAudio.damage`: a truncated or damaged file), None
    when the decode does not say (a custom ``decode``)."""

    samples: np.ndarray
    pieces: list[tuple[int, int]] | None
    t0: float
    decode_cpu_s: float
    vad_cpu_s: float
    wall_s: float
    resample_cpu_s: float = 0.0
    transport_cpu_s: float = 0.0
    warnings: list[dict] | None = None


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
        damage = wav.damage() if hasattr(wav, "damage") else None
        c1 = time.thread_time()
        pieces = plan_pieces(samples, options, caps, split=split) if plan else None
        c2 = time.thread_time()
        if shared:
            from ..shm import put_array

            samples = put_array(samples)
        c3 = time.thread_time()
    except KeyboardInterrupt:
        raise
    except Exception as e:  # noqa: BLE001 - reported per file
        return DecodeFailure(*error_of(e, Path(path)))
    return Prepared(samples, pieces, t0, c1 - c0 + float(getattr(wav, "other_threads_cpu_s", 0.0) or 0.0), c2 - c1,
                    time.perf_counter() - t0, resample_cpu_s=float(getattr(wav, "resample_cpu_s", 0.0) or 0.0),
                    transport_cpu_s=c3 - c2, warnings=damage)


#: Scheduling niceness the decode worker processes add to their own (``os.nice``): when every core
#: is busy, the main process -- the model thread feeding the GPU, the result, planner and writer
#: threads -- runs first (H200, 15 workers on 16 cores: model calls inside a job took 1.83 s for
#: what the engine does alone in 1.22 s; ``bench/results/offline_e2e_h200_pool.json``).
WORKER_NICENESS = 5


def keep_cores_free(n: int) -> None:
    """Keep this process off the ``n`` lowest-numbered cores of its CPU affinity set (Linux
    ``sched_setaffinity``), so that they stay free for the main process: the model thread that
    feeds the GPU and the job's other threads. ``n`` <= 0, or too few cores to leave one: as it is.
    The decode workers call it with ``FLASHASR_DECODE_RESERVED_CPUS`` (default 0)."""
    if n <= 0 or not hasattr(os, "sched_getaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) > n:
        os.sched_setaffinity(0, cpus[n:])


def worker_init() -> None:
    """Decode worker process: one thread per library (the pool is the parallelism), a lower
    scheduling priority than the main process (:data:`WORKER_NICENESS`), optionally off the first
    cores (:func:`keep_cores_free`); Ctrl-C is the parent's to handle."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the CLI's handler (a traceback when the pool stops us)
    for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[v] = "1"
    try:
        os.nice(int(os.environ.get("FLASHASR_DECODE_NICENESS", WORKER_NICENESS)))
    except (OSError, ValueError, AttributeError):  # not permitted / not a number / no os.nice: as it is
        pass
    try:
        keep_cores_free(int(os.environ.get("FLASHASR_DECODE_RESERVED_CPUS", 0)))
    except (OSError, ValueError):  # not permitted / not a number: as it is
        pass


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


class _ThreadWorkers:
    """The thread backend of :class:`DecodeFeeder`: a :class:`~concurrent.futures.ThreadPoolExecutor`
    running ``job(i)``, each result to ``on_result(i, result)`` from the finishing thread."""

    def __init__(self, n: int, job: Callable[[int], object], *, on_result: Callable[[int, object], None]):
        self.job, self.on_result = job, on_result
        self.size = n
        self.deaths = 0
        self._pool = cf.ThreadPoolExecutor(max_workers=n, thread_name_prefix="flashasr-decode")
        self._futures: set[cf.Future] = set()
        self._lock = threading.Lock()

    def room(self) -> int:
        with self._lock:
            return 2 * self.size - len(self._futures)

    def submit(self, i: int, path: str = "") -> bool:
        with self._lock:
            f = self._pool.submit(self.job, i)
            self._futures.add(f)
        f.add_done_callback(lambda f, i=i: self._done(f, i))
        return True

    def _done(self, f: cf.Future, i: int) -> None:
        with self._lock:
            self._futures.discard(f)
        if f.cancelled():
            return
        try:
            got = f.result()
        except BaseException as e:  # noqa: BLE001 - job() catches its errors
            if isinstance(e, KeyboardInterrupt) and threading.current_thread() is threading.main_thread():
                raise  # a Ctrl-C landing while the main thread ran this callback (the decode was done before
                # it was attached): the job's interrupt, not the file's failure (the job ran on, not interrupted)
            got = DecodeFailure("internal_error", f"{type(e).__name__}: {e}")
        self.on_result(i, got)

    def close(self, *, kill: bool = False) -> None:
        self._pool.shutdown(wait=not kill, cancel_futures=True)


def _prepare_task(options: TranscribeOptions, caps: ModelCapabilities, plan: bool, decode_workers: int,
                  path: str) -> Prepared | DecodeFailure:
    """One file in a decode worker process (:class:`~flashasr.jobs.procpool.ForkedWorkers`):
    :func:`prepare_file` with the module's decode and the pipeline's VAD, samples in shared memory."""
    return prepare_file(path, options, caps, None, None, plan, True, decode_workers)


def _drop_stale(got) -> None:
    """A worker's answer for a file of a job that is over: free its shared-memory samples."""
    if isinstance(got, Prepared) and isinstance(got.samples, tuple):
        from ..shm import unlink_segment

        unlink_segment(got.samples[0])


class DecodeFeeder:
    """Decodes and plans the files of ``todo`` in a worker pool, ahead of the main thread.

    Args:
        paths: input paths, indexed by file number.
        todo: file numbers to prepare, in order.
        options, caps: the job's resolved options (segmentation, ``max_segment_s``) and the model's
            capabilities (rate, window), passed to :func:`prepare_file`.
        workers: pool size; ``cpu_pool``: ``"thread"`` or ``"process"``
            (:class:`~flashasr.jobs.procpool.ForkedWorkers`).
        max_buffered: decoded-but-unfinished audio (samples) above which no new decode starts.
        decode, split: :func:`prepare_file`'s hooks (threads only).
        plan: whether the workers plan the pieces (False: decode only, see :func:`prepare_file`).
        decode_workers: threads that decode one file (> 1 only when the job has fewer files than
            cores: many files already fill them), see :func:`prepare_file`.
        pool: worker processes to use (``cpu_pool="process"``): a
            :class:`~flashasr.jobs.procpool.ForkedWorkers` started earlier (before the caller grew:
            a model, a CUDA context) and kept for later jobs; None forks ``workers`` processes now
            and ends them at :meth:`shutdown`.
        keep_shared: keep the names of the workers' shared-memory segments while their files are
            in the job (the model process maps the samples by name; see :meth:`_take_shared`).

    The main thread calls :meth:`start` (inside its ``try``: a Ctrl-C held back while forking is
    delivered there), then loops over :meth:`maintain`, :meth:`take_ready`, :meth:`release` (a file
    finished: its audio leaves the budget) and :meth:`wait`; :meth:`stop` on interrupt,
    :meth:`shutdown` at the end. Worker processes are forked in the constructor, before the job
    starts any thread of its own.
    """

    def __init__(self, paths: list[str], todo: Iterable[int], *, options: TranscribeOptions,
                 caps: ModelCapabilities, workers: int, cpu_pool: str, max_buffered: int,
                 decode: Callable | None = None, split: Callable | None = None, plan: bool = True,
                 decode_workers: int = 1, pool=None, keep_shared: bool = False):
        self.paths = paths
        self.keep_shared = keep_shared
        self.todo: deque[int] = deque(todo)
        self.options, self.caps = options, caps
        self.decode, self.split, self.plan = decode, split, plan
        self.decode_workers = max(1, int(decode_workers))
        self.workers = workers
        self.cpu_pool = cpu_pool
        self.max_buffered = max_buffered
        self.lock = threading.RLock()
        self.wake = threading.Event()
        self.in_flight: set[int] = set()
        self.ready: deque = deque()  # (file number, Prepared | DecodeFailure), not yet taken
        self.buffered = 0  # samples decoded and not yet released
        self.held = 0  # files decoded and not yet released
        self.died_once: set[int] = set()  # files whose worker died while decoding them
        self.culprits = 0  # files that killed their worker twice
        self.deaths = 0  # worker processes that died during this job
        self.transport_cpu_s = 0.0  # CPU seconds mapping the workers' shared-memory samples here
        self.stopping = False
        self.started = False
        self._feeding = threading.local()
        self._own_pool = pool is None
        self.pool = self._new_pool(pool)

    # ------------------------------------------------------------------ the pool
    def _job(self, i: int) -> Prepared | DecodeFailure:
        return prepare_file(self.paths[i], self.options, self.caps, self.decode, self.split, self.plan,
                            self.cpu_pool == "process", self.decode_workers)

    def _new_pool(self, pool=None):
        if self.cpu_pool != "process":
            return _ThreadWorkers(self.workers, self._job, on_result=self._completed)
        from ..shm import cleanup_stale_segments
        from .procpool import ForkedWorkers

        cleanup_stale_segments()  # samples of workers that died in an earlier job (or pool)
        if pool is None:
            # Ctrl-C held back while forking (a SIGINT landing inside fork's lock hooks was swallowed and
            # the job ran on); a pending one is raised when start() unblocks it
            masked = block_sigint()
            try:
                pool = ForkedWorkers(self.workers, init=worker_init)
            except BaseException:
                if masked:
                    unblock_sigint()
                raise
        pool.attach(_prepare_task, (self.options, self.caps, self.plan, self.decode_workers),
                    on_result=self._completed, on_death=self._died, on_stale=_drop_stale)
        return pool

    # ------------------------------------------------------------------ feeding
    def _room(self) -> bool:
        """Whether another decode may start now (callers hold the lock)."""
        if self.stopping or not self.todo:
            return False
        return self.buffered < self.max_buffered or (not self.held and not self.ready)

    def refill(self) -> None:
        """Start decodes while there is room (main thread and the pool's result callbacks)."""
        if getattr(self._feeding, "busy", False):  # a decode finished inside our own submit: the loop goes on
            return
        self._feeding.busy = True
        try:
            with self.lock:
                while self._room() and self.pool.room() > 0:
                    i = self.todo.popleft()
                    self.in_flight.add(i)
                    if not self.pool.submit(i, self.paths[i]):
                        self.in_flight.discard(i)
                        self.todo.appendleft(i)
                        break
        finally:
            self._feeding.busy = False

    def _completed(self, i: int, got) -> None:
        """A worker's result for file ``i`` (in the pool's result thread)."""
        with self.lock:
            if i not in self.in_flight:  # a late answer for a file already given to another worker
                if isinstance(got, Prepared) and isinstance(got.samples, tuple):
                    self._take_shared(i, got, keep=False)  # its segment's name goes; the memory with the array
                return
            self.in_flight.discard(i)
            if isinstance(got, Prepared) and isinstance(got.samples, tuple):
                got = self._take_shared(i, got)
            self.ready.append((i, got))
            if isinstance(got, Prepared):
                self.buffered += got.samples.size
                self.held += 1
        self.wake.set()
        self.refill()

    def _died(self, held: list[int], closing: bool = False) -> None:
        """A worker process died holding ``held`` (the file it was decoding first): that file gets
        one more try and fails if it kills a worker again; the files queued behind it never started
        and go back to the front of the queue. After more than 3 deaths that no such file explains
        (an out-of-memory killer, a broken environment), the rest of the job decodes in threads.
        ``closing``: the pool was ended on purpose (interrupt, switch to threads); nobody is blamed."""
        with self.lock:
            if not closing:
                self.deaths += 1
            for i in held:
                self.in_flight.discard(i)
            if self.stopping:
                held = []  # interrupted: what was not decoded stays undone
            elif held and not closing:
                if held[0] in self.died_once:
                    self.culprits += 1
                    self.ready.append((held[0], DecodeFailure(
                        "decode_worker_died",
                        f"{self.paths[held[0]]}: the decode worker process died twice while decoding this file "
                        "(killed or crashed)")))
                    held = held[1:]
                else:
                    self.died_once.add(held[0])
            self.todo.extendleft(reversed(held))
            no_workers = getattr(self.pool, "room", lambda: 1)() <= 0 and getattr(self.pool, "spawn_failures", 0)
            if not closing and self.cpu_pool == "process" and (self.deaths - 2 * self.culprits > 3 or no_workers):
                self.cpu_pool = "thread"
                old, self.pool = self.pool, _ThreadWorkers(self.workers, self._job, on_result=self._completed)
                old.detach()  # what the old workers still hold comes back as stale answers
                for i in list(self.in_flight):  # ... so it goes again, in threads
                    self.in_flight.discard(i)
                    self.todo.appendleft(i)
                if self._own_pool:  # not from this thread: close() waits for it
                    threading.Thread(target=old.close, daemon=True, name="flashasr-decode-close").start()
        self.wake.set()
        self.refill()

    def _take_shared(self, i: int, got: Prepared, keep: bool = True) -> Prepared | DecodeFailure:
        """A worker's shared-memory samples mapped here (no copy). The segment's name goes at once,
        or, with ``keep_shared`` (the model runs in a process of its own and maps the same memory),
        when the file is done (:meth:`~flashasr.jobs.batcher.FileState.drop_audio`) or the job ends
        (:meth:`shutdown`)."""
        from ..shm import take_array

        c0 = time.thread_time()
        try:
            got.samples = take_array(*got.samples, keep_for=self if keep and self.keep_shared else None)
        except OSError as e:
            return DecodeFailure("internal_error", f"{self.paths[i]}: decoded samples lost in transit: {e}")
        finally:
            self.transport_cpu_s += time.thread_time() - c0
        return got

    # ------------------------------------------------------------------ the main thread's calls
    def start(self) -> None:
        """Deliver a Ctrl-C held back while forking, then start the first decodes."""
        self.started = True
        unblock_sigint()
        self.refill()

    def maintain(self) -> None:
        """Nothing to do: a dead worker is replaced by its pool (kept for the conductor's loop)."""

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
        self.refill()

    def nothing_coming(self) -> bool:
        """No decode in flight or ready, and none may start (inputs exhausted or the memory
        budget full): waiting for more pieces would only idle the model."""
        with self.lock:
            return not self.in_flight and not self.ready and not self._room()

    def exhausted(self) -> bool:
        """Every file was handed out and taken back (nothing in flight, queued or to retry)."""
        with self.lock:
            return not (self.in_flight or self.ready or self.todo)

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for a decode to finish; False when the wait timed out."""
        self.wake.clear()
        with self.lock:
            if self.ready:
                return True
        return self.wake.wait(timeout=timeout)

    def stop(self) -> None:
        """Start nothing more (on interrupt); the decodes running are abandoned at :meth:`shutdown`."""
        with self.lock:
            self.stopping = True

    def shutdown(self) -> None:
        """End the job's decoding: a pool of its own is closed (killed after an interrupt), a
        caller's pool is detached and kept."""
        if self._own_pool or not hasattr(self.pool, "detach"):
            self.pool.close(kill=self.stopping)
        else:
            self.pool.detach()
        if self.keep_shared:  # files not finished (an interrupt, a stop): their segments' names
            from ..shm import release_owner

            release_owner(self)


__all__ = ["DecodeFeeder", "Prepared", "DecodeFailure", "prepare_file", "default_decode", "error_of",
           "worker_init", "block_sigint", "unblock_sigint"]
