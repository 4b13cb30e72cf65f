"""The one merger: the transcripts of a recording's pieces become one transcript with global times.

It is also where the whole recording is seen at once, so two rules of issue #17 live here:

* the recording's language comes from its speech: the pieces' detected language distributions
  (``Transcript.language_probs``) weighted by each piece's duration, the most likely one and its
  probability (one piece of noise that looked Welsh does not label an English recording);
* the segment half of the repetition guard (:mod:`flashasr.repetition`): a segment text that
  comes back more than three times in a row (Whisper's windows inventing the same sentence on
  music) is kept once, and ``warnings`` say so. It acts for a model that invents text on
  non-speech (``caps.speech_gate``: Whisper), not for Parakeet-TDT, whose decoder emits blanks
  there: four pieces in a row that each say "Thank you." are then speech, and kept.
"""

from __future__ import annotations

import re
from typing import Sequence

from ..options import ModelCapabilities, TranscribeOptions
from ..repetition import MAX_COPIES, cut_loops
from ..types import Segment, Transcript, Word, warning


def _clip(t: float, lo: float, hi: float) -> float:
    return min(max(t, lo), hi)


def merge_pieces(parts: Sequence[tuple[float, Transcript]], duration: float, *,
                 options: TranscribeOptions | None = None, model: str | None = None,
                 caps: ModelCapabilities | None = None, warnings: Sequence[dict] = ()) -> Transcript:
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
            also when no piece was transcribed (a recording without speech), as its pieces would;
            ``speech_gate`` False (Parakeet-TDT): no segment repetition guard (module docstring).
        warnings: the recording's own (a damaged input: :attr:`Transcript.warnings`), first.
    Returns:
        one :class:`Transcript`: ``text`` is the pieces' stripped texts joined by one space
        (pieces are cut at pauses, so no word spans a join and none is dropped or doubled);
        segments renumbered 0.. with global ``start``/``end``; ``seek`` shifted by the offset in
        10 ms mel frames, as Whisper counts it; the language of the speech (see the module
        docstring) with its probability; ``warnings``: the recording's, the pieces' (global times)
        and the segment repetition guard's. No parts (no speech): an empty transcript.
    """
    options = options or TranscribeOptions()
    texts: list[str] = []
    segments: list[Segment] = []
    words: list[Word] = []
    notes = [dict(w) for w in warnings]
    owner: list[int] = []  # the part of each segment
    for k, (offset, t) in enumerate(parts):
        owner += [k] * len(t.segments)
        for w in t.warnings:
            w = dict(w)
            for k in ("start", "end"):
                if isinstance(w.get(k), (int, float)):
                    w[k] = round(_clip(w[k] + offset, 0.0, duration), 2)
            notes.append(w)
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
    if caps is None or caps.speech_gate:
        kept, words = _drop_repeated_segments(segments, words, notes)
    else:
        kept = set(range(len(segments)))
    for k, (_, t) in enumerate(parts):
        mine = [i for i, o in enumerate(owner) if o == k]
        left = [i for i in mine if i in kept]
        txt = (t.text or "") if len(left) == len(mine) else "".join(segments[i].text for i in left)
        if txt.strip():
            texts.append(txt.strip())
    segments = [segments[i] for i in sorted(kept)]
    for i, s in enumerate(segments):
        s.id = i
    lang, prob = _language(parts, options)
    if options.task == "translate":
        lang = "en"
    elif lang is None:
        lang, prob = options.language, (1.0 if options.language is not None else None)
    if lang is None and caps is not None and caps.languages is not None and len(caps.languages) == 1:
        (lang,) = caps.languages
        prob = 1.0
    if model is None and caps is not None:
        model = caps.name
    if model is None:
        model = next((t.model for _, t in parts if t.model), None)
    return Transcript(text=" ".join(texts), language=lang, duration=duration, segments=segments,
                      words=words if options.word_timestamps else None, model=model, task=options.task,
                      language_probability=prob, warnings=notes)


def _language(parts: Sequence[tuple[float, Transcript]], options: TranscribeOptions) -> tuple[str | None, float | None]:
    """The recording's language and its probability: the pieces' detected distributions weighted by
    their durations (the most likely code); pieces that only name a language (given, or a model
    without a detector) vote with probability 1; None without any piece that has one."""
    weight: dict[str, float] = {}
    total = 0.0
    for _, t in parts:
        w = max(float(t.duration), 1e-3)
        if t.language_probs:
            dist = t.language_probs
        elif t.language:
            dist = {t.language: float(t.language_probability if t.language_probability is not None else 1.0)}
        else:
            continue
        total += w
        for code, p in dist.items():
            weight[code] = weight.get(code, 0.0) + w * float(p)
    if not weight:
        return None, None
    code = max(weight, key=weight.get)
    return code, round(weight[code] / total, 4)


_WORD = re.compile(r"\w+", re.UNICODE)


def _drop_repeated_segments(segments: list[Segment], words: list[Word], notes: list[dict]):
    """The segment half of the repetition guard: more than :data:`~flashasr.repetition.MAX_COPIES`
    consecutive segments with the same words (case and punctuation aside) keep the first one; the
    words inside the dropped ones go too. Returns (the indices of the segments kept, the words)."""
    key = [" ".join(_WORD.findall(s.text.lower())) or f"\x00{i}" for i, s in enumerate(segments)]
    kept, loops = cut_loops(key, max_copies=MAX_COPIES, min_items=MAX_COPIES + 1, max_period=4)
    if not loops:
        return set(kept), words
    gone = [segments[i] for i in sorted(set(range(len(segments))) - set(kept))]
    for start, period, copies in loops:
        first, last = segments[start], segments[start + copies * period - 1]
        unit = " ".join(s.text.strip() for s in segments[start: start + period])
        notes.append(warning("repetition_removed", f"{copies} segments in a row said {unit!r}: kept once",
                             start=round(first.start, 2), end=round(last.end, 2), text=unit, copies=copies))
    spans = [(s.start, s.end) for s in gone]
    words = [w for w in words if not any(a <= w.start and w.end <= b for a, b in spans)]
    return set(kept), words


def _shift(w: Word, offset: float, duration: float) -> Word:
    return Word(w.word, _clip(w.start + offset, 0.0, duration), _clip(w.end + offset, 0.0, duration), w.probability)


__all__ = ["merge_pieces"]
