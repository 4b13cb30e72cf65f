"""The one merger: the transcripts of a recording's pieces become one transcript with global times."""

from __future__ import annotations

from typing import Sequence

from ..options import ModelCapabilities, TranscribeOptions
from ..types import Segment, Transcript, Word


def _clip(t: float, lo: float, hi: float) -> float:
    return min(max(t, lo), hi)


def merge_pieces(parts: Sequence[tuple[float, Transcript]], duration: float, *,
                 options: TranscribeOptions | None = None, model: str | None = None,
                 caps: ModelCapabilities | None = None) -> Transcript:
    """Merge per-piece transcripts into one transcript of the whole recording.

    Args:
        parts: ``(offset_s, transcript)`` in time order; ``offset_s`` is the piece's start in
            seconds from the start of the recording; the piece's times are relative to it.
        duration: the recording's duration in seconds (``N / sample_rate``, set here and nowhere
            else); every time is clipped to ``[0, duration]``.
        options: ``language`` is reported when no piece detected one; ``task`` is the result's
            (``translate``: language ``"en"``); ``word_timestamps`` fills ``words`` (a list,
            possibly empty) or leaves it None.
        model: model name for ``Transcript.model`` (default: ``caps.name``, else the first piece's).
        caps: the model's capabilities: a model of one language (English-only Whisper) reports it
            also when no piece was transcribed (a recording without speech), as its pieces would.
    Returns:
        one :class:`Transcript`: ``text`` is the pieces' stripped texts joined by one space
        (pieces are cut at pauses, so no word spans a join and none is dropped or doubled);
        segments renumbered 0.. with global ``start``/``end``; ``seek`` shifted by the offset in
        10 ms mel frames, as Whisper counts it. No parts (no speech): an empty transcript.
    """
    options = options or TranscribeOptions()
    texts: list[str] = []
    segments: list[Segment] = []
    words: list[Word] = []
    lang = None
    for offset, t in parts:
        if lang is None and t.language:
            lang = t.language
        txt = (t.text or "").strip()
        if txt:
            texts.append(txt)
        for s in t.segments:
            segments.append(Segment(
                id=len(segments),
                start=_clip(s.start + offset, 0.0, duration),
                end=_clip(s.end + offset, 0.0, duration),
                text=s.text,
                tokens=list(s.tokens),
                avg_logprob=s.avg_logprob,
                no_speech_prob=s.no_speech_prob,
                compression_ratio=s.compression_ratio,
                temperature=s.temperature,
                seek=s.seek + int(round(offset * 100)),
                words=[_shift(w, offset, duration) for w in s.words],
            ))
        words.extend(_shift(w, offset, duration) for w in (t.words or []))
    if options.task == "translate":
        lang = "en"
    elif lang is None:
        lang = options.language
    if lang is None and caps is not None and caps.languages is not None and len(caps.languages) == 1:
        (lang,) = caps.languages
    if model is None and caps is not None:
        model = caps.name
    if model is None:
        model = next((t.model for _, t in parts if t.model), None)
    return Transcript(text=" ".join(texts), language=lang, duration=duration, segments=segments,
                      words=words if options.word_timestamps else None, model=model, task=options.task)


def _shift(w: Word, offset: float, duration: float) -> Word:
    return Word(w.word, _clip(w.start + offset, 0.0, duration), _clip(w.end + offset, 0.0, duration), w.probability)


__all__ = ["merge_pieces"]
