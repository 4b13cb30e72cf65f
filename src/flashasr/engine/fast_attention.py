"""A faster full-context relative-position attention for the FastConformer encoder.

Same function as :class:`flashasr.models.parakeet.encoder.RelPositionMultiHeadAttention`
(Transformer-XL scores ``((q + u) k^T + rel_shift((q + v) p^T)) / sqrt(d_k)``, masked entries
-10000, SDPA, padded query rows zeroed; NeMo ``RelPositionMultiHeadAttention``), computed with
fewer passes over the ``[B, H, T, 2T-1]`` position scores:

* ``(q + v) p^T`` as ONE batched GEMM over heads (``[H, B*T, d_k] x [H, d_k, P']``, ``P'`` =
  ``2T-1`` rounded up to a multiple of 8 so the bf16 output rows stay 16-byte aligned) instead
  of a batch-broadcast matmul;
* the Transformer-XL shift ``out[i, j] = x[i, T-1-i+j]`` as a zero-copy ``as_strided`` view
  (row stride ``P'-1``) instead of pad + reshape + slice copies;
* scale and mask in two passes into the contiguous SDPA bias.

:func:`install_fast_attention` swaps the class of every attention module of an encoder (same
parameters, same state dict) after checking, on random inputs, that the new forward equals the
original; on any mismatch or error it leaves the modules unchanged. Local-attention contexts
and ``impl="math"`` use the original forward.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

_MASK_VALUE = -10000.0


def _fast_forward(self, x, valid, pos_emb, context=(-1, -1), impl="sdpa"):
    left, right = context
    if left >= 0 or right >= 0 or impl != "sdpa":
        return self._flashasr_orig_forward(x, valid, pos_emb, context, impl)
    B, T, _ = x.shape
    H, dk = self.h, self.d_k
    P = 2 * T - 1
    q = self.linear_q(x).view(B, T, H, dk)
    k = self.linear_k(x).view(B, T, H, dk).transpose(1, 2)
    v = self.linear_v(x).view(B, T, H, dk).transpose(1, 2)
    u = self.pos_bias_u.to(q.dtype)
    w = self.pos_bias_v.to(q.dtype)
    qu = (q + u).transpose(1, 2)  # [B, H, T, dk]
    qw = (q + w).permute(2, 0, 1, 3).reshape(H, B * T, dk)  # [H, B*T, dk]
    # position columns padded to a multiple of 8: with an odd row length (2T - 1) the bf16 GEMM
    # output rows are not 16-byte aligned and cuBLAS falls back to pre-Hopper kernels (seen in the
    # H200 profile: cutlass_75 kernels, 11 % of the encoder). Padded columns are never read.
    Pp = -(-P // 8) * 8
    pe = pos_emb.to(x.dtype)
    if Pp != P:
        pe = F.pad(pe, (0, 0, 0, Pp - P))
    p = self.linear_pos(pe).view(Pp, H, dk).permute(1, 2, 0)  # [H, dk, Pp]
    bd_full = torch.bmm(qw, p)  # [H, B*T, Pp]
    bd = bd_full.as_strided((B, H, T, T), (T * Pp, B * T * Pp, Pp - 1, 1), bd_full.storage_offset() + T - 1)
    scale = 1.0 / math.sqrt(dk)
    masked = ~(valid[:, None, :, None] & valid[:, None, None, :])
    bias = (bd * scale).masked_fill_(masked, _MASK_VALUE)
    out = F.scaled_dot_product_attention(qu, k, v, attn_mask=bias, scale=scale)
    out = out * valid[:, None, :, None].to(out.dtype)
    out = out.transpose(1, 2).reshape(B, T, H * dk)
    return self.linear_out(out)


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
        m.__class__ = _fast_class(RelPositionMultiHeadAttention)
    return len(mods)


__all__ = ["install_fast_attention"]
