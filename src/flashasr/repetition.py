"""The hard guard against repetition loops: one rule, used by the Whisper decoder (tokens inside a
segment) and by the merger (whole segments in a row).

A *loop* is a unit -- a run of ``period`` consecutive items (tokens, or segment texts) -- repeated
more than :data:`MAX_COPIES` times in a row. Whisper-family decoders fall into them on non-speech and
at the ends of windows ("Oh, oh, oh, oh, ...", "a little bit of a little bit of ...", one sentence
in 18 consecutive segments); the compression-ratio fallback catches many, not all (it may find no
temperature without one). Cutting a loop keeps its first copy: what precedes and follows the loop
is untouched, and whoever cuts records it (``Transcript.warnings``, code ``repetition_removed``).

Legitimate repetition ("no, no, no") stays when it is short: a loop must also cover at least
``min_items`` items (8 tokens inside a segment, 4 segments in a row).
"""

from __future__ import annotations

from typing import Hashable, Sequence

MAX_COPIES = 3


def find_loop(seq: Sequence[Hashable], *, max_copies: int = MAX_COPIES, min_items: int = 8,
              max_period: int = 32) -> tuple[int, int, int] | None:
    """The earliest loop in ``seq``.

    Args:
        seq: items compared with ``==``.
        max_copies: a unit repeated more than this many times in a row is a loop.
        min_items: a loop covers at least this many items (copies x period).
        max_period: the longest unit looked for.
    Returns:
        ``(start, period, copies)``: ``seq[start:start + period]`` is repeated ``copies`` times from
        ``start`` (the earliest start; at equal starts the shortest unit); None when there is none.
        Cost: O(len(seq) x max_period) comparisons.
    """
    n = len(seq)
    best = None
    for p in range(1, min(max_period, n // (max_copies + 1)) + 1):
        run = 0  # consecutive i with seq[i] == seq[i + p], ending at the current i
        for i in range(n - p):
            run = run + 1 if seq[i] == seq[i + p] else 0
            copies = run // p + 1
            if copies > max_copies and copies * p >= min_items:
                start = i - run + 1
                unit = list(seq[start: start + p])
                while list(seq[start + copies * p: start + (copies + 1) * p]) == unit:
                    copies += 1  # how far the loop goes on
                if best is None or start < best[0]:
                    best = (start, p, copies)
                break
    return best


def cut_loops(seq: Sequence, *, key=None, max_copies: int = MAX_COPIES, min_items: int = 8,
              max_period: int = 32) -> tuple[list[int], list[tuple[int, int, int]]]:
    """Every loop of ``seq`` cut to its first copy.

    Args:
        seq: the items; ``key(item)`` (default: the item) is what is compared.
        max_copies, min_items, max_period: as :func:`find_loop`.
    Returns:
        ``(kept, loops)``: the indices of the items kept, in order, and each loop cut as
        ``(start, period, copies)`` in indices of ``seq``.
    """
    keys = [x if key is None else key(x) for x in seq]
    kept: list[int] = []
    loops: list[tuple[int, int, int]] = []
    pos = 0
    while pos < len(keys):
        got = find_loop(keys[pos:], max_copies=max_copies, min_items=min_items, max_period=max_period)
        if got is None:
            kept.extend(range(pos, len(keys)))
            break
        start, p, copies = got
        kept.extend(range(pos, pos + start + p))
        loops.append((pos + start, p, copies))
        pos = pos + start + copies * p
    return kept, loops


__all__ = ["MAX_COPIES", "find_loop", "cut_loops"]
