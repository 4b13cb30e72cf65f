"""Residual add + LayerNorm kernel (flashasr.engine.triton_norm): the PyTorch fallback is the
unfused maths bit for bit (CPU, CI); the Triton kernel matches it on the GPU (H200)."""

from __future__ import annotations

import pytest
import torch

from flashasr.engine.profiles import prepare_encoder_precision
from flashasr.engine.triton_norm import add_layer_norm, add_layer_norm_reference, layer_norm, triton_status


def _norm(d, dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    ln = torch.nn.LayerNorm(d, eps=1e-5)
    with torch.no_grad():
        ln.weight.copy_(1 + 0.3 * torch.randn(d, generator=g))
        ln.bias.copy_(0.2 * torch.randn(d, generator=g))
    holder = torch.nn.Sequential(ln).to(device)
    prepare_encoder_precision(holder, dtype)  # bf16/fp16: the norm stays float32, as in the engine
    return holder[0]


@pytest.mark.parametrize("alpha", [0.5, 1.0])
def test_fallback_is_the_unfused_maths(alpha):
    d = 48
    ln = _norm(d, torch.float32)
    g = torch.Generator().manual_seed(1)
    r = torch.randn(3, 7, d, generator=g)
    y = torch.randn(3, 7, d, generator=g)
    r2, out = add_layer_norm(r, y, alpha, ln)  # CPU: never the kernel
    want = r + alpha * y
    assert torch.equal(r2, want)
    assert torch.equal(out, ln(want))
    assert torch.equal(layer_norm(r, ln), ln(r))
    ref2, refo = add_layer_norm_reference(r, None, 1.0, ln)
    assert ref2 is r and torch.equal(refo, ln(r))
    assert set(triton_status()) == {"available", "in_use", "error"}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 3, 1024), (96, 250, 1024), (5, 176), (0, 1024), (2, 9, 17)])
def test_triton_matches_fallback(dtype, shape):
    if not triton_status()["available"]:
        pytest.skip("triton not installed")
    d = shape[-1]
    ln = _norm(d, dtype, seed=d, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(sum(shape))
    r = (3 * torch.randn(shape, generator=g, device="cuda") + 0.5).to(dtype)
    y = torch.randn(shape, generator=g, device="cuda").to(dtype)
    for alpha in (0.5, 1.0):
        r2, out = add_layer_norm(r, y, alpha, ln)
        w2, wout = add_layer_norm_reference(r, y, alpha, ln)
        assert triton_status()["in_use"], triton_status()
        assert r2.dtype == dtype and out.dtype == dtype and out.shape == r.shape
        assert torch.equal(r2, w2)  # the add rounds once, like the unfused add
        ulp = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10, torch.float32: 2 ** -20}[dtype]
        err = (out.float() - wout.float()).abs()
        assert (err <= ulp * wout.float().abs() + 4 * ulp).all(), err.max()
    o = layer_norm(r, ln)
    torch.testing.assert_close(o.float(), ln(r).float(), rtol=2 * ulp, atol=8 * ulp)
