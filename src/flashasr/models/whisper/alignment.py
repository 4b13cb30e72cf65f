"""Word timestamps from cross-attention + dynamic time warping (DTW).

Method (facts from the Whisper reference's ``timing.py``): the window's text tokens are fed once
more through the decoder after ``[prompt, <|notimestamps|>]``; the pre-softmax cross-attention
scores of the checkpoint's *alignment heads* are softmaxed over the window's real encoder
frames, standardised per head over tokens, median-filtered (width 7) over time and averaged over
heads. DTW on ``-attention`` gives a monotonic token -> frame path; a word starts at the frame
where the path first reaches its first token and ends where the next word begins. One encoder
frame is 20 ms.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .model import CrossKV, WhisperModel
from .tokenizer import WhisperTokenizer

__all__ = ["dtw", "median_filter", "align_words", "default_alignment_heads"]

FRAMES_PER_SECOND = 50  # encoder frames (= timestamp steps) per second
_NO_SPACE_LANGS = {"zh", "ja", "th", "lo", "my", "yue"}


def default_alignment_heads(model: WhisperModel) -> list[tuple[int, int]]:
    """All heads of the second half of the decoder layers (the reference's default when a
    checkpoint names no alignment heads)."""
    n, h = model.dims.n_text_layer, model.dims.n_text_head
    return [(layer, head) for layer in range(n // 2, n) for head in range(h)]


def dtw(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Minimum-cost monotonic path through ``cost [N, M]`` from (0, 0) to (N-1, M-1) with steps
    (1, 1), (1, 0), (0, 1); ties prefer the horizontal (time) step as the reference does.
    Computed by anti-diagonals (vectorised). Returns (row indices, column indices) along the path."""
    n, m = cost.shape
    acc = np.full((n + 1, m + 1), np.inf)
    acc[0, 0] = 0.0
    trace = np.full((n + 1, m + 1), -1, dtype=np.int8)
    for d in range(2, n + m + 1):
        i = np.arange(max(1, d - m), min(n, d - 1) + 1)
        if i.size == 0:
            continue
        j = d - i
        c0, c1, c2 = acc[i - 1, j - 1], acc[i - 1, j], acc[i, j - 1]
        t = np.where((c0 < c1) & (c0 < c2), 0, np.where((c1 < c0) & (c1 < c2), 1, 2))
        acc[i, j] = cost[i - 1, j - 1] + np.choose(t, [c0, c1, c2])
        trace[i, j] = t
    trace[0, :] = 2
    trace[:, 0] = 1
    i, j = n, m
    rows, cols = [], []
    while i > 0 or j > 0:
        rows.append(i - 1)
        cols.append(j - 1)
        t = trace[i, j]
        if t == 0:
            i, j = i - 1, j - 1
        elif t == 1:
            i -= 1
        else:
            j -= 1
    return np.array(rows[::-1]), np.array(cols[::-1])


def median_filter(x: torch.Tensor, width: int) -> torch.Tensor:
    """Median over the last axis in windows of odd ``width`` (reflect padding)."""
    if width <= 1 or x.shape[-1] <= width // 2:
        return x
    pad = width // 2
    shape = x.shape
    y = F.pad(x.reshape(-1, 1, shape[-1]), (pad, pad), mode="reflect").reshape(*shape[:-1], shape[-1] + 2 * pad)
    return y.unfold(-1, width, 1).median(dim=-1).values


def _split_words(tok: WhisperTokenizer, text_tokens: Sequence[int], language: str | None):
    if language in _NO_SPACE_LANGS:
        groups = [[t] for t in text_tokens]
        return [tok.decode(g) for g in groups], groups
    return tok.split_to_words(text_tokens)


@torch.inference_mode()
def align_words(model: WhisperModel, tok: WhisperTokenizer, audio_features: torch.Tensor, prompt: Sequence[int],
                text_tokens: Sequence[int], num_frames: int, heads: Sequence[tuple[int, int]],
                language: str | None = None, medfilt_width: int = 7, cross: CrossKV | None = None):
    """Align the text tokens of one window to time.

    Args:
        audio_features: ``[1, 1500, D]`` encoder output of the window.
        prompt: the decoding prompt (``[sot]`` or ``[sot, lang, task]``).
        text_tokens: the window's text token ids (< eot), in order.
        num_frames: mel frames of real audio in the window (<= 3000).
        heads: ``[(layer, head), ...]`` alignment heads.
        cross: the window's cross-attention K/V when the decoding already computed them
            (:meth:`WhisperModel.cross_kv`, batch 1); None computes them.
    Returns:
        list of ``(word, token_ids, start_s, end_s)`` with times relative to the window start.
    """
    text_tokens = [int(t) for t in text_tokens if t < tok.eot]
    if not text_tokens:
        return []
    seq = list(prompt) + [tok.no_timestamps] + text_tokens + [tok.eot]
    tokens = torch.tensor([seq], dtype=torch.long, device=audio_features.device)
    cache = model.new_cache(audio_features, max_len=len(seq), cross=cross)
    n_audio = max(1, min(num_frames // 2, audio_features.shape[1]))
    w = model.alignment_scores(tokens, cache, heads)[0, :, :, :n_audio]  # [h, T, F] float32
    w = w.softmax(dim=-1)
    std, mean = torch.std_mean(w, dim=-2, keepdim=True, unbiased=False)
    w = (w - mean) / (std + 1e-8)
    w = median_filter(w, medfilt_width)
    matrix = w.mean(dim=0)[len(prompt): -1]  # rows: <|notimestamps|>, text tokens (predicting the next)
    rows, cols = dtw(-matrix.double().cpu().numpy())
    jumps = np.concatenate([[True], np.diff(rows) > 0])
    jump_times = cols[jumps] / FRAMES_PER_SECOND
    words, groups = _split_words(tok, text_tokens, language)
    bounds = np.concatenate([[0], np.cumsum([len(g) for g in groups])])
    out = []
    for k, (word, g) in enumerate(zip(words, groups)):
        s = float(jump_times[min(bounds[k], len(jump_times) - 1)])
        e = float(jump_times[min(bounds[k + 1], len(jump_times) - 1)])
        out.append((word, g, s, max(s, e)))
    return out
