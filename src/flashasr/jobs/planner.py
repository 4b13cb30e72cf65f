"""The job's planner thread: decoded files -> their pieces, the VAD of many files batched on the GPU.

When the VAD runs on the GPU (:func:`flashasr.pipeline.plan_many` with a CUDA ``vad_device``), the
decode workers only decode, and this thread plans every file decoded since its last round in one
call: one batched Silero computation on its own CUDA stream, then the cutting on the CPU. It runs
beside the conductor and the model thread, so a VAD round never holds up the hand-over of the next
batch to the GPU (before it was its own thread, the conductor waited for each VAD round: the model
was busy 46 % of the job, ``bench/results/offline_e2e_h200_shm.json``).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable

from ..options import ModelCapabilities, TranscribeOptions
from ..pipeline import plan_many, plan_pieces
from .batcher import FileState
from .feeder import error_of
from .interrupts import join


class Planner:
    """One thread that plans the pieces of decoded files (see the module docstring).

    Args:
        options, caps: the job's resolved options and the model's capabilities.
        vad_device: the device of the batched VAD (a CUDA device).
        wake: set whenever a round is done (the conductor waits on it).
        split: the VAD splitter hook of :func:`flashasr.pipeline.plan_pieces` (tests).

    Attributes:
        cpu_s: CPU seconds of this thread (the job report's VAD stage); ``in_flight``: files
        handed over and not yet taken back.
    """

    def __init__(self, options: TranscribeOptions, caps: ModelCapabilities, *, vad_device: str,
                 wake: threading.Event, split: Callable | None = None):
        self.options, self.caps, self.vad_device, self.split = options, caps, vad_device, split
        self.wake = wake
        self.cpu_s = 0.0
        self.in_flight = 0
        self.error: BaseException | None = None
        self._todo: deque = deque()
        self._done: deque = deque()
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="flashasr-planner", daemon=True)
        self._thread.start()

    def submit(self, states: list[FileState]) -> None:
        """Files to plan (their ``pieces`` None)."""
        if not states:
            return
        self.in_flight += len(states)
        with self._cv:
            self._todo.extend(states)
            self._cv.notify()

    def take_done(self) -> list[FileState]:
        """Files planned since the last call (``pieces`` set; empty: no speech).

        Raises:
            the error that stopped the thread.
        """
        with self._cv:
            got = list(self._done)
            self._done.clear()
        self.in_flight -= len(got)
        if self.error is not None:
            raise self.error
        return got

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        join(self._thread)  # in slices: a Ctrl-C meanwhile is noted at once (jobs.interrupts)

    def _plan(self, states: list[FileState]) -> None:
        try:
            plans = plan_many([st.samples for st in states], self.options, self.caps, vad_device=self.vad_device,
                              split=self.split)
        except Exception:  # noqa: BLE001 - one file's trouble must not fail the others: each alone, on the CPU
            plans = []
            for st in states:
                try:
                    plans.append(plan_pieces(st.samples, self.options, self.caps, split=self.split))
                except Exception as e:  # noqa: BLE001 - this file's own failure
                    code, msg = error_of(e, st.item.path)
                    st.error = (code, f"{st.item.display}: cannot cut into pieces: {msg}")
                    plans.append([])
        for st, pieces in zip(states, plans):
            st.planned(pieces)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._todo and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                states = list(self._todo)
                self._todo.clear()
            c0 = time.thread_time()
            try:
                self._plan(states)
            except BaseException as e:  # noqa: BLE001 - re-raised in the conductor
                self.error = e
                self.wake.set()
                return
            self.cpu_s += time.thread_time() - c0
            with self._cv:
                self._done.extend(states)
            self.wake.set()


__all__ = ["Planner"]
