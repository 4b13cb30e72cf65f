"""Pieces through the model, in batches, with per-input failure isolation.

One home for the rule both the server's scheduler and the job runner follow: a batch is one
``model.transcribe_batch`` call; if that call raises, each piece is run alone, so one bad piece
fails alone and its batch mates still get their transcripts (the model contract says batched
results equal per-input results, so nothing else changes).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..errors import FlashASRError
from ..models.base import as_waveform
from ..options import TranscribeOptions
from ..types import Transcript


def speech_kw(model, speech) -> dict:
    """``{"speech": speech}`` for a model that uses the pieces' speech spans (``uses_speech``) when
    any is known, else ``{}`` (so models and test doubles without the argument are called as before)."""
    if speech is None or not getattr(model, "uses_speech", False) or all(s is None for s in speech):
        return {}
    return {"speech": list(speech)}


def transcribe_pieces(model, waveforms: Sequence[np.ndarray], options: TranscribeOptions,
                      speech: Sequence | None = None, *, checked: bool = False) -> list[Transcript | BaseException]:
    """Transcribe waveforms that share ``options.decoding`` in one model call.

    Args:
        model: an :class:`~flashasr.models.base.ASRModel`.
        waveforms: float32 ``[N_i]`` pieces at the model's rate.
        options: the pieces' (resolved) options.
        speech: per piece its VAD speech spans (:attr:`flashasr.pipeline.plan.Piece.speech`) or None.
        checked: the pieces already passed :func:`~flashasr.models.base.as_waveform` (see
            :meth:`~flashasr.models.base.ASRModel.transcribe_batch`).
    Returns:
        per input its :class:`~flashasr.types.Transcript`, or the exception it raised when run
        alone (``KeyboardInterrupt`` is never caught).
    """
    waves = list(waveforms)
    if not waves:
        return []
    if getattr(model, "isolates_pieces", False):  # the model process: the same rule, applied over there
        return model.run_pieces(waves, options, speech)
    spans = list(speech) if speech is not None else [None] * len(waves)
    ck = {"checked": True} if checked else {}  # models of other shapes keep working (tests' stand-ins)
    try:
        got = model.transcribe_batch(waves, options, **ck, **speech_kw(model, spans))
        if len(got) != len(waves):
            raise FlashASRError(f"transcribe_batch returned {len(got)} results for {len(waves)} inputs")
        return list(got)
    except Exception as e:  # noqa: BLE001 - isolated below
        if len(waves) == 1:
            return [e]
    out: list[Transcript | BaseException] = []
    for i, (w, sp) in enumerate(zip(waves, spans)):
        try:
            if not checked:  # a bad piece's error names its place in the call (alone it is "waveform 0")
                as_waveform(w, f"waveform {i}")
            out.append(model.transcribe_batch([w], options, **ck, **speech_kw(model, [sp]))[0])
        except Exception as e:  # noqa: BLE001 - this piece's own failure
            out.append(e)
    return out


class StartedPieces:
    """A :func:`transcribe_pieces` call begun by :func:`start_pieces`; :meth:`result` gives what
    :func:`transcribe_pieces` gives (the same isolation of failing pieces)."""

    def __init__(self, out: list | None = None, *, submitted=None, redo=None):
        self._out, self._submitted, self._redo = out, submitted, redo

    @property
    def on_device(self) -> bool:
        """Whether the call was queued on the device and its result is not read yet (False: it ran
        at once, its result is there)."""
        return self._out is None

    def encoded(self) -> bool:
        """Whether its encoder work is done (a call run at once: True; does not block): a good
        moment to answer it when no next call is there to start behind it."""
        if self._submitted is None:
            return True
        try:
            return self._submitted.encoded()
        except Exception:  # noqa: BLE001 - result() says what went wrong
            return True

    def result(self) -> list[Transcript | BaseException]:
        if self._out is None:
            try:
                got = self._submitted.result()
                if len(got) != self._redo[1]:
                    raise FlashASRError(f"submit_batch returned {len(got)} results for {self._redo[1]} inputs")
                self._out = list(got)
            except Exception:  # noqa: BLE001 - redone with the per-piece isolation
                self._out = self._redo[0]()
            self._submitted = self._redo = None
        return self._out


def start_pieces(model, waveforms: Sequence[np.ndarray], options: TranscribeOptions,
                 speech: Sequence | None = None, *, checked: bool = False) -> StartedPieces:
    """:func:`transcribe_pieces` whose device work may still be running when this returns.

    A model with ``submit_batch`` (Parakeet on the GPU engine: :meth:`ParakeetGPUASR.submit_batch
    <flashasr.engine.parakeet_gpu.ParakeetGPUASR.submit_batch>`) gets the batch queued on the
    device; a call started before the previous one's ``result()`` is read has its encoders follow
    that one's without a gap. Any other model runs the whole call now. A batch that fails is redone
    by :func:`transcribe_pieces` (each piece alone) when its result is asked for. Arguments as
    :func:`transcribe_pieces`.
    """
    waves = list(waveforms)
    submit = getattr(model, "submit_batch", None)
    if waves and submit is not None and not getattr(model, "isolates_pieces", False):

        def redo():
            return transcribe_pieces(model, waves, options, speech, checked=checked)
        try:
            return StartedPieces(submitted=submit(waves, options, checked=checked), redo=(redo, len(waves)))
        except Exception:  # noqa: BLE001 - isolated below
            pass
    return StartedPieces(transcribe_pieces(model, waves, options, speech, checked=checked))


__all__ = ["transcribe_pieces", "start_pieces", "StartedPieces", "speech_kw"]
