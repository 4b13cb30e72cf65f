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
    for w, sp in zip(waves, spans):
        try:
            out.append(model.transcribe_batch([w], options, **ck, **speech_kw(model, [sp]))[0])
        except Exception as e:  # noqa: BLE001 - this piece's own failure
            out.append(e)
    return out


__all__ = ["transcribe_pieces", "speech_kw"]
