"""Cross-file batching: pending pieces of many files -> batches -> each file's piece results.

State: the prepared files in progress (:class:`FileState`: samples float32 ``[N]``, pieces
``[(start, end)]`` in samples, the file's resolved :class:`~flashasr.options.TranscribeOptions`,
one result slot per piece) and the pending pieces ``(file number, piece number)`` in arrival order.

* :meth:`Batcher.take_batch`: the oldest pending piece plus the ``batch_size - 1`` pending pieces
  of the same :attr:`~flashasr.options.TranscribeOptions.decoding` (language, task, word
  timestamps; any file) closest to it in length. Batches are length-homogeneous (little padding)
  and no file waits behind later ones. Cost: O(P log P) for P pending pieces.
* :meth:`Batcher.complete`: a batch's results (from the model thread,
  :class:`~flashasr.jobs.model_worker.ModelWorker`, one :func:`flashasr.pipeline.transcribe_pieces`
  call: a failing batch is redone piece by piece there, so a bad piece fails only its file) routed
  to their files; the files whose last piece is now done are returned (and forgotten here).

Batched results equal per-file results because every piece is transcribed on its own by the
model contract of :meth:`~flashasr.models.base.ASRModel.transcribe_batch`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..options import TranscribeOptions
from ..types import Transcript
from .feeder import error_of
from .inputs import InputItem


class Waves(list):
    """A batch's waveforms (views of the files' samples) and, as ``speech``, each piece's VAD speech
    spans (:attr:`flashasr.pipeline.plan.Piece.speech`; None where unknown): what the model thread
    hands to :func:`flashasr.pipeline.transcribe_pieces`."""

    def __init__(self, waves=(), speech=None):
        super().__init__(waves)
        self.speech = list(speech) if speech is not None else [None] * len(self)


@dataclass
class FileState:
    """A prepared file between its decode and its output. ``results[k]`` is piece ``k``'s
    transcript (None until done, or when it failed); ``error`` the first failure
    ``(code, message)``; ``t0`` ``time.perf_counter()`` at the start of its decode; ``warnings``
    what its decode tolerated (:meth:`flashasr.audio.DecodedAudio.damage`), None when the decode
    did not say (the finisher then checks the header's duration itself)."""

    idx: int
    item: InputItem
    options: TranscribeOptions
    samples: np.ndarray
    pieces: list[tuple[int, int]]
    t0: float
    warnings: list[dict] | None = None
    results: list[Transcript | None] = field(init=False)
    remaining: int = field(init=False)
    n_samples: int = field(init=False)
    error: tuple[str, str] | None = None

    def __post_init__(self):
        self.n_samples = int(self.samples.size)
        self.results = [None] * len(self.pieces or ())
        self.remaining = len(self.pieces or ())

    def planned(self, pieces: list[tuple[int, int]]) -> None:
        """Its pieces, once planned in the main process."""
        self.pieces = pieces
        self.results = [None] * len(pieces)
        self.remaining = len(pieces)

    def drop_audio(self) -> int:
        """Free the samples once the model is done with them (a shared-memory segment's kept name
        goes too, :func:`flashasr.shm.release`); returns how many there were."""
        from ..shm import release

        release(self.samples)
        self.samples = np.empty(0, np.float32)
        return self.n_samples


class Batcher:
    """Pending pieces of many files, formed into batches and routed back (main thread only).

    Attributes:
        batch_pieces: pieces per batch, in the order batches were taken.
    """

    def __init__(self, batch_size: int):
        self.batch_size = int(batch_size)
        self.active: dict[int, FileState] = {}
        self.pending: list[tuple[int, int]] = []
        self.batch_pieces: list[int] = []

    def add(self, st: FileState) -> None:
        """A prepared file with at least one piece: its pieces join the pending pool."""
        self.active[st.idx] = st
        self.pending.extend((st.idx, k) for k in range(len(st.pieces)))

    def full(self) -> bool:
        return len(self.pending) >= self.batch_size

    def _length(self, fi: int, pi: int) -> int:
        a, b = self.active[fi].pieces[pi]
        return b - a

    def take_batch(self) -> tuple[list[tuple[int, int]], TranscribeOptions, Waves]:
        """Remove and return the next batch (see the module docstring), its options and its
        waveforms (views of the files' samples, with the pieces' speech spans: :class:`Waves`)."""
        head = self.pending[0]
        options = self.active[head[0]].options
        hl = self._length(*head)
        cands = sorted((abs(self._length(fi, pi) - hl), k) for k, (fi, pi) in enumerate(self.pending[1:], start=1)
                       if self.active[fi].options.decoding == options.decoding)
        chosen = {0} | {k for _, k in cands[: self.batch_size - 1]}
        batch = [p for k, p in enumerate(self.pending) if k in chosen]
        self.pending = [p for k, p in enumerate(self.pending) if k not in chosen]
        self.batch_pieces.append(len(batch))
        waves = Waves()
        for fi, pi in batch:
            piece = self.active[fi].pieces[pi]
            a, b = piece
            waves.append(self.active[fi].samples[a:b])
            waves.speech.append(getattr(piece, "speech", None))
        return batch, options, waves

    def complete(self, batch: list[tuple[int, int]], outs: list) -> list[FileState]:
        """Route a batch's results (a Transcript or the exception of each piece) to their files;
        returns the files it completed, in batch order (and forgets them)."""
        done = []
        for (fi, pi), out in zip(batch, outs):
            st = self.active[fi]
            if isinstance(out, BaseException):
                if st.error is None:
                    code, msg = error_of(out, st.item.path)
                    st.error = (code, f"{st.item.display}: model failed: {msg}")
                out = None
            st.results[pi] = out
            st.remaining -= 1
            if st.remaining == 0:
                del self.active[fi]
                done.append(st)
        return done


__all__ = ["Batcher", "FileState", "Waves"]
