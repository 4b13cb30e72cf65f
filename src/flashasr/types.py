"""Result types: the shape follows OpenAI's ``verbose_json`` transcription response.

All times are in seconds from the start of the input audio (global, also for
long audio that was cut into segments) and lie within ``[0, duration]``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .languages import language_name


@dataclass
class Word:
    """One word. ``word`` keeps its leading space as Whisper emits it (stripped in ``to_dict``)."""

    word: str
    start: float
    end: float
    probability: float | None = None

    def to_dict(self) -> dict:
        d = {"word": self.word.strip(), "start": round(self.start, 3), "end": round(self.end, 3)}
        if self.probability is not None:
            d["probability"] = round(self.probability, 4)
        return d


@dataclass
class Segment:
    """A span of text with start/end in seconds (OpenAI verbose_json segment)."""

    id: int
    start: float
    end: float
    text: str
    tokens: list[int] = field(default_factory=list)
    avg_logprob: float = 0.0
    no_speech_prob: float = 0.0
    compression_ratio: float = 0.0
    temperature: float = 0.0
    seek: int = 0
    words: list[Word] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "seek": self.seek,
            "start": round(self.start, 3),
            "end": round(self.end, 3),
            "text": self.text,
            "tokens": list(self.tokens),
            "temperature": self.temperature,
            "avg_logprob": self.avg_logprob,
            "compression_ratio": self.compression_ratio,
            "no_speech_prob": self.no_speech_prob,
        }


@dataclass
class Transcript:
    """A whole transcription result.

    ``text``: the full text; ``language``: ISO 639-1 code (or None when unknown);
    ``duration``: decoded audio duration in seconds; ``segments``/``words``: timed pieces.
    ``language_probability``: the detector's probability of ``language`` (1.0 when the language was
    given or the model has only one; None when nothing was detected: no speech).
    ``language_probs``: the detector's most likely languages ``{code: probability}`` (at most
    five; None when not detected) -- what the merger weighs across pieces, not rendered.
    ``warnings``: what the caller should know about this transcript, each
    ``{"code": ..., "message": ..., ...}``: the input was damaged or truncated (``damaged_input``:
    ``decoded_s``, ``declared_s``), a repetition loop was cut (``repetition_removed``: ``start``,
    ``end`` in seconds, ``text`` the unit kept, ``copies``). Empty: nothing to say.
    """

    text: str
    language: str | None
    duration: float
    segments: list[Segment] = field(default_factory=list)
    words: list[Word] | None = None
    model: str | None = None
    task: str = "transcribe"  # or "translate" (English text from another language)
    language_probability: float | None = None
    language_probs: dict[str, float] | None = field(default=None, repr=False)
    warnings: list[dict] = field(default_factory=list)

    def to_dict(self, *, words: bool | None = None) -> dict:
        """OpenAI ``verbose_json`` dict. ``words`` forces inclusion (None: include if present)."""
        d = {
            "task": self.task,
            # OpenAI's verbose_json names the language in words ("english"); the code is in
            # Transcript.language.
            "language": language_name(self.language),
            "duration": round(self.duration, 3),
            "text": self.text,
            "segments": [s.to_dict() for s in self.segments],
        }
        if self.language_probability is not None:  # extensions of OpenAI's shape, only when known
            d["language_probability"] = round(float(self.language_probability), 4)
        want_words = (self.words is not None) if words is None else words
        if want_words:
            d["words"] = [w.to_dict() for w in (self.words or [])]
        if self.warnings:
            d["warnings"] = [dict(w) for w in self.warnings]
        return d


def warning(code: str, message: str, **fields) -> dict:
    """One entry of :attr:`Transcript.warnings`: ``{"code", "message", **fields}`` (JSON-able)."""
    return {"code": code, "message": message, **fields}


@dataclass
class StreamResult:
    """One chunked stream after a streaming step (:class:`flashasr.models.parakeet.streaming.ParakeetStreamer`).

    Attributes:
        text: the provisional hypothesis so far (SentencePiece decode of every token).
        stable_text: its words that can no longer change: every word before the last word-start
            piece (the last word may still grow). Append-only from step to step.
        frames: encoder frames encoded so far (x 0.08 s for v2/v3); ``audio_s`` the same in seconds.
        new_tokens: tokens decoded by this step.
        tokens: all tokens so far.
    """

    text: str
    stable_text: str
    frames: int
    audio_s: float
    new_tokens: int
    tokens: int


__all__ = ["Word", "Segment", "Transcript", "StreamResult", "warning", "asdict"]
