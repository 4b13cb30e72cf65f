"""A faster full-context relative-position attention for the FastConformer encoder.

Same function as :class:`flashasr.models.parakeet.encoder.RelPositionMultiHeadAttention`
(Transformer-XL scores ``((q + u) k^T + rel_shift((q + v) p^T)) / sqrt(d_k)``, masked entries
-10000, SDPA, padded query rows zeroed; NeMo ``RelPositionMultiHeadAttention``), computed with
fewer kernels and fewer passes over the ``[B, H, T, 2T-1]`` position scores:

* q, k and v as ONE GEMM with the bias ``[b_q + u, b_k, b_v]`` (``u`` = ``pos_bias_u`` folded
  in; the three weights become row blocks of one ``[3d, d]`` tensor, no second copy), and
  ``q + v`` as ``(q + u) + (v - u)`` written straight into the head-major layout of the
  position GEMM;
* ``(q + v) p^T`` as ONE batched GEMM over heads (``[H, B*T, d_k] x [H, d_k, P']``, ``P'`` =
  ``2T-1`` rounded up to a multiple of 8 so the bf16 output rows stay 16-byte aligned) instead
  of a batch-broadcast matmul;
* the Transformer-XL shift ``out[i, j] = x[i, T-1-i+j]`` as a zero-copy ``as_strided`` view
  (row stride ``P'-1``) instead of pad + reshape + slice copies;
* the SDPA bias ``scale * bd + key_bias`` in one pass (``key_bias`` = -10000 on padded keys,
  built once per encoder forward, not per layer; padded query rows are zeroed after the
  attention as in the model, so the model's -10000 fill of those rows is not needed);
* head merge and padded-row zeroing in one pass.

Rounding differs from the model's (``b_q + u`` is added inside the GEMM epilogue), so results
agree to float tolerance, not bit for bit. Install after the weights are final: the fused bias
is computed at install.

:func:`install_fast_attention` swaps the class of every attention module of an encoder (same
parameters, same state dict) after checking, on random inputs, that the new forward equals the
original; on any mismatch or error it leaves the modules unchanged. Local-attention contexts
and ``impl="math"`` use the original forward.
"""

from __future__ import annotations

import logging
import math
import threading

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

_MASK_VALUE = -10000.0


class _PerForward(threading.local):
    """Tensors every layer of one encoder forward would otherwise rebuild: the key-mask bias,
    the query-row mask and the padded, cast position embedding. Keyed on the identity and
    in-place version counter of the ``valid`` / ``pos_emb`` tensors the encoder passes to all its
    layers (held here, so an identity cannot be reused by a new tensor while cached)."""

    valid = None
    valid_version = -1
    masks = None
    pos = None
    pos_key = None


_PER_FORWARD = _PerForward()


def _masks(valid: torch.Tensor, dtype: torch.dtype):
    c = _PER_FORWARD
    if c.valid is not valid or c.valid_version != valid._version or c.masks[0].dtype != dtype:
        B, T = valid.shape
        key_bias = torch.zeros(B, 1, 1, T, dtype=dtype, device=valid.device)
        key_bias.masked_fill_(~valid[:, None, None, :], _MASK_VALUE)
        c.valid, c.valid_version, c.masks = valid, valid._version, (key_bias, valid[:, :, None, None].to(dtype))
    return c.masks


def _padded_pos(pos_emb: torch.Tensor, dtype: torch.dtype, Pp: int) -> torch.Tensor:
    c = _PER_FORWARD
    key = (pos_emb, pos_emb._version, dtype, Pp)
    if c.pos_key is None or c.pos_key[0] is not pos_emb or c.pos_key[1:] != key[1:]:
        pe = pos_emb.to(dtype)
        c.pos = F.pad(pe, (0, 0, 0, Pp - pe.shape[0])) if Pp != pe.shape[0] else pe
        c.pos_key = key
    return c.pos


def _fuse_qkv(m) -> None:
    """One ``[3d, d]`` weight whose row blocks ARE ``linear_q/k/v.weight`` (their data become
    views of it: no second copy), and the bias ``[b_q + u, b_k, b_v]``; ``_vu = v - u``."""
    d = m.h * m.d_k
    lq, lk, lv = m.linear_q, m.linear_k, m.linear_v
    W = torch.cat([lq.weight.detach(), lk.weight.detach(), lv.weight.detach()], 0)
    lq.weight.data, lk.weight.data, lv.weight.data = W[:d], W[d:2 * d], W[2 * d:]
    zero = torch.zeros(d, dtype=W.dtype, device=W.device)
    bq = lq.bias.detach() if lq.bias is not None else zero
    u = m.pos_bias_u.detach().reshape(d).to(W.dtype)
    # non-persistent buffers: the state dict is unchanged, and a later module.to(dtype/device)
    # converts them with the parameters (the views then become separate copies, still equal)
    m.register_buffer("_qkv_weight", W, persistent=False)
    m.register_buffer("_qkv_bias", torch.cat([bq + u, lk.bias.detach() if lk.bias is not None else zero,
                                              lv.bias.detach() if lv.bias is not None else zero]), persistent=False)
    m.register_buffer("_vu", (m.pos_bias_v.detach() - m.pos_bias_u.detach()).to(W.dtype), persistent=False)  # [H, d_k]


def _fast_forward(self, x, valid, pos_emb, context=(-1, -1), impl="sdpa"):
    left, right = context
    if left >= 0 or right >= 0 or impl != "sdpa" or getattr(self, "_qkv_weight", None) is None:
        return self._flashasr_orig_forward(x, valid, pos_emb, context, impl)
    B, T, _ = x.shape
    H, dk = self.h, self.d_k
    d = H * dk
    P = 2 * T - 1
    qkv = F.linear(x, self._qkv_weight, self._qkv_bias).view(B, T, 3, H, dk)  # q + u | k | v
    qu = qkv[:, :, 0].transpose(1, 2)  # [B, H, T, dk] views
    k = qkv[:, :, 1].transpose(1, 2)
    v = qkv[:, :, 2].transpose(1, 2)
    # q + v = (q + u) + (v - u), written straight into the [H, B*T, dk] layout of the position GEMM
    grad = torch.is_grad_enabled()  # out= ops are inference-only
    if grad:
        qw = (qkv[:, :, 0] + self._vu).permute(2, 0, 1, 3).contiguous()
    else:
        qw = torch.empty(H, B, T, dk, dtype=x.dtype, device=x.device)
        torch.add(qkv[:, :, 0], self._vu, out=qw.permute(1, 2, 0, 3))
    # position columns padded to a multiple of 8: with an odd row length (2T - 1) the bf16 GEMM
    # output rows are not 16-byte aligned and cuBLAS falls back to pre-Hopper kernels (seen in the
    # H200 profile: cutlass_75 kernels, 11 % of the encoder). Padded columns are never read.
    Pp = -(-P // 8) * 8
    p = self.linear_pos(_padded_pos(pos_emb, x.dtype, Pp)).view(Pp, H, dk).permute(1, 2, 0)  # [H, dk, Pp]
    bd_full = torch.bmm(qw.view(H, B * T, dk), p)  # [H, B*T, Pp]
    bd = bd_full.as_strided((B, H, T, T), (T * Pp, B * T * Pp, Pp - 1, 1), bd_full.storage_offset() + T - 1)
    scale = 1.0 / math.sqrt(dk)
    key_bias, q_mask = _masks(valid, x.dtype)
    # masked keys: -10000 + scale*bd (the model fills exactly -10000): exp underflows to 0 either
    # way. Padded query rows (the model fills them all) are zeroed below, as in the model.
    bias = torch.add(key_bias, bd, alpha=scale)  # [B, H, T, T], one pass
    out = F.scaled_dot_product_attention(qu, k, v, attn_mask=bias, scale=scale)  # [B, H, T, dk]
    if grad:
        merged = (out.transpose(1, 2) * q_mask).contiguous()
    else:
        merged = torch.empty(B, T, H, dk, dtype=out.dtype, device=out.device)
        torch.mul(out.transpose(1, 2), q_mask, out=merged)  # head merge + padded rows -> 0, one pass
    return self.linear_out(merged.view(B, T, d))


_CLASSES: dict = {}


def _fast_class(cls):
    if cls not in _CLASSES:
        _CLASSES[cls] = type("Fast" + cls.__name__, (cls,), {
            "forward": _fast_forward,
            "_flashasr_orig_forward": cls.forward,
        })
    return _CLASSES[cls]


@torch.no_grad()
def install_fast_attention(encoder: torch.nn.Module, *, check: bool = True) -> int:
    """Swap every full-context rel-pos attention module of ``encoder`` to the fast forward.

    Returns the number of modules swapped (0 if the check failed or none was found). The check
    compares both forwards on a random batch with padding, on the encoder's device and dtype
    (relative tolerance 1e-4 in float32, 3e-2 otherwise).
    """
    from ..models.parakeet.encoder import RelPositionMultiHeadAttention, relative_positions

    mods = [m for m in encoder.modules() if type(m) is RelPositionMultiHeadAttention]
    if not mods:
        return 0
    if check:
        m = mods[0]
        try:
            prm = next(m.parameters())
            d = m.h * m.d_k
            g = torch.Generator(device="cpu").manual_seed(0)
            B, T = 3, 29
            x = torch.randn(B, T, d, generator=g).to(prm.device, prm.dtype)
            lens = torch.tensor([T, 17, 1], device=prm.device)
            valid = torch.arange(T, device=prm.device)[None, :] < lens[:, None]
            pos = relative_positions(T, d, prm.device)
            want = RelPositionMultiHeadAttention.forward(m, x, valid, pos)
            _fuse_qkv(m)
            m.__class__ = _fast_class(RelPositionMultiHeadAttention)
            try:
                got = m(x, valid, pos)
            finally:
                m.__class__ = RelPositionMultiHeadAttention
            err = ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12)).item()
            tol = 1e-4 if prm.dtype == torch.float32 else 3e-2
            if not err <= tol:
                log.warning("fast attention differs from the reference (rel. error %.2e > %.0e): not used", err, tol)
                return 0
        except Exception as e:  # noqa: BLE001 - never break the model
            log.warning("fast attention check failed (%s: %s): not used", type(e).__name__, e)
            return 0
    for m in mods:
        if getattr(m, "_qkv_weight", None) is None:
            _fuse_qkv(m)
        m.__class__ = _fast_class(RelPositionMultiHeadAttention)
    return len(mods)


__all__ = ["install_fast_attention"]
