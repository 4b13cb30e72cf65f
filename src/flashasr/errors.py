"""Error types shared by every layer of flashasr.

Every error carries a stable machine-readable ``code`` (used by the HTTP API's
OpenAI-style error body and by the batch job summary) and a human message that
names the problem. Nothing in flashasr raises a bare ``Exception`` for bad input.
"""

from __future__ import annotations


class FlashASRError(Exception):
    """Base class. ``code`` is a short snake_case identifier; ``status`` the HTTP status."""

    code = "internal_error"
    status = 500

    def __init__(self, message: str, *, code: str | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code

    @property
    def message(self) -> str:
        return str(self)


class AudioError(FlashASRError):
    """Input audio could not be used (bad container, no audio stream, empty, ...)."""

    code = "invalid_audio"
    status = 400


class NoAudioStreamError(AudioError):
    code = "no_audio_stream"


class EmptyAudioError(AudioError):
    code = "empty_audio"


class UnsupportedFormatError(AudioError):
    code = "unsupported_format"


class AudioTooLongError(AudioError):
    code = "audio_too_long"


class ModelLoadError(FlashASRError):
    """A checkpoint is missing, truncated, of an unknown architecture or has mismatched tensors."""

    code = "model_load_error"
    status = 500


class UnsupportedModelError(ModelLoadError):
    code = "unsupported_model"
