"""The interface every model family implements (Whisper, Parakeet-TDT).

Data flow: waveform (float32, 16 kHz mono, shape [N]) -> features -> encoder ->
decoder -> :class:`~flashasr.types.Transcript` with global timestamps in seconds.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

import numpy as np

from ..errors import AudioError
from ..types import Transcript

SAMPLE_RATE = 16_000


def as_waveform(w, label: str = "waveform") -> np.ndarray:
    """The one check every model and engine applies to an in-memory waveform.

    Args:
        w: float samples in [-1, 1], shape ``[N]`` (``[1, N]`` / ``[N, 1]`` are flattened);
            numpy array, torch CPU tensor or sequence.
        label: how error messages name the input (e.g. ``"input 3"``).
    Returns:
        contiguous float32 ``[N]`` (the same array when it already is one).
    Raises:
        AudioError (``invalid_audio``): not mono, not a float dtype (int16 PCM must be scaled
            by the caller), or NaN / infinite samples.
    """
    a = np.asarray(w)
    if a.ndim == 2 and 1 in a.shape:
        a = a.reshape(-1)
    if a.ndim != 1:
        raise AudioError(f"{label}: expected mono samples of shape [N], got shape {a.shape}", code="invalid_audio")
    if not np.issubdtype(a.dtype, np.floating):
        raise AudioError(f"{label}: expected float samples in [-1, 1], got dtype {a.dtype}", code="invalid_audio")
    a = np.ascontiguousarray(a, dtype=np.float32)
    with np.errstate(over="ignore"):  # one BLAS pass; |x| > 1e19 squares overflow: then the exact check
        finite = not a.size or np.isfinite(np.dot(a, a)) or np.isfinite(a).all()
    if not finite:
        raise AudioError(f"{label}: contains NaN or infinite samples", code="invalid_audio")
    return a


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
