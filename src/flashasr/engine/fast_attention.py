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
agree to float tolerance, not bit for bit. Inference only: with autograd on and trainable
parameters the model's own forward runs.

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
    the query-row mask and the padded, cast position embedding. Used only while an encoder
    forward is running (``depth > 0``; hooks installed by :func:`install_fast_attention` reset
    it on entry and exit), and keyed there on the identity of the ``valid`` / ``pos_emb``
    tensors the encoder builds and passes to all its layers. Outside an encoder forward (a
    direct call of an attention module) nothing is cached."""

    depth = 0
    valid = None
    masks = None
    pos_src = None
    pos_key = None
    pos = None

    def clear(self):
        self.valid = self.masks = self.pos_src = self.pos_key = self.pos = None


_PER_FORWARD = _PerForward()


def _enter_encoder(module, args):
    c = _PER_FORWARD
    if c.depth == 0:
        c.clear()
    c.depth += 1


def _leave_encoder(module, args, out):
    c = _PER_FORWARD
    c.depth = max(0, c.depth - 1)
    if c.depth == 0:
        c.clear()


def _masks(valid: torch.Tensor, dtype: torch.dtype):
    c = _PER_FORWARD
    if c.depth and c.valid is valid and c.masks[0].dtype == dtype:
        return c.masks
    B, T = valid.shape
    key_bias = torch.zeros(B, 1, 1, T, dtype=dtype, device=valid.device)
    key_bias.masked_fill_(~valid[:, None, None, :], _MASK_VALUE)
    masks = (key_bias, valid[:, :, None, None].to(dtype))
    if c.depth:
        c.valid, c.masks = valid, masks
    return masks


def _padded_pos(pos_emb: torch.Tensor, dtype: torch.dtype, Pp: int) -> torch.Tensor:
    c = _PER_FORWARD
    if c.depth and c.pos_src is pos_emb and c.pos_key == (dtype, Pp):
        return c.pos
    pe = pos_emb.to(dtype)
    pe = F.pad(pe, (0, 0, 0, Pp - pe.shape[0])) if Pp != pe.shape[0] else pe
    if c.depth:
        c.pos_src, c.pos_key, c.pos = pos_emb, (dtype, Pp), pe
    return pe


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter
        return -1


def _source_key(m) -> tuple:
    """Identity, storage and in-place version of every parameter the fused tensors derive from."""
    ps = (m.linear_q.weight, m.linear_k.weight, m.linear_v.weight, m.linear_q.bias, m.linear_k.bias,
          m.linear_v.bias, m.pos_bias_u, m.pos_bias_v)
    return tuple((id(p), p.data_ptr(), p.dtype, _version(p)) if p is not None else None for p in ps)


_FUSED = ("_qkv_weight", "_qkv_bias", "_vu")


def _fuse_qkv(m) -> None:
    """One ``[3d, d]`` weight whose row blocks ARE ``linear_q/k/v.weight`` (their data become
    views of it: no second copy), and the bias ``[b_q + u, b_k, b_v]``; ``_vu = v - u``. Rebuilt
    by the forward whenever a source parameter was replaced or changed in place afterwards
    (``load_state_dict``, ``.to()``, an in-place edit of ``pos_bias_u`` ...)."""
    d = m.h * m.d_k
    lq, lk, lv = m.linear_q, m.linear_k, m.linear_v
    with torch.no_grad():
        W = torch.cat([lq.weight.detach(), lk.weight.detach(), lv.weight.detach()], 0)
        lq.weight.data, lk.weight.data, lv.weight.data = W[:d], W[d:2 * d], W[2 * d:]
        zero = torch.zeros(d, dtype=W.dtype, device=W.device)
        bq = lq.bias.detach() if lq.bias is not None else zero
        u = m.pos_bias_u.detach().reshape(d).to(W.dtype)
        bias = torch.cat([bq + u, lk.bias.detach() if lk.bias is not None else zero,
                          lv.bias.detach() if lv.bias is not None else zero])
        vu = (m.pos_bias_v.detach() - m.pos_bias_u.detach()).to(W.dtype)  # [H, d_k]
    # non-persistent buffers: the state dict is unchanged, and module.to() converts them too
    m.register_buffer("_qkv_weight", W, persistent=False)
    m.register_buffer("_qkv_bias", bias, persistent=False)
    m.register_buffer("_vu", vu, persistent=False)
    m._qkv_source = _source_key(m)


def _unfuse(m) -> None:
    for name in _FUSED:
        m._buffers.pop(name, None)
    m.__dict__.pop("_qkv_source", None)


def _exporting() -> bool:
    """ONNX export or TorchScript tracing: the model's own forward (plain tensor ops, no
    ``out=`` kernels or Python-side caches) is what gets recorded."""
    return bool(torch.onnx.is_in_onnx_export() or torch.jit.is_tracing() or torch.jit.is_scripting())


def _fast_forward(self, x, valid, pos_emb, context=(-1, -1), impl="sdpa"):
    """Same contract as ``RelPositionMultiHeadAttention.forward``: ``x [B, T, d]`` (float32 /
    bf16 / fp16), ``valid [B, T]`` bool, ``pos_emb [2T-1, d]`` -> ``[B, T, d]`` in ``x``'s dtype.
    Local contexts, ``impl="math"``, ONNX export / tracing and autograd with trainable
    parameters use the model's own forward (the fused tensors are built without autograd)."""
    left, right = context
    if left >= 0 or right >= 0 or impl != "sdpa" or "_qkv_weight" not in self._buffers or _exporting() or (
            torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters())):
        return self._flashasr_orig_forward(x, valid, pos_emb, context, impl)
    if self._qkv_source != _source_key(self):  # weights replaced or edited since the fuse
        _fuse_qkv(self)
    B, T, _ = x.shape
    H, dk = self.h, self.d_k
    d = H * dk
    P = 2 * T - 1
    qkv = F.linear(x, self._qkv_weight, self._qkv_bias).view(B, T, 3, H, dk)  # q + u | k | v
    qu = qkv[:, :, 0].transpose(1, 2)  # [B, H, T, dk] views
    k = qkv[:, :, 1].transpose(1, 2)
    v = qkv[:, :, 2].transpose(1, 2)
    # q + v = (q + u) + (v - u), written straight into the [H, B*T, dk] layout of the position GEMM
    grad = torch.is_grad_enabled() and x.requires_grad  # out= ops take no autograd inputs
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

    Returns the number of fast modules afterwards (already fast ones included; 0 if the check
    failed or none was found). The check compares both forwards on a random batch with padding,
    on the encoder's device and dtype (relative tolerance 1e-4 in float32, 3e-2 otherwise); on
    failure the checked module gets its own forward back (its q/k/v weights stay views of one
    tensor, same values). Hooks on ``encoder`` bound the per-forward mask cache to one forward.
    The fused q/k/v tensors are rebuilt whenever their source parameters change afterwards
    (checked on every eager forward; a captured CUDA graph keeps the tensors it was captured with).
    """
    from ..models.parakeet.encoder import RelPositionMultiHeadAttention, relative_positions

    already = sum(1 for m in encoder.modules() if type(m) is _fast_class(RelPositionMultiHeadAttention))
    mods = [m for m in encoder.modules() if type(m) is RelPositionMultiHeadAttention]
    if not mods:
        return already
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
                _unfuse(m)
                log.warning("fast attention differs from the reference (rel. error %.2e > %.0e): not used", err, tol)
                return already
        except Exception as e:  # noqa: BLE001 - never break the model
            _unfuse(m)
            log.warning("fast attention check failed (%s: %s): not used", type(e).__name__, e)
            return already
    for m in mods:
        if "_qkv_weight" not in m._buffers:
            _fuse_qkv(m)
        m.__class__ = _fast_class(RelPositionMultiHeadAttention)
    if not getattr(encoder, "_flashasr_fast_attention_hooks", False):
        encoder.register_forward_pre_hook(_enter_encoder)
        encoder.register_forward_hook(_leave_encoder, always_call=True)
        encoder._flashasr_fast_attention_hooks = True
    return len(mods) + already


__all__ = ["install_fast_attention"]
