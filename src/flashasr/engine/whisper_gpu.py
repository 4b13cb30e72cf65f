"""Fast batched Whisper decoding: static KV cache, one CUDA graph per (batch bucket, span).

Built on the modules and weights of an existing :class:`~flashasr.models.whisper.model.WhisperModel`
(no copy of the weights) and the reference decoding rules of
:mod:`flashasr.models.whisper.decoding` (the same :class:`LogitRules` object is called inside the
graph), so greedy results equal :func:`~flashasr.models.whisper.decoding.decode_windows`.

Data flow for ``B`` windows (``L`` decoder layers, ``H`` heads, ``Dh = D / H``, ``A`` = 1500
encoder frames, ``N`` = ``n_text_ctx`` = 448 positions, ``Bb`` = smallest bucket >= B):

1. encoder: log-mel ``[B, n_mels, 3000]`` -> ``[B, A, D]`` in the model's dtype (fp16/bf16 on
   GPU), in chunks of ``encoder_batch`` windows;
2. static buffers, allocated once for the largest bucket and shared by every bucket (a bucket
   uses the first ``Bb`` rows): self-attention cache ``[L, Bmax, H, N, Dh]`` (K and V),
   cross-attention cache ``[L, Bmax, H, A, Dh]`` (K and V, computed ONCE per batch), per-row
   decoding state (current token, timestamp-rule state, finished flag, emitted tokens
   ``[Bmax, N]``, their log-probabilities, summed log-probability in float64);
3. the prompt (``[sot]`` or ``[sot, <|lang|>, <|task|>]``) is run eagerly through the reference
   :meth:`WhisperModel.decode_step` writing into views of the static cache, then the first
   token is chosen eagerly (its rules differ: suppress blank, initial timestamp);
4. every later token is ONE replay of a CUDA graph that holds the whole step: embedding of the
   current token at the device-side position, ``L`` decoder blocks (self-attention over the
   first ``span`` cached positions with a ``position <= pos`` mask, cross-attention over the
   fixed encoder K/V, MLP), tied output projection, the reference logit rules
   (:meth:`LogitRules.apply`), greedy argmax, log-probability, per-row stop at eot (finished rows
   keep running but are masked: nothing they produce is kept) and the state update. The host
   only replays graphs; every ``check_every`` steps it reads (asynchronously, one step group
   late) whether all rows have finished. ``span`` is the smallest of ``spans`` (64, 128, 256,
   448) above the current position: attention cost follows the decoded length.
5. rows are read back once at the end and turned into
   :class:`~flashasr.models.whisper.decoding.DecodingResult` (same fields as the reference).

On CPU (or ``use_graphs=False``) the same step function runs eagerly: CI checks this path
against the reference decoding token by token. Temperature fallback (sampling) is not graphed:
:class:`WhisperGPUASR` re-decodes the rows that need it with the reference
:func:`decode_with_fallback` (rare).
"""

from __future__ import annotations

import logging
import time
from typing import Sequence

import torch
import torch.nn.functional as F

from ..errors import FlashASRError
from ..models.whisper.decoding import (DecodingResult, LogitRules, compression_ratio, decode_with_fallback,
                                       needs_fallback)
from ..models.whisper.asr import WhisperASR
from ..models.whisper.model import KVCache, WhisperModel
from ..models.whisper.tokenizer import WhisperTokenizer
from .capture import graph_capture

log = logging.getLogger(__name__)

__all__ = ["WhisperGPUEngine", "WhisperGPUASR", "WhisperEngineError", "DEFAULT_BUCKETS", "DEFAULT_SPANS",
           "batch_for_memory", "kv_cache_bytes_per_row"]

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
DEFAULT_SPANS = (64, 128, 256, 448)


def _merge(x: torch.Tensor) -> torch.Tensor:
    """``[B, H, T, Dh]`` -> ``[B, T, H * Dh]``."""
    b, h, t, dh = x.shape
    return x.transpose(1, 2).reshape(b, t, h * dh)


class WhisperEngineError(FlashASRError):
    """Bad use of the Whisper decoding engine (batch too large, mixed prompt lengths, bad shapes)."""

    code = "whisper_engine_error"
    status = 400


class _State:
    """Static buffers shared by all buckets (a bucket uses rows ``[:Bb]``)."""

    def __init__(self, model: WhisperModel, bmax: int, device, dtype):
        d = model.dims
        L, H = d.n_text_layer, d.n_text_head
        dh, N, A = d.n_text_state // H, d.n_text_ctx, d.n_audio_ctx
        z = dict(device=device)
        self.bmax = bmax
        self.self_k = torch.zeros(L, bmax, H, N, dh, dtype=dtype, **z)
        self.self_v = torch.zeros_like(self.self_k)
        self.cross_k = torch.zeros(L, bmax, H, A, dh, dtype=dtype, **z)
        self.cross_v = torch.zeros_like(self.cross_k)
        self.cur = torch.zeros(bmax, dtype=torch.long, **z)       # token fed at the next step
        self.pos = torch.zeros(1, dtype=torch.long, **z)          # its position
        self.step = torch.zeros(1, dtype=torch.long, **z)         # index of the token being chosen
        self.last = torch.zeros(bmax, dtype=torch.bool, **z)      # timestamp-rule state
        self.pen = torch.ones(bmax, dtype=torch.bool, **z)
        self.last_tok = torch.full((bmax,), -1, dtype=torch.long, **z)
        self.done = torch.ones(bmax, dtype=torch.bool, **z)
        self.hit_eot = torch.zeros(bmax, dtype=torch.bool, **z)
        self.n_tok = torch.zeros(bmax, dtype=torch.long, **z)
        self.sum_lp = torch.zeros(bmax, dtype=torch.float64, **z)
        self.out_tok = torch.zeros(bmax, N, dtype=torch.long, **z)
        self.out_lp = torch.zeros(bmax, N, dtype=torch.float32, **z)
        self.min_len = torch.zeros(bmax, dtype=torch.long, **z)   # forced lengths (benchmarks)
        self.max_len = torch.full((bmax,), N, dtype=torch.long, **z)
        self.positions = torch.arange(N, **z)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in vars(self).values() if isinstance(t, torch.Tensor))


class WhisperGPUEngine:
    """Batched greedy Whisper decoding with a static KV cache and CUDA-graph decode steps.

    Args:
        model: a loaded :class:`WhisperModel` (its modules and weights are used as they are; put it
            in fp16/bf16 on CUDA for speed, e.g. ``load_model(..., device="cuda", dtype="float16")``).
        tokenizer: its :class:`WhisperTokenizer`.
        buckets: batch sizes with a captured graph; a batch of ``B`` runs in the smallest bucket
            ``>= B`` (padding rows are finished from the start). Batches above the largest
            bucket are split.
        max_batch: largest bucket actually used (buffers are sized for it); default: the largest
            bucket.
        spans: self-attention spans (positions) with a graph each (the last one is ``n_text_ctx``).
        use_graphs: capture CUDA graphs (CUDA only; on CPU the step runs eagerly).
        encoder_batch: windows per encoder call.
        check_every: decode steps between the (asynchronous) all-finished checks on CUDA.
    Raises:
        WhisperEngineError: empty or bad bucket/span lists.
    """

    def __init__(self, model: WhisperModel, tokenizer: WhisperTokenizer, *,
                 buckets: Sequence[int] = DEFAULT_BUCKETS, max_batch: int | None = None,
                 spans: Sequence[int] = DEFAULT_SPANS, use_graphs: bool = True, encoder_batch: int = 32,
                 check_every: int = 4):
        self.model = model
        self.tok = tokenizer
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        n_ctx = model.dims.n_text_ctx
        bs = sorted({int(b) for b in buckets if int(b) > 0})
        if not bs:
            raise WhisperEngineError("buckets must hold at least one positive batch size")
        if max_batch is not None:
            bs = [b for b in bs if b < max_batch] + [int(max_batch)]
        self.buckets = bs
        self.max_batch = bs[-1]
        sp = sorted({min(int(s), n_ctx) for s in spans if int(s) > 0} | {n_ctx})
        self.spans = sp
        self.use_graphs = bool(use_graphs and self.device.type == "cuda")
        self.encoder_batch = max(1, int(encoder_batch))
        self.check_every = max(1, int(check_every))
        self._state: _State | None = None
        self._rules: dict[bool, LogitRules] = {}
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._pool = None
        self._flag = None
        self._eot_col = torch.zeros(model.dims.n_vocab, dtype=torch.bool, device=self.device)
        self._eot_col[tokenizer.eot] = True
        self.stats = {"captures": 0, "capture_s": 0.0, "replays": 0, "eager_steps": 0, "batches": 0}

    # ------------------------------------------------------------------ helpers
    def bucket(self, n: int) -> int:
        """Smallest bucket holding ``n`` rows (``n <= max_batch``)."""
        for b in self.buckets:
            if b >= n:
                return b
        raise WhisperEngineError(f"{n} rows exceed the largest bucket ({self.max_batch})", code="batch_too_large")

    def _span(self, pos: int) -> int:
        for s in self.spans:
            if s > pos:
                return s
        raise WhisperEngineError(f"decoder position {pos} beyond n_text_ctx {self.spans[-1]}")

    def _get_state(self) -> _State:
        if self._state is None:
            self._state = _State(self.model, self.max_batch, self.device, self.dtype)
        return self._state

    def rules(self, without_timestamps: bool) -> LogitRules:
        if without_timestamps not in self._rules:
            self._rules[without_timestamps] = LogitRules(self.tok, self.model.dims.n_vocab, self.device,
                                                         without_timestamps=without_timestamps)
        return self._rules[without_timestamps]

    @torch.inference_mode()
    def encode(self, mel: torch.Tensor) -> torch.Tensor:
        """Encoder over ``mel [B, n_mels, 3000]`` (any float dtype/device) in chunks of
        ``encoder_batch``; returns ``[B, 1500, D]`` in the model's dtype on its device."""
        mel = mel.to(self.device)
        outs = [self.model.encode(mel[i: i + self.encoder_batch]) for i in range(0, mel.shape[0], self.encoder_batch)]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    # ------------------------------------------------------------------ the graphed step
    def _step(self, bb: int, span: int, rules: LogitRules, forced: bool) -> None:
        """One decode step for rows ``[:bb]`` of the static state (all tensor ops, no host sync)."""
        st = self._state
        dec = self.model.decoder
        pos = st.pos
        cur = st.cur[:bb]
        x = dec.embed(cur[:, None]) + dec.positions.index_select(0, pos)[None]  # [bb, 1, D]
        mask = (st.positions[:span] <= pos).view(1, 1, 1, span)
        for i, layer in enumerate(dec.layers):
            q, k, v = layer.self_attn.project(layer.self_attn_norm(x))  # [bb, H, 1, Dh]
            sk, sv = st.self_k[i, :bb], st.self_v[i, :bb]
            sk.index_copy_(2, pos, k)
            sv.index_copy_(2, pos, v)
            a = F.scaled_dot_product_attention(q, sk[:, :, :span], sv[:, :, :span], attn_mask=mask)
            x = x + layer.self_attn.out(_merge(a))
            h = layer.cross_attn_norm(x)
            qc = layer.cross_attn.q(h).view(bb, 1, layer.cross_attn.heads, -1).transpose(1, 2)
            a = F.scaled_dot_product_attention(qc, st.cross_k[i, :bb], st.cross_v[i, :bb])
            x = x + layer.cross_attn.out(_merge(a))
            x = x + layer.fc2(F.gelu(layer.fc1(layer.ffn_norm(x))))
        x = dec.norm(x)
        logits = (x[:, 0] @ dec.embed.weight.to(x.dtype).T).float()  # [bb, V]
        last, pen, last_tok = st.last[:bb], st.pen[:bb], st.last_tok[:bb]
        filtered = rules.apply(logits, 1, (last, pen, last_tok))  # step > 0 branch of the reference
        self._choose(filtered, bb, forced)

    def _choose(self, filtered: torch.Tensor, bb: int, forced: bool) -> None:
        """Greedy choice + state update (shared by the eager first step and the graphed steps)."""
        st = self._state
        eot = self.tok.eot
        n_tok, done = st.n_tok[:bb], st.done[:bb]
        if forced:
            is_eot_col = self._eot_col
            under = (n_tok < st.min_len[:bb])[:, None]
            over = (n_tok >= st.max_len[:bb])[:, None]
            filtered = filtered.masked_fill(under & is_eot_col[None], float("-inf"))
            filtered = filtered.masked_fill(over & ~is_eot_col[None], float("-inf"))
            filtered = filtered.masked_fill(over & is_eot_col[None], 0.0)
        nxt = filtered.argmax(dim=-1)
        lp = F.log_softmax(filtered, dim=-1).gather(1, nxt[:, None])[:, 0]
        act = ~done
        st.sum_lp[:bb] += torch.where(act, lp.double(), torch.zeros_like(lp, dtype=torch.float64))
        is_eot = nxt == eot
        st.hit_eot[:bb] |= act & is_eot
        emit = act & ~is_eot
        st.out_tok[:bb].index_copy_(1, st.step, torch.where(emit, nxt, torch.full_like(nxt, eot))[:, None])
        st.out_lp[:bb].index_copy_(1, st.step, lp[:, None])
        n_tok += emit.long()
        done |= is_eot
        is_ts = nxt >= self.tok.timestamp_begin
        st.pen[:bb].copy_(st.last[:bb])
        st.last[:bb].copy_(is_ts)
        st.last_tok[:bb].copy_(torch.where(is_ts, nxt, st.last_tok[:bb]))
        st.cur[:bb].copy_(nxt)
        st.pos += 1
        st.step += 1

    def _capture(self, bb: int, span: int, without_timestamps: bool, forced: bool) -> None:
        """Capture the step graph for a key. Runs the step eagerly (warm-up) first: only call it
        before a batch's state is initialised."""
        st = self._state
        rules = self.rules(without_timestamps)
        t0 = time.perf_counter()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                st.pos.zero_()
                st.step.zero_()
                self._step(bb, span, rules, forced)
            st.pos.zero_()
            st.step.zero_()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with graph_capture(g, pool=self._pool, stream=s):
            self._step(bb, span, rules, forced)
        torch.cuda.synchronize()
        self._graphs[(bb, span, without_timestamps, forced)] = g
        self.stats["captures"] += 1
        self.stats["capture_s"] += time.perf_counter() - t0

    def warmup(self, batch_sizes: Sequence[int] | None = None, *, without_timestamps: bool = False,
               forced: bool = False, sample_len: int | None = None, prompt_len: int | None = None) -> None:
        """Capture the graphs of the buckets holding ``batch_sizes`` (default all buckets) for all
        spans a decode of ``prompt_len + sample_len`` positions needs (CUDA graphs only)."""
        if not self.use_graphs:
            return
        n_ctx = self.model.dims.n_text_ctx
        p_len = prompt_len or len(self.tok.prompt("en", without_timestamps=without_timestamps))
        last_pos = p_len + min(sample_len or n_ctx // 2, n_ctx - p_len) - 1
        spans = [s for s in self.spans if s <= self._span(last_pos)]
        with torch.inference_mode():
            self._get_state()
            for b in sorted({self.bucket(int(n)) for n in (batch_sizes or self.buckets)}, reverse=True):
                for sp in spans:
                    if (b, sp, without_timestamps, forced) not in self._graphs:
                        self._capture(b, sp, without_timestamps, forced)

    # ------------------------------------------------------------------ public decode
    @torch.inference_mode()
    def decode(self, audio_features: torch.Tensor, languages: Sequence[str | None], *,
               without_timestamps: bool = False, sample_len: int | None = None, task: str = "transcribe",
               forced_lengths: Sequence[int] | None = None) -> list[DecodingResult]:
        """Greedy-decode a batch of windows (the reference's rules; temperature 0).

        Args:
            audio_features: encoder output ``[B, 1500, D]`` (B may exceed ``max_batch``: split).
            languages: per row ISO code (all prompts must have the same length; English-only
                models ignore it).
            without_timestamps: decode without timestamp tokens (``<|notimestamps|>`` rules).
            sample_len: most tokens sampled per row (default ``n_text_ctx // 2`` = 224).
            forced_lengths: benchmarks only: row ``r`` emits exactly ``forced_lengths[r]`` tokens
                and then eot (eot is masked before, everything else after), whatever the logits.
        Returns:
            one :class:`DecodingResult` per row (``temperature = 0``), as
            :func:`~flashasr.models.whisper.decoding.decode_windows` returns.
        Raises:
            WhisperEngineError: bad feature shape, ``languages``/``forced_lengths`` length mismatch.
        """
        d = self.model.dims
        if audio_features.ndim != 3 or audio_features.shape[1:] != (d.n_audio_ctx, d.n_audio_state):
            raise WhisperEngineError(f"expected audio features [B, {d.n_audio_ctx}, {d.n_audio_state}], "
                                     f"got {tuple(audio_features.shape)}")
        b = audio_features.shape[0]
        if len(languages) != b:
            raise WhisperEngineError(f"{len(languages)} languages for {b} rows")
        if forced_lengths is not None and len(forced_lengths) != b:
            raise WhisperEngineError(f"{len(forced_lengths)} forced lengths for {b} rows")
        out: list[DecodingResult] = []
        for i in range(0, b, self.max_batch):
            j = min(b, i + self.max_batch)
            fl = None if forced_lengths is None else list(forced_lengths[i:j])
            out += self._decode_chunk(audio_features[i:j], list(languages[i:j]), without_timestamps,
                                      sample_len, task, fl)
        return out

    def _decode_chunk(self, feats, languages, without_timestamps, sample_len, task, forced_lengths):
        tok, model = self.tok, self.model
        b = feats.shape[0]
        dev = self.device
        n_ctx = model.dims.n_text_ctx
        prompts = [tok.prompt(lang, task, without_timestamps=without_timestamps) for lang in languages]
        p_len = len(prompts[0])
        if any(len(p) != p_len for p in prompts):
            raise WhisperEngineError("all rows of a batch need prompts of the same length")
        sample_len = min(sample_len or n_ctx // 2, n_ctx - p_len)
        forced = forced_lengths is not None
        bb = self.bucket(b)
        st = self._get_state()
        rules = self.rules(without_timestamps)
        if self.use_graphs:  # capture before the state is set (warm-up runs mutate it)
            self.warmup([bb], without_timestamps=without_timestamps, forced=forced, sample_len=sample_len,
                        prompt_len=p_len)
        self.stats["batches"] += 1
        feats = feats.to(device=dev, dtype=self.dtype)
        # cross-attention K/V: once per batch
        for i, layer in enumerate(model.decoder.layers):
            k, v = layer.cross_attn.project_kv(feats)
            st.cross_k[i, :b].copy_(k)
            st.cross_v[i, :b].copy_(v)
        # state of rows [:bb]: real rows active, padding rows finished
        st.done[:bb].fill_(True)
        st.done[:b].fill_(False)
        st.hit_eot[:bb].zero_()
        st.n_tok[:bb].zero_()
        st.sum_lp[:bb].zero_()
        st.last[:bb].zero_()
        st.pen[:bb].fill_(True)
        st.last_tok[:bb].fill_(-1)
        st.cur[:bb].fill_(tok.eot)
        if forced:
            fl = torch.tensor([int(x) for x in forced_lengths], dtype=torch.long)
            st.min_len[:b].copy_(fl)
            st.max_len[:b].copy_(fl)
        st.min_len[b:bb].zero_()
        st.max_len[b:bb].fill_(n_ctx)
        # prompt through the reference decode_step, writing into views of the static cache
        cache = KVCache([st.self_k[i, :b] for i in range(len(model.decoder.layers))],
                        [st.self_v[i, :b] for i in range(len(model.decoder.layers))],
                        [st.cross_k[i, :b] for i in range(len(model.decoder.layers))],
                        [st.cross_v[i, :b] for i in range(len(model.decoder.layers))])
        prompt = torch.tensor(prompts, dtype=torch.long, device=dev)
        logits_all = model.decode_step(prompt, cache, 0)  # [b, P, V]
        no_speech = torch.softmax(logits_all[:, 0], dim=-1)[:, tok.no_speech]
        first = torch.zeros(bb, logits_all.shape[-1], dtype=torch.float32, device=dev)
        first[:b] = logits_all[:, -1]
        filtered = rules.apply(first, 0, (st.last[:bb], st.pen[:bb], st.last_tok[:bb]))
        st.pos.fill_(p_len)
        st.step.zero_()
        self._choose(filtered, bb, forced)  # step 0 (pos/step advance to p_len + 1 / 1)
        st.pos.fill_(p_len)  # the token chosen at step 0 is fed at position p_len
        st.pen[:bb].fill_(True)  # reference: pen = ones after the first step
        # steps 1 .. sample_len - 1
        pending = None
        for s in range(1, sample_len):
            pos = p_len + s - 1
            span = self._span(pos)
            if self.use_graphs:
                self._graphs[(bb, span, without_timestamps, forced)].replay()
                self.stats["replays"] += 1
                if s % self.check_every == 0:
                    if pending is not None:
                        pending.synchronize()
                        if bool(self._flag[0]):
                            break
                    if self._flag is None:
                        self._flag = torch.zeros(1, dtype=torch.bool, pin_memory=True)
                    self._flag.copy_(st.done[:b].all().view(1), non_blocking=True)
                    pending = torch.cuda.Event()
                    pending.record()
            else:
                if bool(st.done[:b].all()):
                    break
                self._step(bb, span, rules, forced)
                self.stats["eager_steps"] += 1
        n_tok = st.n_tok[:b].cpu().tolist()
        m = max(n_tok) if n_tok else 0
        toks = st.out_tok[:b, :m].cpu().tolist()
        lps = st.out_lp[:b, :m].cpu().tolist()
        sums = st.sum_lp[:b].cpu().tolist()
        hits = st.hit_eot[:b].cpu().tolist()
        ns = no_speech.cpu().tolist()
        out = []
        for r in range(b):
            t = toks[r][: n_tok[r]]
            text = tok.decode(t)
            out.append(DecodingResult(
                tokens=t, token_logprobs=lps[r][: n_tok[r]], text=text,
                language=languages[r] if tok.multilingual else "en",
                avg_logprob=sums[r] / (len(t) + 1), sum_logprob=sums[r], no_speech_prob=float(ns[r]),
                temperature=0.0, compression_ratio=compression_ratio(text), hit_eot=bool(hits[r])))
        return out

    def memory_report(self) -> dict:
        """Static buffer bytes, graphs captured, capture seconds."""
        return {"state_mib": round(self._state.nbytes() / 2**20, 1) if self._state else 0.0,
                "graphs": len(self._graphs), **{k: (round(v, 3) if isinstance(v, float) else v)
                                                for k, v in self.stats.items()}}


def kv_cache_bytes_per_row(model: WhisperModel) -> int:
    """Bytes of static KV cache one batch row holds: K and V of self-attention (``n_text_ctx``
    positions) and cross-attention (``n_audio_ctx`` frames) in every decoder layer, in the model's
    dtype (large-v3 fp16: 304 MiB a row; tiny.en fp16: 11 MiB)."""
    d = model.dims
    item = next(model.parameters()).element_size()
    return 2 * d.n_text_layer * (d.n_text_ctx + d.n_audio_ctx) * d.n_text_state * item


def batch_for_memory(model: WhisperModel, *, fraction: float = 0.25, largest: int = DEFAULT_BUCKETS[-1]) -> int:
    """The largest bucket (a power of two, 1 .. ``largest``) whose static KV cache takes at most
    ``fraction`` of the GPU memory free now: large-v3 on a 24 GB card gets a few rows, not the 128
    rows (31 GB) that fit an H200. On a CPU model: ``largest``."""
    p = next(model.parameters())
    if p.device.type != "cuda":
        return largest
    free, _total = torch.cuda.mem_get_info(p.device)
    rows = int(fraction * free // max(1, kv_cache_bytes_per_row(model)))
    b = 1
    while b * 2 <= min(rows, largest):
        b *= 2
    return b


class WhisperGPUASR(WhisperASR):
    """A :class:`WhisperASR` whose windows are encoded and greedily decoded by a
    :class:`WhisperGPUEngine`; everything else (log-mel, seek, segments, language detection,
    word alignment, no-speech rule) is the reference procedure, so transcripts equal
    :meth:`WhisperASR.transcribe_batch`. Rows that need temperature fallback are decoded again by
    the reference :func:`decode_with_fallback` (greedy, then sampling seeded per window as the
    reference does). Shares ``asr``'s model object, weights and tokenizer.

    Args:
        asr: a loaded :class:`WhisperASR`.
        engine: a :class:`WhisperGPUEngine` over ``asr.model`` (default: built with
            ``engine_kwargs``; its ``max_batch`` by default :func:`batch_for_memory`).
    Raises:
        WhisperEngineError: ``asr`` is not a Whisper model, or ``engine`` uses another model.
    """

    def __init__(self, asr: WhisperASR, engine: WhisperGPUEngine | None = None, **engine_kwargs):
        if not isinstance(asr, WhisperASR):
            raise WhisperEngineError(f"WhisperGPUASR needs a WhisperASR, got {type(asr).__name__}")
        if engine is None and "max_batch" not in engine_kwargs:
            engine_kwargs["max_batch"] = batch_for_memory(asr.model)
        engine = engine or WhisperGPUEngine(asr.model, asr.tokenizer, **engine_kwargs)
        if engine.model is not asr.model:
            raise WhisperEngineError("the engine must decode the same model object as the ASR")
        super().__init__(asr.model, asr.tokenizer, name=asr.name, device=asr.device,
                         alignment_heads=asr.alignment_heads, max_batch=engine.max_batch)
        self.engine = engine

    def _encode(self, mels: torch.Tensor) -> torch.Tensor:
        return self.engine.encode(mels)

    def _cross_kv(self, feats, settings):
        """The engine's captured decoder holds its own cross K/V: a shared copy only for word alignment."""
        return self.model.cross_kv(feats) if settings.word_timestamps else None

    def _decode(self, feats, languages, seeds, prefix, settings, cross=None):
        """Greedy windows through the CUDA graphs; rows that need temperature fallback again through
        the reference. A prompt prefix, a first temperature above 0 or translation (the captured steps
        hold the plain transcribe prompt): the reference decoding."""
        if settings.task != "transcribe" or prefix or settings.temperatures[0] > 0:
            return super()._decode(feats, languages, seeds, prefix, settings, cross=cross)
        results = self.engine.decode(feats, languages)
        redo = [k for k, r in enumerate(results) if needs_fallback(r)]
        if redo:
            idx = torch.tensor(redo, device=feats.device)
            again = decode_with_fallback(self.model, self.tokenizer, feats.index_select(0, idx),
                                         [languages[k] for k in redo], seeds=[seeds[k] for k in redo],
                                         temperatures=settings.temperatures,
                                         cross=None if cross is None else cross.rows(idx))
            for k, r in zip(redo, again):
                results[k] = r
        return results


