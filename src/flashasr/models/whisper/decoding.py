"""Batched Whisper decoding of 30 s windows: greedy (temperature 0) or seeded sampling, with the
reference's logit rules, language detection and no-speech probability.

Rules (facts from the Whisper paper / OpenAI reference ``decoding.py``), applied to every row's
logits in this order at every step:

1. suppress blank: at the first sampled position, forbid ``" "`` and eot;
2. suppress tokens: never sample the non-speech symbols nor the control tokens;
3. timestamp rules (unless ``without_timestamps``): ``<|notimestamps|>`` is forbidden;
   timestamps come in pairs (after a timestamp that followed text, only a timestamp or eot;
   after two timestamps, only text); timestamps never decrease (and a closed segment
   cannot end where it began); the first token must be a timestamp <= ``max_initial_timestamp``
   (1.0 s); when the total probability of all timestamp tokens exceeds that of the most likely
   text token, a timestamp is forced.

``no_speech_prob`` is ``softmax(logits at the sot position)[<|nocaptions|>]``. ``avg_logprob`` is
the sum of the chosen tokens' log-probabilities (eot included) divided by (sampled tokens + 1).
Rows stop independently at eot (finished rows are dropped from the batch: the KV cache is
compacted), or after ``sample_len`` (224 = n_text_ctx / 2) tokens.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Sequence

import torch

from .model import CrossKV, WhisperModel
from .tokenizer import TIME_PRECISION, WhisperTokenizer

__all__ = ["DecodingResult", "LogitRules", "decode_windows", "detect_language", "compression_ratio",
           "TEMPERATURES", "COMPRESSION_RATIO_THRESHOLD", "LOGPROB_THRESHOLD", "NO_SPEECH_THRESHOLD",
           "NO_SPEECH_THRESHOLD_UNCONFIDENT", "NO_SPEECH_THRESHOLD_SURE", "LOGPROB_THRESHOLD_SURE", "is_no_speech", "decode_with_fallback", "needs_fallback"]

TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
COMPRESSION_RATIO_THRESHOLD = 2.4
LOGPROB_THRESHOLD = -1.0
NO_SPEECH_THRESHOLD = 0.6
# Our addition: a window that no temperature could decode confidently is dropped as no speech
# already when no_speech_prob > 0.55. Measured: 8 s of background noise (tiny.en: "Whoo!",
# no_speech_prob 0.565) is dropped; a spoken "six" (base: " 6", avg_logprob -1.002,
# no_speech_prob 0.532) is kept.
NO_SPEECH_THRESHOLD_UNCONFIDENT = 0.55
# Our addition (issue #17): a window the model is sure holds no speech (no_speech_prob > 0.8) is
# dropped unless its text is confident (avg_logprob >= -0.5). Measured: the hallucinations "you" on
# 30 s of digital silence (tiny.en: no_speech_prob 0.948, avg_logprob -0.70) and "Thank you." on a
# 0.9 s VAD false positive in jazz (0.88, -1.00) go; real speech windows of the 51 English clips of
# ../shared/audio stay (highest no_speech_prob: tiny.en 0.454, base 0.532, both on a spoken "six").
NO_SPEECH_THRESHOLD_SURE = 0.8
LOGPROB_THRESHOLD_SURE = -0.5
MAX_INITIAL_TIMESTAMP = 1.0


def compression_ratio(text: str) -> float:
    """``len(utf8) / len(zlib(utf8))``: high (> 2.4) for repetitive text (repetition loops)."""
    b = text.encode("utf-8")
    return len(b) / len(zlib.compress(b)) if b else 0.0


@dataclass
class DecodingResult:
    """One decoded window. ``tokens``: sampled ids (text + timestamps) without eot;
    ``token_logprobs``: log-probability of each of them; times are not yet offset."""

    tokens: list[int]
    token_logprobs: list[float]
    text: str
    language: str | None
    avg_logprob: float
    sum_logprob: float
    no_speech_prob: float
    temperature: float
    compression_ratio: float
    hit_eot: bool = True
    fallback_exhausted: bool = False
    language_probs: dict[str, float] | None = field(default=None, repr=False)


class LogitRules:
    """The reference's logit filters for a batch (vectorised over rows).

    ``apply(logits [B, V] float32, step, ts_state) -> logits`` where ``step`` is the number of
    tokens sampled so far and ``ts_state = (last_is_ts [B] bool, penult_is_ts [B] bool,
    last_ts_token [B] int64 (-1 if none))``.
    """

    def __init__(self, tok: WhisperTokenizer, n_vocab: int, device, *, without_timestamps: bool = False,
                 max_initial_timestamp: float | None = MAX_INITIAL_TIMESTAMP, suppress_blank: bool = True):
        self.tok = tok
        self.n_vocab = n_vocab
        self.without_timestamps = without_timestamps
        self.suppress = torch.zeros(n_vocab, dtype=torch.bool, device=device)
        self.suppress[[t for t in tok.suppress_tokens if t < n_vocab]] = True
        self.suppress[tok.no_timestamps] = True  # never generated: it belongs in the prompt
        if without_timestamps:
            self.suppress[tok.timestamp_begin:] = True
        self.begin = torch.zeros(n_vocab, dtype=torch.bool, device=device)
        if suppress_blank:
            self.begin[[t for t in tok.suppress_tokens_begin if t < n_vocab]] = True
        ar = torch.arange(n_vocab, device=device)
        self.ar = ar
        self.is_ts = ar >= tok.timestamp_begin
        self.is_text = ar < tok.eot
        self.first_mask = ~self.is_ts.clone()
        if max_initial_timestamp is not None:
            last_allowed = tok.timestamp_begin + round(max_initial_timestamp / TIME_PRECISION)
            self.first_mask |= ar > last_allowed

    def apply(self, logits: torch.Tensor, step: int, ts_state) -> torch.Tensor:
        """Filter ``logits`` in place (it must be a tensor the caller owns) and return it.
        Only broadcast masks, no host synchronisation (CUDA-graph friendly)."""
        neg = float("-inf")
        logits.masked_fill_(self.suppress, neg)
        if step == 0:
            logits.masked_fill_(self.begin, neg)
        if self.without_timestamps:
            return logits
        tb = self.tok.timestamp_begin
        ts = logits[:, tb:]
        if step == 0:
            logits.masked_fill_(self.first_mask, neg)
        else:
            last, pen, last_tok = ts_state
            # after "text, timestamp": no text (only a timestamp or eot)
            logits[:, : self.tok.eot].masked_fill_((last & ~pen)[:, None], neg)
            # after "timestamp, timestamp": no timestamp; and timestamps never decrease
            limit = torch.where(last & ~pen, last_tok, last_tok + 1) - tb
            ts_ar = self.ar[: ts.shape[1]]
            ts.masked_fill_((last & pen)[:, None] | ((last_tok >= 0)[:, None] & (ts_ar[None] < limit[:, None])), neg)
        # force a timestamp when all timestamps together are likelier than the best text token
        # (the softmax normaliser cancels on both sides)
        force = torch.logsumexp(ts, dim=-1) > logits[:, :tb].max(dim=-1).values
        logits[:, :tb].masked_fill_(force[:, None], neg)
        return logits


@torch.inference_mode()
def detect_language(model: WhisperModel, tok: WhisperTokenizer, audio_features: torch.Tensor,
                    cross: CrossKV | None = None) -> tuple[list[str], list[dict[str, float]]]:
    """Language of each row from the logits at the sot position restricted to language tokens.

    Args:
        audio_features: encoder output ``[B, 1500, D]``.
        cross: their cross-attention K/V when already computed (:meth:`WhisperModel.cross_kv`).
    Returns:
        (codes, per-row {code: probability}).
    """
    b = audio_features.shape[0]
    cache = model.new_cache(audio_features, max_len=1, cross=cross)
    sot = torch.full((b, 1), tok.sot, dtype=torch.long, device=audio_features.device)
    logits = model.decode_step(sot, cache, 0)[:, 0]
    codes = list(tok.language_tokens)
    ids = torch.tensor([tok.language_tokens[c] for c in codes], device=logits.device)
    probs = torch.softmax(logits[:, ids], dim=-1).cpu()
    best = probs.argmax(dim=-1).tolist()
    return [codes[i] for i in best], [dict(zip(codes, p.tolist())) for p in probs]


def _sample(logits: torch.Tensor, temperature: float, generators: Sequence[torch.Generator] | None,
            rows: torch.Tensor) -> torch.Tensor:
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / temperature, dim=-1).cpu()
    out = []
    for j, r in enumerate(rows.tolist()):
        g = generators[r] if generators is not None else None
        out.append(torch.multinomial(probs[j], 1, generator=g))
    return torch.cat(out).to(logits.device)


@torch.inference_mode()
def decode_windows(model: WhisperModel, tok: WhisperTokenizer, audio_features: torch.Tensor,
                   languages: Sequence[str | None], *, temperature: float = 0.0,
                   generators: Sequence[torch.Generator] | None = None, without_timestamps: bool = False,
                   sample_len: int | None = None, task: str = "transcribe",
                   prefix: Sequence[int] = (), cross: CrossKV | None = None) -> list[DecodingResult]:
    """Decode a batch of windows from their encoder output.

    Args:
        audio_features: ``[B, 1500, D]``.
        languages: per row ISO code (ignored by English-only models; must be known here).
        temperature: 0 = greedy; > 0 samples from ``softmax(logits / T)`` with ``generators[row]``.
        generators: per-row CPU ``torch.Generator`` (seeded by the caller for reproducibility).
        prefix: tokens before every row's start-of-transcript sequence (``<|startofprev|>`` + an
            initial prompt's tokens, as the reference's ``prompt``); the no-speech probability is
            read at the start-of-transcript token after it.
        cross: the rows' cross-attention K/V when already computed (:meth:`WhisperModel.cross_kv`).
    Returns:
        one :class:`DecodingResult` per row (same order).
    """
    b = audio_features.shape[0]
    dev = audio_features.device
    n_ctx = model.dims.n_text_ctx
    sample_len = sample_len or n_ctx // 2
    prompts = [list(prefix) + tok.prompt(lang, task, without_timestamps=without_timestamps) for lang in languages]
    p_len = len(prompts[0])
    sample_len = min(sample_len, n_ctx - p_len)
    cache = model.new_cache(audio_features, max_len=p_len + sample_len, cross=cross)
    prompt = torch.tensor(prompts, dtype=torch.long, device=dev)
    logits_all = model.decode_step(prompt, cache, 0)  # [B, P, V]
    no_speech = torch.softmax(logits_all[:, len(prefix)], dim=-1)[:, tok.no_speech].cpu().tolist()
    logits = logits_all[:, -1]
    rules = LogitRules(tok, logits.shape[-1], dev, without_timestamps=without_timestamps)

    rows = torch.arange(b, device=dev)  # original row index of each active row
    last = torch.zeros(b, dtype=torch.bool, device=dev)
    pen = torch.ones(b, dtype=torch.bool, device=dev)
    last_tok = torch.full((b,), -1, dtype=torch.long, device=dev)
    sampled: list[list[int]] = [[] for _ in range(b)]
    lps: list[list[float]] = [[] for _ in range(b)]
    sum_lp = [0.0] * b
    hit_eot = [False] * b
    offset = p_len
    for step in range(sample_len):
        filtered = rules.apply(logits.clone() if step == 0 else logits, step, (last, pen, last_tok))
        nxt = _sample(filtered, temperature, generators, rows)
        lp = filtered.gather(1, nxt[:, None])[:, 0] - torch.logsumexp(filtered, dim=-1)
        nxt_l, lp_l, rows_l = nxt.tolist(), lp.tolist(), rows.tolist()
        keep = []
        for j, (r, t, l) in enumerate(zip(rows_l, nxt_l, lp_l)):
            sum_lp[r] += l
            if t == tok.eot:
                hit_eot[r] = True
            else:
                sampled[r].append(t)
                lps[r].append(l)
                keep.append(j)
        if not keep or step == sample_len - 1:
            break
        is_ts = nxt >= tok.timestamp_begin
        pen = last if step > 0 else torch.ones_like(last)
        last = is_ts
        last_tok = torch.where(is_ts, nxt, last_tok)
        if len(keep) < len(rows_l):
            k = torch.tensor(keep, dtype=torch.long, device=dev)
            cache = cache.select(k)
            rows, nxt, last, pen, last_tok = rows[k], nxt[k], last[k], pen[k], last_tok[k]
        logits = model.decode_step(nxt[:, None], cache, offset)[:, -1]
        offset += 1

    out = []
    for r in range(b):
        text = tok.decode(sampled[r])
        out.append(DecodingResult(
            tokens=sampled[r], token_logprobs=lps[r], text=text,
            language=languages[r] if tok.multilingual else "en",
            avg_logprob=sum_lp[r] / (len(sampled[r]) + 1), sum_logprob=sum_lp[r],
            no_speech_prob=float(no_speech[r]), temperature=temperature,
            compression_ratio=compression_ratio(text), hit_eot=hit_eot[r]))
    return out


def needs_fallback(r: DecodingResult) -> bool:
    """The reference's temperature-fallback test: too repetitive or too unlikely, unless the
    window is probably silence."""
    bad = r.compression_ratio > COMPRESSION_RATIO_THRESHOLD or r.avg_logprob < LOGPROB_THRESHOLD
    if r.no_speech_prob > NO_SPEECH_THRESHOLD:
        bad = False
    return bad


def decode_with_fallback(model: WhisperModel, tok: WhisperTokenizer, audio_features: torch.Tensor,
                         languages: Sequence[str | None], *, seeds: Sequence[int] | None = None,
                         temperatures: Sequence[float] = TEMPERATURES, without_timestamps: bool = False,
                         task: str = "transcribe", initial: Sequence[DecodingResult] | None = None,
                         prefix: Sequence[int] = (), cross: CrossKV | None = None) -> list[DecodingResult]:
    """Greedy decode, then re-decode only the rows that :func:`needs_fallback` at the next
    temperature (seeded sampling, one candidate), up to 1.0. When every temperature fails, the
    row keeps its most likely try whose compression ratio is acceptable (as faster-whisper
    does) and is marked ``fallback_exhausted``.

    ``seeds[row]`` seeds that row's generator at every temperature, so a row's result does not
    depend on which other rows share the batch. ``initial``: per-row results already decoded at
    ``temperatures[0]`` (e.g. by a GPU engine's greedy pass); they are not decoded again.
    ``cross``: the rows' cross-attention K/V when already computed (every try reuses them).
    """
    b = audio_features.shape[0]
    results: list[DecodingResult | None] = [None] * b
    tries: list[list[DecodingResult]] = [[] for _ in range(b)]
    todo = list(range(b))
    for ti, t in enumerate(temperatures):
        if not todo:
            break
        if ti == 0 and initial is not None:
            if len(initial) != b:
                raise ValueError(f"initial has {len(initial)} results for {b} rows")
            nxt = []
            for r in todo:
                tries[r].append(initial[r])
                results[r] = initial[r]
                if needs_fallback(initial[r]):
                    nxt.append(r)
            todo = nxt
            continue
        idx = torch.tensor(todo, dtype=torch.long, device=audio_features.device)
        feats = audio_features if len(todo) == b else audio_features.index_select(0, idx)
        rows_cross = cross if cross is None or len(todo) == b else cross.rows(idx)
        gens = None
        if t > 0:
            gens = []
            for r in todo:
                g = torch.Generator()
                g.manual_seed(int(seeds[r]) if seeds is not None else 0)
                gens.append(g)
        res = decode_windows(model, tok, feats, [languages[r] for r in todo], temperature=t, generators=gens,
                             without_timestamps=without_timestamps, task=task, prefix=prefix, cross=rows_cross)
        nxt = []
        for r, res_r in zip(todo, res):
            tries[r].append(res_r)
            results[r] = res_r
            if needs_fallback(res_r):
                nxt.append(r)
        todo = nxt
    for r in todo:  # every temperature failed: keep the most likely non-repetitive try
        ok = [x for x in tries[r] if x.compression_ratio <= COMPRESSION_RATIO_THRESHOLD] or tries[r]
        best = max(ok, key=lambda x: x.avg_logprob)
        best.fallback_exhausted = True
        results[r] = best
    return results  # type: ignore[return-value]


def is_no_speech(r: DecodingResult) -> bool:
    """Skip the window as silence: the reference's rule (``no_speech_prob > 0.6`` and
    ``avg_logprob < -1``), or, our additions, when every fallback temperature failed and
    ``no_speech_prob > 0.55``, or when ``no_speech_prob > 0.8`` and ``avg_logprob < -0.5``."""
    if r.no_speech_prob > NO_SPEECH_THRESHOLD and r.avg_logprob < LOGPROB_THRESHOLD:
        return True
    if r.no_speech_prob > NO_SPEECH_THRESHOLD_SURE and r.avg_logprob < LOGPROB_THRESHOLD_SURE:
        return True
    return r.fallback_exhausted and r.no_speech_prob > NO_SPEECH_THRESHOLD_UNCONFIDENT
