"""Ctrl-C and SIGTERM during a job of :func:`~flashasr.jobs.run_job`: where they are acted on.

Python's SIGINT handler raises KeyboardInterrupt in the main thread between any two bytecodes. In a
job that moment can be inside the job's own machinery, and two such moments went wrong (each made
deterministic in ``tests/test_jobs_report.py``):

* a decode's completion callback that the main thread ran itself (the decode was done before the
  callback was attached) took the KeyboardInterrupt for that file's failure: the job ran on and
  returned ``interrupted`` False;
* a second Ctrl-C between the first one's ``except`` and the wind-down's own handlers escaped
  ``run_job``: no wind-down, the journal not compacted, shared memory kept.

So while a job runs, :class:`JobInterrupts` handles the signals whose handler raises
KeyboardInterrupt (Python's ``signal.default_int_handler``: SIGINT, and SIGTERM where the caller made
it so, as ``flashasr transcribe`` does) and decides where the interrupt is raised:

=============  ===============================================================================
phase          a SIGINT / SIGTERM
=============  ===============================================================================
running        the first: noted (``report.interrupted``), raised as KeyboardInterrupt at once if
               the conductor is waiting (:meth:`JobInterrupts.wait`), else at its next turn
               (:meth:`JobInterrupts.check`); any later one: noted, and ``abandon`` called (the
               second Ctrl-C gives a hung model process up: it is killed)
winding down   (:meth:`JobInterrupts.hold`; SIGINT and SIGTERM, unless ignored) every one: noted,
               ``abandon`` called; never raised, so the clean-up always runs to its end
=============  ===============================================================================

A signal whose handler is something else (ignored, the default action, a caller's own handler) is
left alone while the job runs. Signals reach only the main thread's handlers; in any other thread
the class changes nothing. The main thread's waits in the wind-down are joins in slices
(:func:`join`), so a handler runs within :data:`POLL_S` even when the kernel delivered the signal to
another thread (then the main thread's blocked wait is not interrupted).
"""

from __future__ import annotations

import signal
import threading
from typing import Callable

#: Longest a thread join of the main thread goes without running the signal handlers (seconds).
POLL_S = 0.1


def join(thread: threading.Thread, poll_s: float = POLL_S) -> None:
    """``thread.join()`` in slices of ``poll_s`` seconds: a pending signal handler (a Ctrl-C noted
    by :class:`JobInterrupts`) runs between them, whichever thread the kernel gave the signal to."""
    while thread.is_alive():
        thread.join(poll_s)


class JobInterrupts:
    """The job's SIGINT/SIGTERM handler for one :func:`~flashasr.jobs.run_job` (see the module docstring).

    Args:
        report: the job's report; a signal sets its ``interrupted``.
        abandon: called for each signal after the first (and each one while winding down); a model
            process's ``kill``, or None.
        stop: an event any thread may set to stop the job as the first signal does, without a signal
            (``flashasr transcribe`` when the reader of its stdout goes away); seen at the conductor's
            next turn.

    Use as a context manager around the job (the handlers are put back at its end); the conductor
    calls :meth:`check` each turn and waits through :meth:`wait`; the wind-down begins with
    :meth:`hold`.
    """

    def __init__(self, report, abandon: Callable[[], None] | None = None, stop: threading.Event | None = None):
        self.report, self.abandon, self.stop = report, abandon, stop
        self.requested = False  # a stop was asked for (a signal came while running)
        self._waiting = False  # the conductor waits: the first signal is raised there at once
        self._before: dict[int, object] = {}  # signal -> the handler it had before the job

    def __enter__(self) -> "JobInterrupts":
        for s in (signal.SIGINT, signal.SIGTERM):
            self._take(s, lambda h: h is signal.default_int_handler)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._before.items():
            signal.signal(s, h)
        self._before.clear()

    def _take(self, s: int, wanted: Callable[[object], bool]) -> None:
        if s in self._before or threading.current_thread() is not threading.main_thread():
            return
        try:
            h = signal.getsignal(s)
            if wanted(h):
                self._before[s] = signal.signal(s, self._handle)
        except (ValueError, OSError):  # not the main interpreter, or no such signal here
            pass

    def _handle(self, signum, frame) -> None:
        self.report.interrupted = True
        if not self.requested:
            self.requested = True
            if self._waiting:
                self._waiting = False
                raise KeyboardInterrupt
            return
        if self.abandon is not None:
            self.abandon()

    def check(self) -> None:
        """Raise KeyboardInterrupt if a stop was asked for (the conductor, once per turn): by a signal,
        or by ``stop`` set from any thread (then noted as a signal's: ``report.interrupted``)."""
        if not self.requested and self.stop is not None and self.stop.is_set():
            self.requested = self.report.interrupted = True
        if self.requested:
            raise KeyboardInterrupt

    def wait(self, fn: Callable[..., bool], *args) -> bool:
        """``fn(*args)`` (a bounded wait) with the first signal raised inside it at once; a stop
        asked for before it is raised without waiting."""
        self._waiting = True
        try:
            self.check()  # a signal noted just before the line above
            return fn(*args)
        finally:
            self._waiting = False

    def hold(self) -> None:
        """The wind-down begins: from here every SIGINT and SIGTERM (unless ignored) is noted,
        ``abandon`` called, nothing raised, until the context ends."""
        self.requested = True
        self._waiting = False
        for s in (signal.SIGINT, signal.SIGTERM):
            self._take(s, lambda h: h not in (signal.SIG_IGN, None))


__all__ = ["JobInterrupts", "join", "POLL_S"]
