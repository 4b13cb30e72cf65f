"""Fast rel-pos attention (engine) equals the Parakeet encoder's attention; whole encoder too."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import PARAKEET_FIXTURES
from flashasr.engine.fast_attention import install_fast_attention
from flashasr.models.parakeet.encoder import RelPositionMultiHeadAttention, relative_positions


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py


TINY = PARAKEET_FIXTURES / "tiny-tdt"


def test_fast_attention_equals_reference_random():
    torch.manual_seed(0)
    for d, h, T in ((64, 4, 1), (64, 4, 23), (96, 8, 40)):
        m = RelPositionMultiHeadAttention(d, h, use_bias=True).eval()
        with torch.no_grad():
            m.pos_bias_u.normal_()
            m.pos_bias_v.normal_()
        x = torch.randn(3, T, d)
        valid = torch.arange(T)[None] < torch.tensor([T, max(1, T // 2), 1])[:, None]
        pos = relative_positions(T, d)
        with torch.no_grad():
            want = m(x, valid, pos)
            enc = torch.nn.Sequential(m)
            assert install_fast_attention(enc) == 1
            assert type(m).__name__.startswith("Fast")
            got = m(x, valid, pos)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("use_bias", [True, False])
def test_fused_qkv_one_copy_grad_path_and_mask_cache(use_bias):
    """q/k/v weights become views of the one fused weight (state dict unchanged); the autograd
    path equals the inference path; the per-forward mask cache notices a ``valid`` tensor that
    was changed in place (same object, new contents)."""
    torch.manual_seed(1)
    d, h, T = 32, 4, 11
    m = RelPositionMultiHeadAttention(d, h, use_bias=use_bias).eval()
    with torch.no_grad():
        m.pos_bias_u.normal_()
        m.pos_bias_v.normal_()
    ref = RelPositionMultiHeadAttention(d, h, use_bias=use_bias).eval()
    ref.load_state_dict(m.state_dict())
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    assert install_fast_attention(torch.nn.Sequential(m)) == 1
    for k, v in m.state_dict().items():
        assert torch.equal(v, sd[k]), k
    W = m._qkv_weight
    assert m.linear_q.weight.data_ptr() == W.data_ptr()
    assert m.linear_v.weight.data_ptr() == W[2 * d:].data_ptr()
    x = torch.randn(2, T, d)
    valid = torch.arange(T)[None] < torch.tensor([T, 6])[:, None]
    pos = relative_positions(T, d)
    with torch.no_grad():
        want = ref(x, valid, pos)
        got = m(x, valid, pos)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got_grad = m(x, valid, pos)  # grad enabled: no out= kernels
    assert got_grad.requires_grad
    torch.testing.assert_close(got_grad.detach(), want, rtol=1e-5, atol=1e-5)
    valid[1, 6:9] = True  # in place: the cached key mask must be rebuilt
    with torch.no_grad():
        torch.testing.assert_close(m(x, valid, pos), ref(x, valid, pos), rtol=1e-5, atol=1e-5)
    # a later dtype change converts the fused buffers too (no dtype mismatch, still equal)
    m.double()
    ref.double()
    with torch.no_grad():
        torch.testing.assert_close(m(x.double(), valid, pos.double()), ref(x.double(), valid, pos.double()))


def test_fast_attention_in_encoder_matches_nemo_fixture():
    from flashasr.models.parakeet.model import ParakeetASR

    z = np.load(TINY / "reference.npz")
    model = ParakeetASR.from_nemo(TINY / "model.nemo")
    feats = torch.from_numpy(z["features"])
    flen = torch.from_numpy(z["feature_lengths"])
    with torch.no_grad():
        ref, L = model.encoder(feats, flen)
        assert install_fast_attention(model.encoder) == len(model.encoder.layers)
        got, L2 = model.encoder(feats, flen)
    assert L.tolist() == L2.tolist()
    for b, n in enumerate(z["encoded_lengths"]):
        torch.testing.assert_close(got[b, :, :n], ref[b, :, :n], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(got[b, :, :n].numpy(), z["encoder_output"][b, :, :n], rtol=1e-4, atol=1e-4)


def _tiny_attention(seed=2, d=32, h=4):
    torch.manual_seed(seed)
    m = RelPositionMultiHeadAttention(d, h, use_bias=True).eval()
    with torch.no_grad():
        m.pos_bias_u.normal_()
        m.pos_bias_v.normal_()
    return m


def test_inference_mode_and_encoder_cache():
    """Whole encoder under torch.inference_mode (inference tensors have no version counter) and
    twice in a row with different lengths: equal to the unpatched encoder every time."""
    from flashasr.models.parakeet.model import ParakeetASR

    model = ParakeetASR.from_nemo(TINY / "model.nemo")
    ref = ParakeetASR.from_nemo(TINY / "model.nemo")
    z = np.load(TINY / "reference.npz")
    feats = torch.from_numpy(z["features"])
    flen = torch.from_numpy(z["feature_lengths"])
    assert install_fast_attention(model.encoder) == len(model.encoder.layers)
    assert install_fast_attention(model.encoder) == len(model.encoder.layers)  # idempotent count
    for f, fl in ((feats, flen), (feats[:2, :, :40], torch.tensor([40, 33]))):
        with torch.inference_mode():
            got, L = model.encoder(f, fl)
            want, L2 = ref.encoder(f, fl)
        assert L.tolist() == L2.tolist()
        for b, n in enumerate(L.tolist()):
            torch.testing.assert_close(got[b, :, :n], want[b, :, :n], rtol=1e-4, atol=1e-4)


def test_fused_tensors_follow_weight_changes():
    """load_state_dict (in place and assign=True) and in-place edits after install rebuild the
    fused q/k/v tensors: the fast forward keeps matching the model's forward."""
    m = _tiny_attention()
    ref = _tiny_attention()
    assert install_fast_attention(torch.nn.Sequential(m)) == 1
    x = torch.randn(2, 9, 32)
    valid = torch.arange(9)[None] < torch.tensor([9, 5])[:, None]
    pos = relative_positions(9, 32)
    other = _tiny_attention(seed=7)
    for change in ("load", "assign", "inplace", "double"):
        with torch.no_grad():
            if change == "load":
                m.load_state_dict(other.state_dict())
            elif change == "assign":
                m.load_state_dict(_tiny_attention(seed=8).state_dict(), assign=True)
            elif change == "inplace":
                m.pos_bias_u.add_(1.0)
                m.linear_k.bias.mul_(2.0)
            else:
                m.double()
                ref.double()
            ref.load_state_dict(m.state_dict())
            xx, pp = (x.double(), pos.double()) if change == "double" else (x, pos)
            torch.testing.assert_close(m(xx, valid, pp), ref(xx, valid, pp), rtol=1e-5, atol=1e-5, msg=change)


def test_autograd_reaches_every_parameter():
    m = _tiny_attention()
    ref = _tiny_attention()
    install_fast_attention(torch.nn.Sequential(m))
    x = torch.randn(2, 7, 32)
    valid = torch.arange(7)[None] < torch.tensor([7, 4])[:, None]
    pos = relative_positions(7, 32)
    m(x, valid, pos).square().sum().backward()
    ref(x, valid, pos).square().sum().backward()
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
