"""Token, word and segment timestamps from TDT emission frames and durations.

Follows NeMo's TDT timestamps (``end_offset = start_offset + duration``, seconds = offset x
frame duration with frame = ``window_stride x subsampling_factor`` = 0.08 s for Parakeet v2/v3).
A punctuation token (piece whose first character is Unicode punctuation) gets start = end = the
previous token's end (NeMo ``_refine_timestamps_tdt``: punctuation is often predicted late, after
a pause). Words start at pieces beginning with ``▁`` and end at their last token's end; segments
end after a word ending in ``.``, ``?`` or ``!`` (NeMo's default ``segment_delimiter_tokens``). All times are clamped to ``[0, duration]``
and shifted by ``offset`` seconds (the start of the piece of a long recording).
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass

from ...types import Segment, Word
from .tokenizer import WORD_MARKER

SENTENCE_END = (".", "?", "!")


@dataclass
class TimedToken:
    """One emitted token: id, piece, start/end in seconds (global)."""

    id: int
    piece: str
    start: float
    end: float


def token_times(token_ids, token_frames, token_durations, frame_seconds: float, offset: float = 0.0,
                duration: float | None = None, tokenizer=None) -> list[TimedToken]:
    """Per-token start ``= offset + frame x frame_seconds``, end ``= start + duration x frame_seconds``,
    both clamped to ``[0, duration]`` (``duration`` = total audio seconds, None = no upper clamp);
    punctuation tokens (needs ``tokenizer``) take the previous token's end as start and end."""
    hi = float("inf") if duration is None else float(duration)
    out: list[TimedToken] = []
    for i, f, d in zip(token_ids, token_frames, token_durations):
        piece = tokenizer.piece(i) if tokenizer is not None else ""
        if out and is_punctuation(piece):
            s = e = out[-1].end
        else:
            s = min(max(offset + f * frame_seconds, 0.0), hi)
            e = min(max(offset + (f + d) * frame_seconds, s), hi)
        out.append(TimedToken(int(i), piece, s, e))
    return out


def is_punctuation(piece: str) -> bool:
    """True when the piece's first character is Unicode punctuation (``.``, ``,``, ``?``, ``"`` ...)."""
    return bool(piece) and unicodedata.category(piece[0]).startswith("P")


def group_words(tokens: list[TimedToken], tokenizer) -> list[tuple[Word, list[int]]]:
    """Words from timed tokens: a new word starts at a piece beginning with ``▁`` (or the first
    token). Word text = SentencePiece decode of its pieces, with a leading space (Whisper style).
    Returns ``(Word, token ids)`` pairs; words that decode to nothing are dropped."""
    groups: list[list[TimedToken]] = []
    for t in tokens:
        if not groups or t.piece.startswith(WORD_MARKER):
            groups.append([t])
        else:
            groups[-1].append(t)
    words = []
    for g in groups:
        ids = [t.id for t in g]
        text = tokenizer.decode(ids).strip()
        if not text:
            continue
        words.append((Word(word=" " + text, start=g[0].start, end=max(g[-1].end, g[0].start)), ids))
    return words


def build_segments(words: list[tuple[Word, list[int]]], first_id: int = 0) -> list[Segment]:
    """Segments from words, broken after a word ending in ``.``, ``?`` or ``!``."""
    segs: list[Segment] = []
    cur: list[tuple[Word, list[int]]] = []

    def flush():
        if not cur:
            return
        ws = [w for w, _ in cur]
        segs.append(Segment(id=first_id + len(segs), start=ws[0].start, end=max(w.end for w in ws),
                            text="".join(w.word for w in ws), tokens=[i for _, ids in cur for i in ids],
                            words=ws))
        cur.clear()

    for w, ids in words:
        cur.append((w, ids))
        if w.word.rstrip().endswith(SENTENCE_END):
            flush()
    flush()
    return segs


__all__ = ["TimedToken", "token_times", "is_punctuation", "group_words", "build_segments", "SENTENCE_END"]
