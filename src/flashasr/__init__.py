"""flashasr: fast, correct speech-to-text for Parakeet-TDT and Whisper.

Python API::

    import flashasr
    t = flashasr.transcribe("clip.wav")               # embedded whisper tiny.en
    print(t.text, t.language, t.duration)
    for s in t.segments: print(s.start, s.end, s.text)
"""

from __future__ import annotations

from .errors import FlashASRError
from .options import TranscribeOptions
from .types import Segment, Transcript, Word

__version__ = "0.1.0"


def load_model(spec=None, *, device: str = "cpu", dtype: str | None = None, engine: str = "auto"):
    """Load a model and put it behind its engine (the GPU engines on CUDA; ``engine="plain"`` keeps
    plain PyTorch); see :func:`flashasr.pipeline.engines.load_model` for the specs."""
    from .pipeline.engines import load_model as _load

    return _load(spec, device=device, dtype=dtype, engine=engine)


def transcribe(audio, *, model=None, options: TranscribeOptions | None = None, sample_rate: int | None = None,
               device: str = "cpu", **changes) -> Transcript:
    """Transcribe one input through the pipeline every door uses (cut at pauses, batched, merged).

    Args:
        audio: a path (any container FFmpeg reads; one of 60 s or more is decoded by several
            threads, ``$FLASHASR_DECODE_WORKERS`` or the CPU count (at most 16), joined
            sample-exactly: :func:`flashasr.audio.load_audio_parallel`), raw ``bytes`` of a file,
            or a numpy float32 array of samples (shape [N] or [N, channels]; ``sample_rate`` required).
        model: a loaded :class:`~flashasr.models.base.ASRModel`, a model spec for
            :func:`load_model`, or None for the embedded whisper tiny.en.
        options: :class:`~flashasr.options.TranscribeOptions`; ``**changes`` are its fields as
            keywords (``language="de"``, ``word_timestamps=True``, ``task="translate"``,
            ``segmentation="none"``, ``max_segment_s=20``, ``prompt="..."``, ``temperature=0.2``).
            Options the model does not use (``prompt``/``temperature`` on Parakeet-TDT) raise a
            ``UserWarning`` naming them and are ignored.
    Returns:
        :class:`~flashasr.types.Transcript` (text, language and its probability, duration in seconds,
        segments, words, ``warnings``). A damaged or truncated input gives the transcript of what
        decodes, a ``damaged_input`` entry in ``warnings`` (decoded and declared seconds) and a
        ``UserWarning`` saying so.
    Raises:
        flashasr.errors.AudioError (and subclasses) for undecodable input;
        flashasr.errors.ModelLoadError for a bad model spec; InvalidRequestError,
        UnsupportedLanguageError or UnsupportedTaskError for options the model cannot honour.
    """
    from .audio import load_audio_parallel
    from .models.base import ASRModel
    from .pipeline import cached_model, transcribe_samples

    opts = TranscribeOptions.build(options, **changes)
    m = model if isinstance(model, ASRModel) else cached_model(None if model is None else str(model), device)
    opts = opts.resolve(m.capabilities)  # before the decode: a refused option costs nothing
    ignored = m.capabilities.ignored(opts)
    if ignored:
        import warnings

        warnings.warn(f"model {m.capabilities.name} does not use {', '.join(ignored)}; ignored", stacklevel=2)
    wav = load_audio_parallel(audio, sample_rate=sample_rate, target_rate=m.sample_rate)
    damage = wav.damage(audio)
    if damage:
        import warnings

        for w in damage:
            warnings.warn(f"{audio if isinstance(audio, str) else 'input'}: {w['message']}", UserWarning, stacklevel=2)
    samples = wav.samples
    del wav
    return transcribe_samples(m, samples, opts, warnings=damage)


__all__ = ["transcribe", "load_model", "TranscribeOptions", "Transcript", "Segment", "Word", "FlashASRError",
           "__version__"]
