"""Error types shared by every layer of flashasr.

Every error carries a stable machine-readable ``code`` (used by the HTTP API's
OpenAI-style error body and by the batch job summary) and a human message that
names the problem. Nothing in flashasr raises a bare ``Exception`` for bad input.
"""

from __future__ import annotations

import argparse


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


#: a sample beyond this magnitude (full scale is 1) is not audio: the decoders clip a file's such
#: samples to +-1 as damage; :func:`flashasr.models.base.as_waveform` refuses an array with them
ABSURD_SAMPLE = 1e4


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


class UnsupportedTaskError(FlashASRError):
    """The model cannot do the requested task (e.g. ``translate`` on Parakeet or an English-only
    Whisper model)."""

    code = "unsupported_task"
    status = 400


class UnsupportedLanguageError(FlashASRError):
    """The model cannot take the requested language (an English-only model, or a code outside its
    vocabulary)."""

    code = "unsupported_language"
    status = 400


class InvalidRequestError(FlashASRError):
    """A request's option is malformed (a language that is not a code, an unknown segmentation, a
    negative length, ...). ``param`` names the option at fault (OpenAI's error ``param``)."""

    code = "invalid_request"
    status = 400

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None):
        super().__init__(message, code=code)
        self.param = param


class ModelLoadError(FlashASRError):
    """A checkpoint is missing, truncated, of an unknown architecture or has mismatched tensors."""

    code = "model_load_error"
    status = 500


class UnsupportedModelError(ModelLoadError):
    code = "unsupported_model"


class UsageParser(argparse.ArgumentParser):
    """:class:`argparse.ArgumentParser` whose usage errors (a bad value, an unknown option, a
    missing argument) are one ``error: [invalid_option] <prog>: <message>; see <prog> --help``
    line on stderr and exit code 2, as every other refusal of the command line
    (:func:`print_error`), instead of argparse's usage block. Subparsers inherit the class."""

    def error(self, message: str):  # noqa: D401 - argparse's hook
        print_error("invalid_option", f"{self.prog}: {message}; see {self.prog} --help")
        raise SystemExit(2)


def print_error(code: str, message: str) -> None:
    """Say why a command-line door stops, the one way all of them do (``flashasr transcribe``,
    ``flashasr eval``, ...): one ``error: [code] message`` line on stderr, lowercase ``error:`` as
    argparse's own usage errors; ``code`` is the error's stable code (:attr:`FlashASRError.code`)."""
    import sys

    print(f"error: [{code}] {message}", file=sys.stderr, flush=True)
