"""Re-join the transcripts of the pieces of one file into one global transcript."""

from __future__ import annotations

from ..types import Segment, Transcript, Word


def _clip(t: float, lo: float, hi: float) -> float:
    return min(max(t, lo), hi)


def merge_transcripts(parts: list[tuple[float, Transcript]], duration: float, *,
                      language: str | None = None, model: str | None = None,
                      word_timestamps: bool = False) -> Transcript:
    """Merge per-piece transcripts into one transcript with global times.

    Args:
        parts: ``(offset_s, transcript)`` in time order; ``offset_s`` is the piece's start
            in seconds from the start of the file; the piece's times are relative to it.
        duration: the file's duration in seconds; every time is clipped to ``[0, duration]``.
        language: the language to report (default: the first piece's non-None language).
        model: model name for ``Transcript.model``.
        word_timestamps: whether ``words`` is filled (a list, possibly empty) or None.
    Returns:
        one :class:`Transcript`: ``text`` is the pieces' stripped texts joined with one
        space (pieces are cut at pauses, so no word spans a join and none is dropped or
        doubled); segments are renumbered 0.. with global ``start``/``end``; ``seek`` is
        shifted by the offset in 10 ms mel frames, as Whisper counts it.
    """
    texts: list[str] = []
    segments: list[Segment] = []
    words: list[Word] = []
    lang = language
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
                words=[Word(w.word, _clip(w.start + offset, 0.0, duration), _clip(w.end + offset, 0.0, duration),
                            w.probability) for w in s.words],
            ))
        for w in (t.words or []):
            words.append(Word(w.word, _clip(w.start + offset, 0.0, duration),
                              _clip(w.end + offset, 0.0, duration), w.probability))
    if model is None:
        model = next((t.model for _, t in parts if t.model), None)
    return Transcript(text=" ".join(texts), language=lang, duration=duration, segments=segments,
                      words=words if word_timestamps else None, model=model)
