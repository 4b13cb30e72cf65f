"""Our own PyTorch Whisper encoder-decoder (every size: tiny ... large-v3 / large-v3-turbo).

Architecture facts follow the Whisper paper (Radford et al. 2022, "Robust Speech Recognition
via Large-Scale Weak Supervision") and OpenAI's reference implementation:

* Encoder: log-mel ``[B, n_mels, 3000]`` -> conv1d(k=3, s=1) + GELU -> conv1d(k=3, s=2) + GELU
  -> ``[B, 1500, D]`` + sinusoidal positions -> ``n_audio_layer`` pre-LN transformer blocks
  (self-attention, 4x GELU MLP) -> final LayerNorm.
* Decoder: token embedding + learned positions (``n_text_ctx`` = 448) -> ``n_text_layer`` pre-LN
  blocks (causal self-attention with a KV cache, cross-attention over the encoder output, MLP)
  -> final LayerNorm -> logits against the tied token embedding.

Our internal parameter layout (what every loader in :mod:`.loaders` maps to) fuses the
self-attention projections into one ``qkv`` linear (the key projection has no bias in Whisper;
its bias slot is zero) and the cross-attention key/value projections into one ``kv`` linear.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["WhisperDims", "WhisperModel", "KVCache", "CrossKV", "sinusoids"]


@dataclass(frozen=True)
class WhisperDims:
    """Hyper-parameters of one Whisper checkpoint (names follow OpenAI's ``ModelDimensions``).

    ``n_mels``: 80 (tiny..large-v2) or 128 (large-v3, large-v3-turbo). ``n_audio_ctx``: encoder
    frames after the stride-2 conv (1500 for a 30 s window). ``n_text_ctx``: decoder positions (448).
    ``n_*_state``: model width D; ``n_*_head``: attention heads; ``n_*_layer``: blocks. Decoder depth
    is independent of encoder depth (large-v3-turbo: 32 encoder, 4 decoder layers).
    """

    n_mels: int
    n_audio_ctx: int
    n_audio_state: int
    n_audio_head: int
    n_audio_layer: int
    n_vocab: int
    n_text_ctx: int
    n_text_state: int
    n_text_head: int
    n_text_layer: int

    def to_dict(self) -> dict:
        return asdict(self)


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """Whisper's encoder position table, float32 ``[length, channels]``: ``[sin | cos]`` halves
    with geometric timescales from 1 to ``max_timescale`` (the reference's formula)."""
    if channels % 2:
        raise ValueError("channels must be even")
    half = channels // 2
    inc = math.log(max_timescale) / (half - 1)
    # on the CPU explicitly: under a meta-device context (models are built on "meta", then their
    # weights assigned) torch.arange goes through a decomposition that imports TorchDynamo (1 s)
    inv = torch.exp(-inc * torch.arange(half, dtype=torch.float32, device="cpu"))
    t = torch.arange(length, dtype=torch.float32, device="cpu")[:, None] * inv[None, :]
    return torch.cat([torch.sin(t), torch.cos(t)], dim=1)


class _SelfAttention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def project(self, x: torch.Tensor):
        b, t, d = x.shape
        qkv = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return qkv[0], qkv[1], qkv[2]  # each [B, H, T, Dh]


class _CrossAttention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(d, d)
        self.kv = nn.Linear(d, 2 * d)
        self.out = nn.Linear(d, d)

    def project_kv(self, xa: torch.Tensor):
        b, t, d = xa.shape
        kv = self.kv(xa).view(b, t, 2, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return kv[0], kv[1]  # each [B, H, T_audio, Dh]


def _merge(x: torch.Tensor) -> torch.Tensor:
    b, h, t, dh = x.shape
    return x.transpose(1, 2).reshape(b, t, h * dh)


class _EncoderLayer(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.self_attn_norm = nn.LayerNorm(d)
        self.self_attn = _SelfAttention(d, heads)
        self.ffn_norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.self_attn.project(self.self_attn_norm(x))
        x = x + self.self_attn.out(_merge(F.scaled_dot_product_attention(q, k, v)))
        return x + self.fc2(F.gelu(self.fc1(self.ffn_norm(x))))


class _DecoderLayer(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.self_attn_norm = nn.LayerNorm(d)
        self.self_attn = _SelfAttention(d, heads)
        self.cross_attn_norm = nn.LayerNorm(d)
        self.cross_attn = _CrossAttention(d, heads)
        self.ffn_norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)


class KVCache:
    """Decoder key/value cache: static, pre-allocated per batch.

    ``self_k[l]``/``self_v[l]``: ``[B, H, max_len, Dh]`` (positions written as tokens are fed);
    ``cross_k[l]``/``cross_v[l]``: ``[B, H, T_audio, Dh]``, computed once per audio window by
    :meth:`WhisperModel.new_cache`. Buffers never change shape during decoding, so a CUDA-graph
    capture of :meth:`WhisperModel.decode_step` can reuse them.
    """

    def __init__(self, self_k, self_v, cross_k, cross_v):
        self.self_k, self.self_v, self.cross_k, self.cross_v = self_k, self_v, cross_k, cross_v

    @property
    def batch_size(self) -> int:
        return self.cross_k[0].shape[0]

    def select(self, rows: torch.Tensor) -> "KVCache":
        """A new cache holding only batch rows ``rows`` (int64 ``[B']``), e.g. the unfinished ones."""
        def sel(ts):
            return [t.index_select(0, rows) for t in ts]

        return KVCache(sel(self.self_k), sel(self.self_v), sel(self.cross_k), sel(self.cross_v))


@dataclass
class CrossKV:
    """Cross-attention keys and values of a batch of audio windows, one tensor per decoder layer,
    each ``[B, H, T_audio, Dh]`` in the model's dtype (:meth:`WhisperModel.cross_kv`). They depend on
    the window only, so one copy serves language detection, every decoding try and word alignment."""

    k: list
    v: list

    def rows(self, idx: torch.Tensor) -> "CrossKV":
        """Only batch rows ``idx`` (int64 ``[B']``)."""
        return CrossKV([t.index_select(0, idx) for t in self.k], [t.index_select(0, idx) for t in self.v])


class WhisperModel(nn.Module):
    """Whisper encoder-decoder; see the module docstring for the data flow.

    Parameters live in our layout (``encoder.*``, ``decoder.*``); :meth:`load_state_dict`
    expects exactly the keys of :meth:`state_dict` (loaders convert other layouts).
    """

    def __init__(self, dims: WhisperDims):
        super().__init__()
        self.dims = dims
        d_a, d_t = dims.n_audio_state, dims.n_text_state
        enc = nn.Module()
        enc.conv1 = nn.Conv1d(dims.n_mels, d_a, kernel_size=3, padding=1)
        enc.conv2 = nn.Conv1d(d_a, d_a, kernel_size=3, stride=2, padding=1)
        enc.register_buffer("positions", sinusoids(dims.n_audio_ctx, d_a))
        enc.layers = nn.ModuleList([_EncoderLayer(d_a, dims.n_audio_head) for _ in range(dims.n_audio_layer)])
        enc.norm = nn.LayerNorm(d_a)
        self.encoder = enc
        dec = nn.Module()
        # the weight given: no random init (a normal_ on the meta device imports TorchDynamo, 1 s of
        # start-up); zeros, not empty, so a model built without a checkpoint never holds stale memory
        dec.embed = nn.Embedding(dims.n_vocab, d_t, _weight=torch.zeros(dims.n_vocab, d_t))
        dec.positions = nn.Parameter(torch.zeros(dims.n_text_ctx, d_t))
        dec.layers = nn.ModuleList([_DecoderLayer(d_t, dims.n_text_head) for _ in range(dims.n_text_layer)])
        dec.norm = nn.LayerNorm(d_t)
        self.decoder = dec

    # ---- encoder -------------------------------------------------------------------------
    def encode(self, mel: torch.Tensor) -> torch.Tensor:
        """Encoder forward.

        Args:
            mel: log-mel ``[B, n_mels, 2 * n_audio_ctx]`` (3000 frames = 30 s), any float dtype
                (cast to the weights' dtype).
        Returns:
            ``[B, n_audio_ctx, n_audio_state]`` in the weights' dtype.
        Raises:
            ValueError: wrong number of mel bins or frames.
        """
        d = self.dims
        if mel.ndim != 3 or mel.shape[1] != d.n_mels or mel.shape[2] != 2 * d.n_audio_ctx:
            raise ValueError(f"expected log-mel [B, {d.n_mels}, {2 * d.n_audio_ctx}], got {tuple(mel.shape)}")
        e = self.encoder
        x = mel.to(e.conv1.weight.dtype)
        x = F.gelu(e.conv1(x))
        x = F.gelu(e.conv2(x)).transpose(1, 2)
        x = x + e.positions.to(x.dtype)
        for layer in e.layers:
            x = layer(x)
        return e.norm(x)

    # ---- decoder -------------------------------------------------------------------------
    def cross_kv(self, audio_features: torch.Tensor) -> CrossKV:
        """The decoder's cross-attention keys and values for encoder output ``[B, T_audio, D]``."""
        ck, cv = [], []
        for layer in self.decoder.layers:
            k, v = layer.cross_attn.project_kv(audio_features)
            ck.append(k.contiguous())
            cv.append(v.contiguous())
        return CrossKV(ck, cv)

    def new_cache(self, audio_features: torch.Tensor, max_len: int | None = None,
                  cross: CrossKV | None = None) -> KVCache:
        """Allocate a static KV cache with the cross-attention K/V of the audio.

        Args:
            audio_features: encoder output ``[B, T_audio, D]``.
            max_len: decoder positions to reserve (default ``n_text_ctx``).
            cross: :meth:`cross_kv` of ``audio_features`` when already computed (shared, not
                copied: decoding never writes them); None computes them here.
        """
        b = audio_features.shape[0]
        h = self.dims.n_text_head
        dh = self.dims.n_text_state // h
        n = max_len or self.dims.n_text_ctx
        dev, dt = audio_features.device, audio_features.dtype
        if cross is None:
            cross = self.cross_kv(audio_features)
        elif cross.k[0].shape[0] != b:
            raise ValueError(f"cross K/V of {cross.k[0].shape[0]} windows for {b} windows of audio features")
        sk = [torch.zeros(b, h, n, dh, device=dev, dtype=dt) for _ in self.decoder.layers]
        sv = [torch.zeros(b, h, n, dh, device=dev, dtype=dt) for _ in self.decoder.layers]
        return KVCache(sk, sv, list(cross.k), list(cross.v))

    def decode_step(self, tokens: torch.Tensor, cache: KVCache, offset: int,
                    return_cross_attn: bool = False):
        """Feed ``T`` new tokens at positions ``offset .. offset+T-1``; a pure function of
        (tokens, cache contents, offset) apart from writing K/V at those positions.

        Args:
            tokens: int64 ``[B, T]`` (T = prompt length on the first call, then 1).
            cache: from :meth:`new_cache` (same B).
            offset: number of positions already in the cache.
            return_cross_attn: also return per-layer pre-softmax cross-attention scores
                ``q k^T / sqrt(Dh)``, float32 ``[B, H, T, T_audio]`` (word alignment wants only a
                few heads of them: :meth:`alignment_scores`).
        Returns:
            logits float32 ``[B, T, n_vocab]`` (and the list of attention weights if asked).
        """
        dec = self.decoder
        t = tokens.shape[1]
        end = offset + t
        if end > cache.self_k[0].shape[2]:
            raise ValueError(f"decoder context overflow: {end} > {cache.self_k[0].shape[2]}")
        x = dec.embed(tokens) + dec.positions[offset:end]
        mask = None
        if t > 1:
            q_pos = torch.arange(offset, end, device=tokens.device)[:, None]
            k_pos = torch.arange(end, device=tokens.device)[None, :]
            mask = k_pos <= q_pos  # [T, end] True = attend
        weights = []
        for i in range(len(dec.layers)):
            x, scores = self._layer_step(i, x, cache, offset, mask, heads=slice(None) if return_cross_attn else None)
            weights.append(scores)
        x = dec.norm(x)
        logits = (x @ dec.embed.weight.to(x.dtype).T).float()
        if return_cross_attn:
            return logits, weights
        return logits

    def alignment_scores(self, tokens: torch.Tensor, cache: KVCache, heads) -> torch.Tensor:
        """Pre-softmax cross-attention scores ``q k^T / sqrt(Dh)`` of the alignment heads for a whole
        token sequence fed at position 0: what :meth:`decode_step` with ``return_cross_attn`` gives
        for those heads, without the layers after the last head's layer, the other heads' scores
        or the logits (word alignment needs none of them).

        Args:
            tokens: int64 ``[B, T]``; written into ``cache`` at positions ``0 .. T-1``.
            cache: from :meth:`new_cache` (same B, ``max_len >= T``).
            heads: ``[(layer, head), ...]``.
        Returns:
            float32 ``[B, len(heads), T, T_audio]``, in the order of ``heads``.
        """
        dec = self.decoder
        t = tokens.shape[1]
        by_layer: dict[int, list[int]] = {}
        for layer, head in heads:
            by_layer.setdefault(int(layer), []).append(int(head))
        x = dec.embed(tokens) + dec.positions[:t]
        mask = torch.ones(t, t, dtype=torch.bool, device=tokens.device).tril() if t > 1 else None
        got = {}
        for i in range(max(by_layer) + 1):
            x, scores = self._layer_step(i, x, cache, 0, mask, heads=by_layer.get(i))
            if scores is not None:
                got.update({(i, h): scores[:, n] for n, h in enumerate(by_layer[i])})
        return torch.stack([got[(int(layer), int(head))] for layer, head in heads], dim=1)

    def _layer_step(self, i: int, x: torch.Tensor, cache: KVCache, offset: int, mask, heads=None):
        """Decoder layer ``i`` on ``x`` ``[B, T, D]`` at positions ``offset ..`` (writes its self-attention
        K/V into ``cache``); returns (x, float32 cross-attention scores ``[B, len(heads), T, T_audio]``
        of ``heads`` (a list of head indices or a slice), or None when ``heads`` is None)."""
        layer = self.decoder.layers[i]
        b, t = x.shape[:2]
        end = offset + t
        q, k, v = layer.self_attn.project(layer.self_attn_norm(x))
        cache.self_k[i][:, :, offset:end] = k
        cache.self_v[i][:, :, offset:end] = v
        a = F.scaled_dot_product_attention(q, cache.self_k[i][:, :, :end], cache.self_v[i][:, :, :end],
                                           attn_mask=mask)
        x = x + layer.self_attn.out(_merge(a))
        qc = layer.cross_attn.q(layer.cross_attn_norm(x))
        qc = qc.view(b, t, layer.cross_attn.heads, -1).transpose(1, 2)
        scores = None
        if heads is not None:
            scores = (qc[:, heads].float() @ cache.cross_k[i][:, heads].float().transpose(-1, -2)) * qc.shape[-1] ** -0.5
        a = F.scaled_dot_product_attention(qc, cache.cross_k[i], cache.cross_v[i])
        x = x + layer.cross_attn.out(_merge(a))
        x = x + layer.fc2(F.gelu(layer.fc1(layer.ffn_norm(x))))
        return x, scores

    def decode_step_static(self, tokens: torch.Tensor, cache: KVCache, positions: torch.Tensor) -> torch.Tensor:
        """One-token decoder step with only fixed shapes and no host synchronisation, for CUDA
        graph capture (and for rows at different positions, e.g. continuous batching).

        Args:
            tokens: int64 ``[B, 1]``.
            cache: :class:`KVCache`; its full ``max_len`` is attended with a mask, so the
                prompt must have been written by :meth:`decode_step` (or this method) before.
            positions: int64 ``[B]`` (on the model's device): each row's position; K/V are
                written there and keys at positions ``<= position`` are attended.
        Returns:
            logits float32 ``[B, n_vocab]``; equal (up to rounding) to
            ``decode_step(tokens, cache, offset)[:, -1]`` when all positions equal ``offset``.
        """
        dec = self.decoder
        b = tokens.shape[0]
        max_len = cache.self_k[0].shape[2]
        x = dec.embed(tokens) + dec.positions.index_select(0, positions)[:, None, :]
        mask = (torch.arange(max_len, device=tokens.device)[None, :] <= positions[:, None])[:, None, None, :]
        for i, layer in enumerate(dec.layers):
            q, k, v = layer.self_attn.project(layer.self_attn_norm(x))
            idx = positions.view(b, 1, 1, 1).expand(b, k.shape[1], 1, k.shape[3])
            cache.self_k[i].scatter_(2, idx, k)
            cache.self_v[i].scatter_(2, idx, v)
            a = F.scaled_dot_product_attention(q, cache.self_k[i], cache.self_v[i], attn_mask=mask)
            x = x + layer.self_attn.out(_merge(a))
            h = layer.cross_attn_norm(x)
            qc = layer.cross_attn.q(h).view(b, 1, layer.cross_attn.heads, -1).transpose(1, 2)
            a = F.scaled_dot_product_attention(qc, cache.cross_k[i], cache.cross_v[i])
            x = x + layer.cross_attn.out(_merge(a))
            x = x + layer.fc2(F.gelu(layer.fc1(layer.ffn_norm(x))))
        x = dec.norm(x)
        return (x[:, 0] @ dec.embed.weight.to(x.dtype).T).float()

    def num_parameters(self) -> int:
        """Parameter count (tied output projection counted once)."""
        return sum(p.numel() for p in self.parameters())
