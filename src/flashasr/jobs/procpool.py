"""Forked decode workers for the job runner: tasks in, small result messages out, reusable by jobs.

::

    parent (DecodeFeeder of the job attached)        worker k (forked once, job-agnostic)
    attach(job): b"J" + pickle((job, fn, args)) -->  keeps fn, args for that job
    submit(i, path): b"T" + job, i, path  -------->  fn(*args, path): prepare_file(...) (decode,
                                                     resample, [VAD]; samples into a shared-memory
                                                     segment, flashasr.shm)
    reader thread <-- pickle((job, i, result)) ---
      -> on_result(i, result)                        (a result of an earlier job: on_stale(result))
      EOF on socket k (the worker died) -> on_death([files worker k held, the running one first])
                                           and a fresh worker k (sent the current job)

A task is the file's number and path and a result a few hundred bytes (the samples travel through
shared memory). Each worker holds at most ``depth`` files (one decoding, the next already queued in
its socket), so it never waits for a round trip through the parent. A worker reads its next task
only after sending the result of the previous one, so when it dies the parent knows exactly which
file it was decoding: the first one it held.

The workers know nothing of a job until it is attached, so one pool can serve many jobs and be
forked before the process grows: forking 15 workers from a process holding a CUDA context and a
loaded model took 0.9 s on the H200 machine (``bench/results/profile_jobs_h200_lean.json``: 40 % of
a 3-hour job's wall time); ``flashasr transcribe`` forks its pool before it loads the model.

Why not :class:`concurrent.futures.ProcessPoolExecutor`: per file it pickles the call (options and
capabilities included), passes it through a queue-feeder thread and a management thread and
resolves a future through callbacks; on the H200 machine those two threads took about 1 ms of the
parent's GIL per file (``bench/results/profile_jobs_h200_buffer.json``: ``Thread-4``/``Thread-6``
and ``QueueFeederThread``), the serial bound of the whole CPU path at ~400 files/s (the null
model's 4,875x). And when one of its workers dies, it fails every file in flight.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing as mp
import os
import pickle
import selectors
import struct
import threading
from collections import deque
from multiprocessing.connection import Connection
from typing import Callable

log = logging.getLogger(__name__)
_TASK = struct.Struct("<qi")  # job number, file number; then the path (UTF-8, surrogates escaped)
_jobs = itertools.count(1)


def _worker_main(conn: Connection, init: Callable[[], None] | None, close_fds: list[int]) -> None:
    """A worker process: run the attached job's ``fn(*args, path)`` on each task until an empty message."""
    for fd in close_fds:  # the parent's ends of the other workers' sockets: EOF must reach them
        try:
            os.close(fd)
        except OSError:
            pass
    if init is not None:
        init()
    jobs: dict[int, tuple] = {}
    while True:
        try:
            msg = conn.recv_bytes()
        except (EOFError, OSError):
            return  # the parent is gone
        if not msg:
            return
        if msg[:1] == b"J":
            job, fn, args = pickle.loads(msg[1:])
            jobs.clear()  # one job at a time: the earlier one is over
            jobs[job] = (fn, args)
            continue
        job, i = _TASK.unpack_from(msg, 1)
        path = msg[1 + _TASK.size:].decode("utf-8", "surrogateescape")
        fn, args = jobs[job]
        result = fn(*args, path)
        try:
            conn.send_bytes(pickle.dumps((job, i, result), protocol=pickle.HIGHEST_PROTOCOL))
        except (BrokenPipeError, OSError):
            return


class _Worker:
    __slots__ = ("k", "proc", "conn", "held")

    def __init__(self, k: int, proc, conn: Connection):
        self.k, self.proc, self.conn = k, proc, conn
        self.held: deque[tuple[int, int]] = deque()  # (job, file number) sent, oldest (the one decoding) first


class _Job:
    __slots__ = ("number", "message", "on_result", "on_death", "on_stale")

    def __init__(self, number, message, on_result, on_death, on_stale):
        self.number, self.message = number, message
        self.on_result, self.on_death, self.on_stale = on_result, on_death, on_stale


class ForkedWorkers:
    """``n`` forked worker processes that run the attached job's tasks.

    Args:
        n: worker processes (forked now: before the caller starts threads of its own, and
            preferably before it loads a model or a CUDA context).
        init: run in each worker once, before its first task (signal handlers, thread counts).
        depth: files a worker holds at most (the one it works on plus those queued for it).

    :meth:`attach` a job (one at a time), :meth:`submit` its files, :meth:`detach` when it is
    done; :meth:`close` ends the workers. :meth:`submit` and :meth:`room` may be called from any
    thread; the callbacks run in the pool's reader thread.

    Attributes:
        deaths: worker processes that ended without being asked to, over the pool's life;
        spawn_failures: replacements that could not be forked (the pool is that much smaller).
    """

    def __init__(self, n: int, *, init: Callable[[], None] | None = None, depth: int = 2):
        self.init = init
        self.depth = max(1, int(depth))
        self.deaths = 0
        self.spawn_failures = 0
        self._ctx = mp.get_context("fork")
        self._lock = threading.Lock()
        self._closing = False
        self._job: _Job | None = None
        self._stale: Callable[[object], None] | None = None  # the last detached job's on_stale
        self._workers: list[_Worker | None] = [None] * max(1, int(n))
        self._wake_r, self._wake_w = mp.Pipe(duplex=False)
        for k in range(len(self._workers)):
            self._workers[k] = self._spawn(k)
        self._reader = threading.Thread(target=self._read_loop, name="flashasr-decode-results", daemon=True)
        self._reader.start()

    @property
    def size(self) -> int:
        return len(self._workers)

    @property
    def closed(self) -> bool:
        return self._closing

    def _spawn(self, k: int) -> _Worker:
        parent_end, child_end = mp.Pipe(duplex=True)
        others = [w.conn.fileno() for w in self._workers if w is not None and w.k != k]
        others += [self._wake_r.fileno(), self._wake_w.fileno(), parent_end.fileno()]
        proc = self._ctx.Process(target=_worker_main, args=(child_end, self.init, others),
                                 name=f"flashasr-decode-{k}", daemon=True)
        proc.start()
        child_end.close()
        w = _Worker(k, proc, parent_end)
        if self._job is not None:
            self._send(w, self._job.message)
        return w

    @staticmethod
    def _send(w: _Worker, msg: bytes) -> None:
        try:
            w.conn.send_bytes(msg)
        except OSError:  # the worker is dead; the reader thread sees its EOF and reports what it held
            pass

    # ------------------------------------------------------------------ jobs
    def attach(self, fn: Callable, args: tuple, *, on_result: Callable[[int, object], None],
               on_death: Callable[[list[int], bool], None], on_stale: Callable[[object], None] | None = None) -> None:
        """Make ``fn(*args, path)`` the workers' task (``fn``, ``args`` picklable; ``fn`` catches its
        own errors: an exception ends the worker and counts as a death).

        ``on_result(i, result)`` for each file; ``on_death(held, closing)`` when a worker ends holding
        files of this job or ends without being asked to (``held``: its files, the one it was working
        on first; ``closing``: the pool was closed, so the files are not to blame); ``on_stale(result)``
        for a result that comes back after its job was detached (e.g. to free its memory).

        Raises:
            RuntimeError: another job is attached, or the pool is closed.
        """
        with self._lock:
            if self._closing:
                raise RuntimeError("the decode pool is closed")
            if self._job is not None:
                raise RuntimeError("the decode pool is serving another job")
            number = next(_jobs)
            msg = b"J" + pickle.dumps((number, fn, args), protocol=pickle.HIGHEST_PROTOCOL)
            self._job = _Job(number, msg, on_result, on_death, on_stale)
            for w in self._workers:
                if w is not None:
                    self._send(w, msg)

    def detach(self) -> None:
        """End the current job: later results of its files go to its ``on_stale``."""
        with self._lock:
            if self._job is not None:
                self._stale = self._job.on_stale
            self._job = None

    def room(self) -> int:
        """Files that can be submitted now without exceeding ``depth`` per worker."""
        with self._lock:
            return sum(self.depth - len(w.held) for w in self._workers if w is not None)

    def submit(self, i: int, path: str) -> bool:
        """Send file ``i`` (at ``path``) to the worker holding the fewest files; False when none has
        room or no job is attached."""
        with self._lock:
            job = self._job
            live = [w for w in self._workers if w is not None and len(w.held) < self.depth]
            if self._closing or job is None or not live:
                return False
            w = min(live, key=lambda w: len(w.held))
            w.held.append((job.number, i))
            self._send(w, b"T" + _TASK.pack(job.number, i) + os.fsencode(path))
            return True

    # ------------------------------------------------------------------ the reader thread
    def _read_loop(self) -> None:
        """The reader thread: each worker's answer to the job's callback, a dead worker to :meth:`_died`.

        The workers' sockets stay registered in one poll selector, changed only when a worker is
        replaced (here, in :meth:`_died`): ``multiprocessing.connection.wait`` built and filled a
        new selector on every call, 33 us with 16 sockets on the dev VM (2 us for this), paid once
        per file in the thread that hands the next file out."""
        sel = selectors.PollSelector()  # no kernel-side registrations to go stale when a socket closes
        sel.register(self._wake_r.fileno(), selectors.EVENT_READ, None)
        watched: dict[int, _Worker] = {}

        def watch() -> None:  # the selector follows the pool's workers
            with self._lock:
                live = {w.conn.fileno(): w for w in self._workers if w is not None}
            for fd in [fd for fd, w in watched.items() if live.get(fd) is not w]:
                sel.unregister(fd)
                del watched[fd]
            for fd, w in live.items():
                if fd not in watched:
                    sel.register(fd, selectors.EVENT_READ, w)
                    watched[fd] = w

        watch()
        stopping = False  # close() woke us: its workers are stopped; what they sent is still read
        while True:
            replaced = read = False
            for key, _events in sel.select(0 if stopping else None):
                w = key.data
                if w is None:  # the wake-up pipe (registered first, so first in a batch)
                    stopping = True
                    continue
                read = True
                c = w.conn
                try:
                    number, i, result = pickle.loads(c.recv_bytes())
                except (EOFError, OSError, pickle.UnpicklingError):
                    self._died(w)
                    replaced = True
                    continue
                with self._lock:
                    if w.held and w.held[0] == (number, i):
                        w.held.popleft()
                    else:  # cannot happen (tasks are answered in order); keep the books right anyway
                        try:
                            w.held.remove((number, i))
                        except ValueError:
                            pass
                    job = self._job
                if job is not None and job.number == number:
                    self._call(job.on_result, i, result)
                elif self._stale is not None:
                    self._call(self._stale, result)
            if replaced:
                watch()  # self._workers changes only in _died, on this thread (and in close(), after it)
            if stopping and not read:  # every worker's answers and EOF read
                sel.close()
                return

    def _died(self, w: _Worker) -> None:
        """Worker ``w`` ended: reap it, replace it (unless closing), report the current job's files it held."""
        w.proc.join(timeout=5.0)
        w.conn.close()
        with self._lock:
            job = self._job
            held = [i for number, i in w.held if job is not None and number == job.number]
            w.held.clear()
            closing = self._closing
            self._workers[w.k] = None
            if not closing:
                self.deaths += 1
                try:
                    self._workers[w.k] = self._spawn(w.k)
                except OSError as e:  # no more processes (limits, memory): the pool shrinks
                    self.spawn_failures += 1
                    log.warning("decode worker %d could not be replaced: %s", w.k, e)
        if job is not None and (held or not closing):
            self._call(job.on_death, held, closing)

    @staticmethod
    def _call(fn, *args) -> None:
        """A callback's error is logged, never the end of the reader thread (the other files' results
        must still arrive)."""
        try:
            fn(*args)
        except Exception:  # noqa: BLE001
            log.exception("decode pool callback %s failed", getattr(fn, "__name__", fn))

    # ------------------------------------------------------------------ ending
    def close(self, *, kill: bool = False, timeout: float = 5.0) -> None:
        """Stop every worker (``kill``: at once, else once it has answered the files it holds), then
        the reader thread. Results that arrive meanwhile are still delivered, and the files of a
        worker that ends without answering them go to ``on_death(held, True)``."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            workers = [w for w in self._workers if w is not None]
        for w in workers:
            if kill:
                w.proc.kill()
            else:
                self._send(w, b"")
        for w in workers:
            w.proc.join(timeout=timeout)
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join(timeout=timeout)
        self._wake_w.send_bytes(b"x")
        self._reader.join(timeout=timeout)
        with self._lock:
            for k, w in enumerate(self._workers):
                if w is not None:
                    w.conn.close()
                    self._workers[k] = None
        self._wake_r.close()
        self._wake_w.close()


__all__ = ["ForkedWorkers"]
