"""Residual add + LayerNorm as one GPU kernel (Triton), with an exact PyTorch fallback.

The Conformer block (NeMo ``ConformerLayer``) is a chain of ``r = r + alpha * branch(LN(r))``
steps. Unfused, each step costs a scale kernel, an add kernel and a LayerNorm kernel, and with a
bf16 encoder whose norms stay float32 (:func:`~flashasr.engine.profiles.prepare_encoder_precision`)
PyTorch also casts the LayerNorm input up to float32 and its output back (two more kernels and
two more passes over ``[B, T, d]``). :func:`add_layer_norm` does the whole step in one kernel:

* ``r2 = r + alpha * y``, computed in float32 and rounded once to ``r``'s dtype -- bit-identical
  to the unfused ``r + 0.5 * y`` (``0.5 * y`` is exact, the add rounds once);
* ``out = (r2 - mean) / sqrt(var + eps) * weight + bias`` from the ROUNDED ``r2`` (as the unfused
  LayerNorm sees it), statistics and arithmetic in float32, biased variance (PyTorch/NeMo
  ``nn.LayerNorm``), weight and bias read in their own dtype (float32 for a bf16 encoder),
  output rounded to ``r``'s dtype.

Differences from PyTorch's LayerNorm kernel are float32 details only (two-pass mean and variance
here, Welford there; Triton's float32 square root and division may differ from PyTorch's rsqrt
by a few float32 ulps), so the bf16 output matches to within one bf16 rounding step.

The Triton kernel is used for CUDA tensors of float32 / bfloat16 / float16 with a contiguous last
dimension of at most 16,384 when ``triton`` imports; anything else, or any error (logged once,
then the fallback for the rest of the process), runs :func:`add_layer_norm_reference`, which is
the unfused maths with PyTorch operations (also whenever autograd needs a backward). On the H200
the kernel's ``r2`` equals the fallback's bit for bit and ``out`` is within one rounding step of
the output dtype (``tests/test_engine_triton_norm.py``).
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

try:  # pragma: no cover - GPU machines only
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - no triton (CPU installs): the PyTorch fallback runs
    triton = None

_STATE = {"triton_ok": triton is not None, "error": None}
_MAX_N = 16384

if triton is not None:  # pragma: no cover - compiled and run on the GPU only

    @triton.jit
    def _add_ln_kernel(R, Y, W, B, ROUT, OUT, N, alpha, eps,
                       HAS_Y: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = cols < N
        r = tl.load(R + row * N + cols, mask=m, other=0.0).to(tl.float32)
        if HAS_Y:
            y = tl.load(Y + row * N + cols, mask=m, other=0.0).to(tl.float32)
            r2 = (r + alpha * y).to(ROUT.dtype.element_ty)
            tl.store(ROUT + row * N + cols, r2, mask=m)
            r = r2.to(tl.float32)
        mean = tl.sum(r, axis=0) / N
        d = tl.where(m, r - mean, 0.0)
        var = tl.sum(d * d, axis=0) / N
        rstd = 1.0 / tl.sqrt(var + eps)
        w = tl.load(W + cols, mask=m, other=0.0).to(tl.float32)
        b = tl.load(B + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(OUT + row * N + cols, (d * rstd * w + b).to(OUT.dtype.element_ty), mask=m)


def add_layer_norm_reference(r: torch.Tensor, y: torch.Tensor | None, alpha: float,
                             norm: torch.nn.LayerNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused step with PyTorch operations: ``r2 = r + alpha * y`` (``r`` itself when ``y``
    is None), ``out = norm(r2)`` through the module's own forward (float32 norms of a bf16
    encoder included). Shapes ``[..., d]``; returns ``(r2, out)`` in ``r``'s dtype."""
    r2 = r if y is None else torch.add(r, y, alpha=alpha)
    return r2, norm(r2)


def _triton_usable(r: torch.Tensor, y: torch.Tensor | None, norm) -> bool:
    if torch.is_grad_enabled() and (r.requires_grad or (y is not None and y.requires_grad)
                                    or any(p.requires_grad for p in norm.parameters())):
        return False  # the kernel has no backward: autograd runs the PyTorch path
    return (_STATE["triton_ok"] and r.is_cuda and r.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and r.shape[-1] <= _MAX_N and r.is_contiguous() and (y is None or (y.is_contiguous() and
            y.shape == r.shape and y.dtype == r.dtype)) and isinstance(norm, torch.nn.LayerNorm)
            and norm.weight is not None and norm.bias is not None
            and tuple(norm.normalized_shape) == (r.shape[-1],))


def add_layer_norm(r: torch.Tensor, y: torch.Tensor | None, alpha: float,
                   norm: torch.nn.LayerNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then LayerNorm over the last dimension, in one kernel on the GPU.

    Args:
        r: residual stream ``[..., d]`` (float32 / bfloat16 / float16).
        y: branch output, same shape and dtype as ``r``, or None for a plain LayerNorm of ``r``.
        alpha: scale of ``y`` (0.5 for the Conformer's half-step feed-forward modules).
        norm: the ``nn.LayerNorm(d)`` to apply (its ``eps``, weight and bias; float32 parameters
            on a bf16 tensor are read as float32).
    Returns:
        ``(r2, out)``: ``r2 = r + alpha * y`` (``r`` when ``y`` is None) and ``out = norm(r2)``,
        both ``[..., d]`` in ``r``'s dtype.
    """
    if not _triton_usable(r, y, norm):
        return add_layer_norm_reference(r, y, alpha, norm)
    try:
        N = r.shape[-1]
        rows = r.numel() // N
        out = torch.empty_like(r)
        r2 = torch.empty_like(r) if y is not None else r
        if rows:
            _add_ln_kernel[(rows,)](r, y if y is not None else r, norm.weight, norm.bias, r2, out, N,
                                    float(alpha), float(norm.eps), HAS_Y=y is not None,
                                    BLOCK=triton.next_power_of_2(N), num_warps=4 if N <= 2048 else 8)
        return r2, out
    except Exception as e:  # noqa: BLE001 - never break the model: fall back for good
        _STATE["triton_ok"] = False
        _STATE["error"] = f"{type(e).__name__}: {e}"
        log.warning("Triton add+LayerNorm failed (%s); using the PyTorch path from now on", _STATE["error"])
        return add_layer_norm_reference(r, y, alpha, norm)


def layer_norm(x: torch.Tensor, norm: torch.nn.LayerNorm) -> torch.Tensor:
    """``norm(x)`` in one kernel on the GPU (see :func:`add_layer_norm`); ``[..., d]`` -> same."""
    return add_layer_norm(x, None, 1.0, norm)[1]


def triton_status() -> dict:
    """Whether the Triton kernel is in use, and the error that disabled it (if any)."""
    return {"available": triton is not None, "in_use": _STATE["triton_ok"], "error": _STATE["error"]}


__all__ = ["add_layer_norm", "add_layer_norm_reference", "layer_norm", "triton_status"]
