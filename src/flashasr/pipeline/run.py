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


def transcribe_pieces(model, waveforms: Sequence[np.ndarray],
                      options: TranscribeOptions) -> list[Transcript | BaseException]:
    """Transcribe waveforms that share ``options.decoding`` in one model call.

    Args:
        model: an :class:`~flashasr.models.base.ASRModel`.
        waveforms: float32 ``[N_i]`` pieces at the model's rate.
        options: the pieces' (resolved) options.
    Returns:
        per input its :class:`~flashasr.types.Transcript`, or the exception it raised when run
        alone (``KeyboardInterrupt`` is never caught).
    """
    waves = list(waveforms)
    if not waves:
        return []
    try:
        got = model.transcribe_batch(waves, options)
        if len(got) != len(waves):
            raise FlashASRError(f"transcribe_batch returned {len(got)} results for {len(waves)} inputs")
        return list(got)
    except Exception as e:  # noqa: BLE001 - isolated below
        if len(waves) == 1:
            return [e]
    out: list[Transcript | BaseException] = []
    for w in waves:
        try:
            out.append(model.transcribe_batch([w], options)[0])
        except Exception as e:  # noqa: BLE001 - this piece's own failure
            out.append(e)
    return out


__all__ = ["transcribe_pieces"]
