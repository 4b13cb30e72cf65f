"""FastConformer encoder (NeMo 3.0.0 ``ConformerEncoder`` semantics, inference only).

Data flow for features ``[B, F, T]`` (F mel bins, 10 ms frames) and lengths ``[B]``:

1. ``pre_encode``: dw_striding subsampling by ``2 ** s`` (s stride-2 conv stages on the
   ``[B, 1, T, F]`` "image"; time steps at or beyond the current length zeroed before every
   conv and at the end, as NeMo 3.0.0's ``MaskedConvSequential``), then
   ``Linear(C * F', d_model)`` -> ``[B, T', d]``; ``T' = s x (L -> floor((L - 1) / 2) + 1)``.
2. optional xscaling (``x * sqrt(d_model)``) and relative positional encodings for positions
   ``T'-1 ... -(T'-1)`` (Transformer-XL sinusoids).
3. ``n_layers`` Conformer blocks (macaron FF with 0.5 residual, rel-pos MHSA, conv module,
   FF, ``norm_out``). Padding never changes valid frames: padded keys are masked in attention
   and padded steps are zeroed before the depthwise conv.
4. optional ``out_proj`` (``feat_out > 0``). Output ``[B, d, T']`` (channels first, as NeMo) or
   ``[B, T', d]`` with ``channels_last=True``; padded frames are not meaningful.

Attention: full attention (``att_context_size [-1, -1]``) runs through
``torch.nn.functional.scaled_dot_product_attention`` with the relative-position term passed as a
float ``attn_mask`` (same math as NeMo's explicit softmax); limited context (``rel_pos`` with a
finite ``att_context_size`` or ``rel_pos_local_attn``, NeMo's Longformer-style local attention)
runs a blocked band attention whose memory grows linearly with T.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import EncoderConfig

_MASK_VALUE = -10000.0  # NeMo INF_VAL used by masked_fill in attention


class DwStridingSubsampling(nn.Module):
    """NeMo ``ConvSubsampling`` with ``subsampling: dw_striding`` (+ 3.0.0 time masking).

    State-dict layout: ``conv.0`` Conv2d(1, C, 3, s2, p1); per further stage ``conv.{3k-1}``
    depthwise Conv2d(C, C, 3, s2, p1, groups=C) and ``conv.{3k}`` pointwise Conv2d(C, C, 1);
    ReLU after ``conv.0`` and after each pointwise conv; ``out`` Linear(C * F', d_model).
    Convolutions always have biases.
    """

    def __init__(self, feat_in: int, d_model: int, factor: int, channels: int):
        super().__init__()
        self.stages = int(round(math.log2(factor)))
        layers: list[nn.Module] = [nn.Conv2d(1, channels, 3, stride=2, padding=1), nn.ReLU()]
        for _ in range(self.stages - 1):
            layers += [nn.Conv2d(channels, channels, 3, stride=2, padding=1, groups=channels),
                       nn.Conv2d(channels, channels, 1), nn.ReLU()]
        self.conv = nn.Sequential(*layers)
        f = feat_in
        for _ in range(self.stages):
            f = (f + 2 - 3) // 2 + 1
        self.freq_out = f
        self.out = nn.Linear(channels * f, d_model)

    def output_lengths(self, lengths: torch.Tensor) -> torch.Tensor:
        """Encoder frames for ``lengths`` feature frames: ``stages`` x ``floor((L - 1) / 2) + 1``."""
        L = lengths.long()
        for _ in range(self.stages):
            L = torch.div(L + 2 - 3, 2, rounding_mode="floor") + 1
        return L

    # largest conv activation per call; bigger batches are split (PyTorch's 32-bit indexing limit,
    # NeMo's subsampling_conv_chunking_factor does the same); items are independent.
    max_conv_elements = 2 ** 31 - 1

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [B, T, F]``, ``lengths [B]`` -> ``[B, T', d_model]``, ``[B]`` int64."""
        B, T, Fq = x.shape
        C = self.conv[0].out_channels
        per_item = C * ((T + 1) // 2 + 1) * ((Fq + 1) // 2 + 1)
        if B > 1 and B * per_item > self.max_conv_elements:
            step = max(1, self.max_conv_elements // max(per_item, 1))
            outs = [self._forward(x[i:i + step], lengths[i:i + step]) for i in range(0, B, step)]
            return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])
        return self._forward(x, lengths)

    def _forward(self, x: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.unsqueeze(1)
        L = lengths.long()
        for layer in self.conv:
            if isinstance(layer, nn.Conv2d):
                keep = torch.arange(x.shape[2], device=x.device)[None, :] < L[:, None]
                x = x * keep[:, None, :, None].to(x.dtype)
                x = layer(x)
                if layer.stride[0] != 1:
                    L = torch.div(L + 2 * layer.padding[0] - layer.kernel_size[0], layer.stride[0],
                                  rounding_mode="floor") + 1
            else:
                x = layer(x)
        keep = torch.arange(x.shape[2], device=x.device)[None, :] < L[:, None]
        x = x * keep[:, None, :, None].to(x.dtype)
        b, c, t, f = x.shape
        x = self.out(x.transpose(1, 2).reshape(b, t, c * f))
        return x, L


def relative_positions(T: int, d_model: int, device=None, left: int | None = None,
                       right: int | None = None) -> torch.Tensor:
    """Sinusoidal encodings ``[P, d_model]`` float32 for relative positions.

    Default: positions ``T-1, T-2, ..., -(T-1)`` (``P = 2T - 1``, NeMo ``RelPositionalEncoding``
    sliced for T frames). With ``left``/``right``: positions ``left, ..., -right``.
    ``pe[:, 0::2] = sin(pos * div)``, ``pe[:, 1::2] = cos(pos * div)``,
    ``div = exp(arange(0, d, 2) * -(ln 10000 / d))``.
    """
    hi, lo = (T - 1, -(T - 1)) if left is None else (left, -right)
    pos = torch.arange(hi, lo - 1, -1, dtype=torch.float32, device=device).unsqueeze(1)
    div = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32, device=device)
                    * -(math.log(10000.0) / d_model))
    pe = torch.zeros(pos.shape[0], d_model, dtype=torch.float32, device=device)
    pe[:, 0::2] = torch.sin(pos * div)
    pe[:, 1::2] = torch.cos(pos * div)
    return pe


def _rel_shift(x: torch.Tensor) -> torch.Tensor:
    """Transformer-XL shift: ``x [..., T, 2T-1]`` (pos index p = position T-1-p) ->
    ``out[..., i, j] = x[..., i, T-1-i+j]`` for ``j < T`` (``[..., T, T]``)."""
    *lead, T, P = x.shape
    x = F.pad(x, (1, 0))
    x = x.view(*lead, P + 1, T)[..., 1:, :].reshape(*lead, T, P)
    return x[..., :T]


class RelPositionMultiHeadAttention(nn.Module):
    """Transformer-XL relative-position MHSA with per-layer ``pos_bias_u``/``pos_bias_v``.

    ``scores[i, j] = ((q_i + u) . k_j + (q_i + v) . p_{i-j}) / sqrt(d_k)``, where ``p_r =
    linear_pos(pe(r))``; masked entries get -10000 before the softmax and padded query rows
    output zeros before ``linear_out`` (NeMo ``RelPositionMultiHeadAttention``).
    """

    def __init__(self, d_model: int, n_heads: int, use_bias: bool):
        super().__init__()
        self.h = n_heads
        self.d_k = d_model // n_heads
        self.linear_q = nn.Linear(d_model, d_model, bias=use_bias)
        self.linear_k = nn.Linear(d_model, d_model, bias=use_bias)
        self.linear_v = nn.Linear(d_model, d_model, bias=use_bias)
        self.linear_out = nn.Linear(d_model, d_model, bias=use_bias)
        self.linear_pos = nn.Linear(d_model, d_model, bias=False)
        self.pos_bias_u = nn.Parameter(torch.zeros(n_heads, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.zeros(n_heads, self.d_k))

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        return x.view(B, T, self.h, self.d_k).transpose(1, 2)  # [B, H, T, d_k]

    def forward(self, x: torch.Tensor, valid: torch.Tensor, pos_emb: torch.Tensor,
                context: tuple[int, int] = (-1, -1), impl: str = "sdpa") -> torch.Tensor:
        """``x [B, T, d]``, ``valid [B, T]`` bool, ``pos_emb [2T-1, d]`` (full) -> ``[B, T, d]``.

        ``context = (left, right)``: attend only to ``i - left <= j <= i + right`` (-1 = unlimited),
        then ``pos_emb`` must be ``relative_positions`` for ``left+C-1 ... -(right+C-1)`` as built
        by :meth:`local_positions`. ``impl``: "sdpa" or "math" (explicit softmax, for checks).
        """
        B, T, _ = x.shape
        q = self._heads(self.linear_q(x))
        k = self._heads(self.linear_k(x))
        v = self._heads(self.linear_v(x))
        u = self.pos_bias_u.to(q.dtype)[None, :, None, :]
        w = self.pos_bias_v.to(q.dtype)[None, :, None, :]
        left, right = context
        if left >= 0 or right >= 0:
            out = self._local(q, k, v, u, w, valid, pos_emb, left, right)
        else:
            p = self.linear_pos(pos_emb.to(x.dtype)).view(1, -1, self.h, self.d_k).transpose(1, 2)
            bd = _rel_shift(torch.matmul(q + w, p.transpose(-2, -1)))  # [B, H, T, T]
            scale = 1.0 / math.sqrt(self.d_k)
            masked = ~(valid[:, None, :, None] & valid[:, None, None, :])  # [B, 1, T, T]
            if impl == "sdpa":
                bias = (bd * scale).masked_fill(masked, _MASK_VALUE)
                out = F.scaled_dot_product_attention(q + u, k, v, attn_mask=bias, scale=scale)
            else:
                scores = (torch.matmul(q + u, k.transpose(-2, -1)) + bd) * scale
                scores = scores.masked_fill(masked, _MASK_VALUE)
                attn = torch.softmax(scores, dim=-1).masked_fill(masked, 0.0)
                out = torch.matmul(attn, v)
        out = out * valid[:, None, :, None].to(out.dtype)  # fully padded query rows -> 0
        out = out.transpose(1, 2).reshape(B, T, self.h * self.d_k)
        return self.linear_out(out)

    @staticmethod
    def local_block(T: int) -> int:
        return max(1, min(T, 256))

    def _local(self, q, k, v, u, w, valid, pos_emb, left, right):
        """Band attention in query blocks of C frames; keys ``[s - left, s + C - 1 + right]``."""
        B, H, T, dk = q.shape
        left = T if left < 0 else min(left, T)
        right = T if right < 0 else min(right, T)
        C = self.local_block(T)
        nb = -(-T // C)
        W = C + left + right
        pad_end = nb * C - T
        kp = F.pad(k, (0, 0, left, right + pad_end))
        vp = F.pad(v, (0, 0, left, right + pad_end))
        vkey = F.pad(valid, (left, right + pad_end), value=False)
        kb = kp.unfold(2, W, C).transpose(-1, -2)  # [B, H, nb, W, dk]
        vb = vp.unfold(2, W, C).transpose(-1, -2)
        key_ok = vkey.unfold(1, W, C)  # [B, nb, W]
        qp = F.pad(q, (0, 0, 0, pad_end)).view(B, H, nb, C, dk)
        # relative positions r = a + left - w for a in [0, C), w in [0, W): from C-1+left to -(C-1+right)
        p = self.linear_pos(pos_emb.to(q.dtype)).view(-1, H, dk).transpose(0, 1)  # [H, W+C-1, dk]
        scale = 1.0 / math.sqrt(dk)
        ac = torch.matmul(qp + u[:, :, None], kb.transpose(-1, -2))  # [B, H, nb, C, W]
        bd_raw = torch.matmul(qp + w[:, :, None], p[None, :, None].transpose(-1, -2))  # [B,H,nb,C,W+C-1]
        a = torch.arange(C, device=q.device)
        col = (C - 1 - a)[:, None] + torch.arange(W, device=q.device)[None, :]  # [C, W]
        bd = bd_raw.gather(-1, col.expand(B, H, nb, C, W))
        band = (torch.arange(W, device=q.device)[None, :] >= a[:, None]) & \
               (torch.arange(W, device=q.device)[None, :] <= a[:, None] + left + right)  # [C, W]
        ok = band[None, None] & key_ok[:, :, None, :]  # [B, nb, C, W]
        masked = ~ok[:, None]
        scores = ((ac + bd) * scale).masked_fill(masked, _MASK_VALUE)
        attn = torch.softmax(scores, dim=-1).masked_fill(masked, 0.0)
        out = torch.matmul(attn, vb).reshape(B, H, nb * C, dk)[:, :, :T]
        return out

    def local_positions(self, T: int, d_model: int, left: int, right: int, device=None) -> torch.Tensor:
        """Positional table for :meth:`_local` (positions ``C-1+left ... -(C-1+right)``)."""
        left = T if left < 0 else min(left, T)
        right = T if right < 0 else min(right, T)
        C = self.local_block(T)
        return relative_positions(T, d_model, device, left=C - 1 + left, right=C - 1 + right)


class ConformerFeedForward(nn.Module):
    """``linear2(SiLU(linear1(x)))`` (d -> d_ff -> d)."""

    def __init__(self, d_model: int, d_ff: int, use_bias: bool):
        super().__init__()
        self.linear1 = nn.Linear(d_model, d_ff, bias=use_bias)
        self.linear2 = nn.Linear(d_ff, d_model, bias=use_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(F.silu(self.linear1(x)))


class ConformerConvolution(nn.Module):
    """Pointwise conv (d -> 2d) -> GLU -> zero padded steps -> depthwise conv (kernel k) ->
    BatchNorm / LayerNorm / GroupNorm -> SiLU -> pointwise conv (d -> d)."""

    def __init__(self, d_model: int, kernel: int, norm_type: str, padding: tuple[int, int], use_bias: bool):
        super().__init__()
        self.padding = padding
        self.norm_type = norm_type
        self.pointwise_conv1 = nn.Conv1d(d_model, 2 * d_model, 1, bias=use_bias)
        self.depthwise_conv = nn.Conv1d(d_model, d_model, kernel, groups=d_model, bias=use_bias)
        if norm_type == "batch_norm":
            self.batch_norm = nn.BatchNorm1d(d_model)
        elif norm_type == "layer_norm":
            self.batch_norm = nn.LayerNorm(d_model)
        else:
            self.batch_norm = nn.GroupNorm(int(norm_type[len("group_norm"):] or 1), d_model)
        self.pointwise_conv2 = nn.Conv1d(d_model, d_model, 1, bias=use_bias)

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """``x [B, T, d]``, ``valid [B, T]`` -> ``[B, T, d]``."""
        x = self.pointwise_conv1(x.transpose(1, 2))
        x = F.glu(x, dim=1)
        x = x.masked_fill(~valid[:, None, :], 0.0)
        x = self.depthwise_conv(F.pad(x, self.padding))
        if self.norm_type == "layer_norm":
            x = self.batch_norm(x.transpose(1, 2)).transpose(1, 2)
        else:
            x = self.batch_norm(x)
        x = self.pointwise_conv2(F.silu(x))
        return x.transpose(1, 2)


class ConformerLayer(nn.Module):
    """Macaron Conformer block (NeMo ``ConformerLayer``, dropouts = identity at inference)::

        r = x + 0.5 * FF1(LN(x));  r = r + MHSA(LN(r));  r = r + Conv(LN(r))
        r = r + 0.5 * FF2(LN(r));  out = LN_out(r)
    """

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        d = cfg.d_model
        self.norm_feed_forward1 = nn.LayerNorm(d)
        self.feed_forward1 = ConformerFeedForward(d, cfg.d_ff, cfg.use_bias)
        self.norm_self_att = nn.LayerNorm(d)
        self.self_attn = RelPositionMultiHeadAttention(d, cfg.n_heads, cfg.use_bias)
        self.norm_conv = nn.LayerNorm(d)
        self.conv = ConformerConvolution(d, cfg.conv_kernel_size, cfg.conv_norm_type, cfg.conv_padding,
                                         cfg.use_bias)
        self.norm_feed_forward2 = nn.LayerNorm(d)
        self.feed_forward2 = ConformerFeedForward(d, cfg.d_ff, cfg.use_bias)
        self.norm_out = nn.LayerNorm(d)

    def forward(self, x, valid, pos_emb, context=(-1, -1), impl="sdpa"):
        r = x + 0.5 * self.feed_forward1(self.norm_feed_forward1(x))
        r = r + self.self_attn(self.norm_self_att(r), valid, pos_emb, context, impl)
        r = r + self.conv(self.norm_conv(r), valid)
        r = r + 0.5 * self.feed_forward2(self.norm_feed_forward2(r))
        return self.norm_out(r)


class ConformerEncoder(nn.Module):
    """FastConformer encoder; see the module docstring for the data flow.

    Attributes:
        att_context_size: ``[left, right]`` encoder frames (-1 = unlimited); change with
            :meth:`set_attention_context` (e.g. ``[128, 128]`` for very long inputs).
        attention_impl: "sdpa" (default) or "math".
    """

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.cfg = cfg
        self.d_model = cfg.d_model
        self.pre_encode = DwStridingSubsampling(cfg.feat_in, cfg.d_model, cfg.subsampling_factor,
                                                cfg.subsampling_conv_channels)
        self.xscale = math.sqrt(cfg.d_model) if cfg.xscaling else None
        self.layers = nn.ModuleList([ConformerLayer(cfg) for _ in range(cfg.n_layers)])
        self.out_proj = nn.Linear(cfg.d_model, cfg.feat_out) if cfg.feat_out and cfg.feat_out > 0 else None
        self.att_context_size = list(cfg.att_context_size)
        self.attention_impl = "sdpa"

    def set_attention_context(self, context: list[int] | tuple[int, int]) -> None:
        """Set ``[left, right]`` attention context in encoder frames (-1, -1 = full attention)."""
        self.att_context_size = [int(context[0]), int(context[1])]

    def output_lengths(self, feature_lengths: torch.Tensor) -> torch.Tensor:
        return self.pre_encode.output_lengths(feature_lengths)

    def forward(self, features: torch.Tensor, lengths: torch.Tensor, *, channels_last: bool = False,
                return_intermediates: bool = False):
        """``features [B, F, T]`` + ``lengths [B]`` -> ``(encoded, encoded_lengths)``.

        ``encoded`` is ``[B, d, T']`` (NeMo layout) or ``[B, T', d]`` with ``channels_last``.
        With ``return_intermediates`` a third value, a dict with ``pre_encode`` and
        ``layer0`` ``[B, T', d]``, is returned.
        """
        dtype = next(self.parameters()).dtype
        x = features.transpose(1, 2).to(dtype)
        x, L = self.pre_encode(x, lengths)
        inter = {"pre_encode": x} if return_intermediates else None
        B, T, _ = x.shape
        if self.xscale is not None:
            x = x * self.xscale
        valid = torch.arange(T, device=x.device)[None, :] < L[:, None]
        left, right = self.att_context_size
        context = (left, right)
        if (left < 0 or left >= T) and (right < 0 or right >= T):
            context = (-1, -1)
        if context == (-1, -1):
            pos = relative_positions(T, self.d_model, x.device)
        else:
            pos = self.layers[0].self_attn.local_positions(T, self.d_model, left, right, x.device) \
                if self.layers else None
        for i, layer in enumerate(self.layers):
            x = layer(x, valid, pos, context, self.attention_impl)
            if return_intermediates and i == 0:
                inter["layer0"] = x
        if self.out_proj is not None:
            x = self.out_proj(x)
        if not channels_last:
            x = x.transpose(1, 2)
        return (x, L, inter) if return_intermediates else (x, L)


__all__ = ["ConformerEncoder", "ConformerLayer", "RelPositionMultiHeadAttention", "DwStridingSubsampling",
           "relative_positions"]
