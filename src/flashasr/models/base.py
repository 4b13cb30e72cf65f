"""The interface every model family implements (Whisper, Parakeet-TDT).

Data flow: waveform (float32, 16 kHz mono, shape [N]) -> features -> encoder ->
decoder -> :class:`~flashasr.types.Transcript` with global timestamps in seconds.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

import numpy as np

from ..types import Transcript

SAMPLE_RATE = 16_000


class ASRModel(ABC):
    """A loaded speech-to-text model.

    Attributes:
        name: human-readable model name (e.g. ``whisper-tiny.en``, ``parakeet-tdt``).
        family: ``"whisper"`` or ``"parakeet"``.
        sample_rate: input sample rate in Hz (16000 for both families).
        max_segment_seconds: the longest audio the model takes in one encoder pass
            (30.0 for Whisper); callers may cut long audio at pauses to at most this.
        multilingual: whether ``language=None`` triggers language detection.
        device: torch device string the weights live on.
    """

    name: str = "model"
    family: str = "unknown"
    sample_rate: int = SAMPLE_RATE
    max_segment_seconds: float = 30.0
    multilingual: bool = False
    translates: bool = False  # task="translate" supported (multilingual Whisper)
    device: str = "cpu"

    @abstractmethod
    def transcribe_waveform(
        self,
        waveform: np.ndarray,
        *,
        language: str | None = None,
        word_timestamps: bool = False,
        task: str = "transcribe",
    ) -> Transcript:
        """Transcribe one utterance or long recording of any length.

        Args:
            waveform: float32 array, shape [N] samples at ``sample_rate`` Hz, values in [-1, 1].
            language: ISO 639-1 code, or None to detect (multilingual models) / use the model's.
            word_timestamps: also fill ``Transcript.words``.
            task: ``"transcribe"`` or ``"translate"`` (English text from speech in any language;
                models with ``translates = True`` only, else :class:`~flashasr.errors.UnsupportedTaskError`).
        Returns:
            Transcript with ``duration = N / sample_rate`` seconds and all times in [0, duration].
        """

    def transcribe_batch(
        self,
        waveforms: Sequence[np.ndarray],
        *,
        language: str | None = None,
        word_timestamps: bool = False,
        task: str = "transcribe",
    ) -> list[Transcript]:
        """Transcribe several waveforms; the default runs them one by one.

        Engines override this to batch across inputs; the result must equal the
        per-input result (same text, timestamps within one frame).
        """
        return [self.transcribe_waveform(w, language=language, word_timestamps=word_timestamps, task=task)
                for w in waveforms]
