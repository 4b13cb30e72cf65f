"""The front end's CPU pool: decode and VAD work of requests, short requests' work first.

A plain thread pool runs its jobs in arrival order, so a short upload's decode or VAD waited behind
every long upload's that came before it: on the H200 (multi mode, one front end, 2 CPU threads) a
2.97 s upload took 19.0 s to answer while 32 uploads of 600 s were being cut
(``bench/results/final_latency_h200.json``), although the engine gave it the next model call.
Issue #17 item 4 asks that a short request never wait behind bulk work.

Two queues, one set of threads::

    submit(fn, ..., urgent=True)   ─► urgent deque ─┐
    submit(fn, ...)                ─► bulk deque  ──┴─► each free thread takes the oldest urgent
                                                        job, else the oldest bulk job

A job, once started, runs to its end, so urgent work waits at most for the jobs already running:
bulk work is handed in as small jobs (a long upload's VAD as slices of about a minute of audio,
:func:`flashasr.serve.offline.UploadTranscriber.transcribe`) to keep that wait short. Urgent work
can hold bulk work back only while urgent jobs keep arriving faster than the threads finish them;
each is small by construction (at most ``SHORT_S`` of audio). The threads exist from the start and
their number never changes (``cpu_threads``); at interpreter exit the jobs running finish and
the queued ones are dropped (as :mod:`concurrent.futures` does).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from concurrent.futures import Executor, Future


class CPUPool(Executor):
    """A fixed set of ``n`` threads (named ``name-0`` ...) running submitted callables, urgent ones
    first; a :class:`concurrent.futures.Executor`, so ``loop.run_in_executor(pool, fn)`` works
    (as bulk work).

    Raises:
        ValueError: ``n < 1``.
    """

    def __init__(self, n: int, name: str = "flashasr-cpu"):
        if n < 1:
            raise ValueError(f"a CPU pool needs at least one thread, got {n}")
        self._urgent: deque = deque()
        self._bulk: deque = deque()
        self._cv = threading.Condition()
        self._closed = False
        # not daemons: at interpreter exit the jobs running finish (a model load stopped mid-way by
        # exit aborted the process: "terminate called without an active exception" on a Ctrl-C one
        # second after start), as concurrent.futures' pools do; queued jobs are dropped
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}") for i in range(n)]
        threading._register_atexit(self._at_exit)  # runs before the interpreter joins the threads
        for t in self._threads:
            t.start()

    def submit(self, fn, /, *args, urgent: bool = False, **kwargs) -> Future:
        """Queue ``fn(*args, **kwargs)``; ``urgent`` puts it before every bulk job not yet started.
        Returns its future. Raises RuntimeError after :meth:`shutdown`."""
        f: Future = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("the CPU pool is shut down")
            (self._urgent if urgent else self._bulk).append((f, fn, args, kwargs))
            self._cv.notify()
        return f

    def run(self, fn, /, *args, urgent: bool = False):
        """``await pool.run(fn, *args, urgent=...)``: :meth:`submit` as an awaitable (the running loop's)."""
        return asyncio.wrap_future(self.submit(fn, *args, urgent=urgent))

    def waiting(self) -> tuple[int, int]:
        """Jobs queued and not started: ``(urgent, bulk)``."""
        with self._cv:
            return len(self._urgent), len(self._bulk)

    def _work(self) -> None:
        while True:
            with self._cv:
                while not (self._urgent or self._bulk or self._closed):
                    self._cv.wait()
                if not (self._urgent or self._bulk):
                    return  # shut down and nothing left
                f, fn, args, kwargs = (self._urgent or self._bulk).popleft()
            if not f.set_running_or_notify_cancel():
                continue
            try:
                f.set_result(fn(*args, **kwargs))
            except BaseException as e:  # noqa: BLE001 - handed to whoever awaits the future
                f.set_exception(e)

    def _at_exit(self) -> None:
        self.shutdown(wait=False, cancel_futures=True)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No more jobs; ``cancel_futures`` cancels those not started (else they still run);
        ``wait`` joins the threads."""
        with self._cv:
            self._closed = True
            if cancel_futures:
                for q in (self._urgent, self._bulk):
                    while q:
                        q.popleft()[0].cancel()
            self._cv.notify_all()
        if wait:
            for t in self._threads:
                t.join()


__all__ = ["CPUPool"]
