"""Audio-specific error subclasses (all subclass :class:`flashasr.errors.AudioError`).

The shared classes in :mod:`flashasr.errors` (``EmptyAudioError``, ``NoAudioStreamError``,
``UnsupportedFormatError``, ``AudioTooLongError``) cover most bad inputs; the ones here
name a few more cases precisely. Every class has a stable ``code`` and HTTP ``status`` 400.
"""

from __future__ import annotations

from ..errors import (  # re-exported for convenience
    AudioError,
    AudioTooLongError,
    EmptyAudioError,
    NoAudioStreamError,
    UnsupportedFormatError,
)


class AudioFileNotFoundError(AudioError, FileNotFoundError):
    """The input path does not exist (also a ``FileNotFoundError`` for plain-Python callers)."""

    code = "audio_file_not_found"


class CorruptAudioError(AudioError):
    """An audio stream was found but not one of its packets could be decoded."""

    code = "corrupt_audio"


class UnsupportedSampleRateError(UnsupportedFormatError):
    """The input's sample rate is outside what any recording uses
    (:data:`flashasr.audio.decode.SOURCE_RATES`): a damaged or hostile header. 2^31-1 Hz made a
    file's samples a few microseconds of audio (an empty transcript); 1 Hz made a 32 KB upload
    hours of audio."""

    code = "unsupported_sample_rate"


class AudioArgumentError(AudioError, ValueError):
    """The call itself is inconsistent: e.g. a numpy array without ``sample_rate``, raw PCM
    without ``channels``, an unknown ``raw_format``, an array of shape [C, N]."""

    code = "invalid_audio_argument"


__all__ = [
    "AudioError",
    "AudioTooLongError",
    "EmptyAudioError",
    "NoAudioStreamError",
    "UnsupportedFormatError",
    "AudioFileNotFoundError",
    "CorruptAudioError",
    "AudioArgumentError",
    "UnsupportedSampleRateError",
]
