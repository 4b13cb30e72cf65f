"""flashasr: fast, correct speech-to-text for Parakeet-TDT and Whisper.

Python API::

    import flashasr
    t = flashasr.transcribe("clip.wav")               # embedded whisper tiny.en
    print(t.text, t.language, t.duration)
    for s in t.segments: print(s.start, s.end, s.text)
"""

from __future__ import annotations

from .errors import FlashASRError
from .types import Segment, Transcript, Word

__version__ = "0.1.0"


def load_model(spec=None, *, device: str = "cpu", dtype: str | None = None):
    """Load a model; see :func:`flashasr.models.registry.load_model`."""
    from .models.registry import load_model as _load

    return _load(spec, device=device, dtype=dtype)


def transcribe(audio, *, model=None, language: str | None = None, word_timestamps: bool = False,
               sample_rate: int | None = None, device: str = "cpu") -> Transcript:
    """Transcribe one input.

    Args:
        audio: a path (any container FFmpeg reads), raw ``bytes`` of a file, or a numpy
            float32 array of samples (shape [N] or [N, channels]; ``sample_rate`` required).
        model: a loaded :class:`~flashasr.models.base.ASRModel`, a model spec for
            :func:`load_model`, or None for the embedded whisper tiny.en.
        language: ISO 639-1 code; None detects it (multilingual models).
        word_timestamps: fill ``Transcript.words``.
    Returns:
        :class:`~flashasr.types.Transcript` (text, language, duration in seconds, segments, words).
    Raises:
        flashasr.errors.AudioError (and subclasses) for undecodable input;
        flashasr.errors.ModelLoadError for a bad model spec.
    """
    from .audio import load_audio
    from .models.base import ASRModel
    from .models.registry import cached_model

    m = model if isinstance(model, ASRModel) else cached_model(None if model is None else str(model), device)
    wav = load_audio(audio, sample_rate=sample_rate, target_rate=m.sample_rate)
    t = m.transcribe_waveform(wav.samples, language=language, word_timestamps=word_timestamps)
    t.duration = wav.duration
    return t


__all__ = ["transcribe", "load_model", "Transcript", "Segment", "Word", "FlashASRError", "__version__"]
