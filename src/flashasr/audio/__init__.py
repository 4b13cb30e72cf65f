"""Audio input for flashasr: decode anything FFmpeg reads (PyAV, in-process) to 16 kHz mono
float32 with soxr HQ resampling and an energy-keeping downmix; raw PCM and numpy input;
streaming blocks for long audio; Silero VAD (offline segments, ASR splitting, streaming).

Public API::

    from flashasr.audio import load_audio, iter_audio, probe, DecodedAudio
    from flashasr.audio import load_audio_parallel  # one long file on several cores, same result
    from flashasr.audio import speech_segments, split_for_asr, StreamingVAD   # VAD (lazy)
    from flashasr.audio import iter_asr_chunks   # long inputs: decode + VAD split, bounded memory
    from flashasr.audio import encode_audio                                   # tests/bench

See docs/AUDIO.md.
"""

from __future__ import annotations

from .decode import RAW_FORMATS, DecodedAudio, iter_audio, load_audio, probe
from .downmix import Downmixer
from .encode import encode_audio
from .parallel import default_workers as default_decode_workers
from .parallel import load_audio_parallel
from .errors import (
    AudioArgumentError,
    AudioError,
    AudioFileNotFoundError,
    AudioTooLongError,
    CorruptAudioError,
    EmptyAudioError,
    NoAudioStreamError,
    UnsupportedFormatError,
    UnsupportedSampleRateError,
)

_VAD_NAMES = {"speech_segments", "split_for_asr", "iter_asr_chunks", "StreamingVAD", "VADEvent",
              "speech_probabilities"}


def __getattr__(name):  # lazy: importing the VAD loads onnxruntime
    if name in _VAD_NAMES:
        from . import vad

        return getattr(vad, name)
    raise AttributeError(f"module 'flashasr.audio' has no attribute {name!r}")


__all__ = [
    "load_audio",
    "load_audio_parallel",
    "default_decode_workers",
    "iter_audio",
    "probe",
    "DecodedAudio",
    "RAW_FORMATS",
    "Downmixer",
    "encode_audio",
    "speech_segments",
    "split_for_asr",
    "iter_asr_chunks",
    "speech_probabilities",
    "StreamingVAD",
    "VADEvent",
    "AudioError",
    "AudioArgumentError",
    "AudioFileNotFoundError",
    "AudioTooLongError",
    "CorruptAudioError",
    "EmptyAudioError",
    "NoAudioStreamError",
    "UnsupportedFormatError",
    "UnsupportedSampleRateError",
]
