"""The pipeline between the doors and the models: plan pieces, transcribe them, merge them.

Every door (``flashasr transcribe`` and the job runner, ``flashasr.transcribe``, the HTTP
server, its streaming sessions) goes through these steps::

    samples float32 [N] ──plan_pieces──► [(start, end)] ──transcribe_pieces──► [Transcript per piece]
        (CPU workers: VAD)                  (model thread, batched across          │
                                             pieces of many recordings)            ▼
                                                           merge_pieces ──► Transcript (global times)

* :mod:`.plan`: the one segmentation policy (``vad`` / ``fixed`` / ``none``);
* :mod:`.run`: pieces through the model in batches, one bad piece failing alone;
* :mod:`.merge`: the one merger;
* :mod:`.engines`: the one place that picks the engine for a model on a device, and the loader.

Models transcribe exactly what they are given and never cut. :func:`transcribe_samples` is the
whole path in one process (the Python API); the job runner and the server run the same three
steps in their own workers and threads.
"""

from __future__ import annotations

import numpy as np

from ..options import TranscribeOptions
from ..types import Transcript
from .engines import accelerate, cached_model, gpu_engine_enabled, load_model
from .merge import merge_pieces
from .plan import (Piece, Splitter, default_vad_device, needs_vad, piece_limit_s, plan_many, plan_pieces,
                   quiet_split)
from .run import speech_kw, transcribe_pieces


def transcribe_samples(model, samples: np.ndarray, options: TranscribeOptions | None = None, *,
                       split: Splitter | None = None, vad_device: str | None = None, warnings=()) -> Transcript:
    """One recording through the whole pipeline in this process.

    Args:
        model: an :class:`~flashasr.models.base.ASRModel`.
        samples: float32 ``[N]`` at ``model.sample_rate``.
        options: :class:`~flashasr.options.TranscribeOptions` (checked against the model here).
        split: replaces the VAD splitter (see :func:`.plan.plan_pieces`).
        vad_device: where the VAD runs (None: :func:`.plan.default_vad_device` of the model's
            device, the rule of every door).
        warnings: the recording's own (a damaged input), first in the transcript's ``warnings``.
    Returns:
        the merged :class:`~flashasr.types.Transcript`; ``duration = N / sample_rate``.
    Raises:
        AudioError (``invalid_audio``), UnsupportedLanguageError, UnsupportedTaskError, and whatever
        the model raises for a piece.
    """
    from ..models.base import as_waveform

    caps = model.capabilities
    opts = (options or TranscribeOptions()).resolve(caps)
    x = as_waveform(samples)
    if vad_device is None:
        vad_device = default_vad_device(getattr(model, "device", "cpu"))
    pieces = plan_many([x], opts, caps, vad_device=vad_device, split=split)[0]
    outs = model.transcribe_batch([x[a:b] for a, b in pieces], opts,
                                  **speech_kw(model, [getattr(p, "speech", None) for p in pieces])) if pieces else []
    sr = caps.sample_rate
    return merge_pieces([(a / sr, t) for (a, _b), t in zip(pieces, outs)], x.size / sr, options=opts, caps=caps,
                        warnings=warnings)


__all__ = ["transcribe_samples", "Piece", "speech_kw", "plan_pieces", "plan_many", "default_vad_device", "needs_vad", "piece_limit_s", "quiet_split", "Splitter",
           "transcribe_pieces", "merge_pieces", "accelerate", "gpu_engine_enabled", "load_model", "cached_model"]
