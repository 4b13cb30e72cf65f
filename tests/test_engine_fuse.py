"""Engine-side encoder fusions (flashasr.engine.fuse) equal the unfused encoder.

CPU, float32: on the NeMo tiny fixture (with non-trivial BatchNorm statistics) and on random
FastConformer configs (x4/x8/x16 subsampling, odd kernels, causal padding, LayerNorm conv),
padded batches of mixed lengths; valid encoder frames are compared. Transforms documented as
bit-identical are checked with ``torch.equal``.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from conftest import PARAKEET_FIXTURES
from flashasr.engine.fuse import ALL_TRANSFORMS, fuse_encoder
from flashasr.models.parakeet.config import EncoderConfig
from flashasr.models.parakeet.encoder import ConformerEncoder

TINY = PARAKEET_FIXTURES / "tiny-tdt"


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py


def _randomise_bn(enc: ConformerEncoder, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for m in enc.modules():
        if isinstance(m, torch.nn.BatchNorm1d):
            n = m.num_features
            m.running_mean.copy_(torch.randn(n, generator=g) * 0.5)
            m.running_var.copy_(torch.rand(n, generator=g) * 2 + 0.1)
            m.weight.data.copy_(torch.randn(n, generator=g) * 0.5 + 1)
            m.bias.data.copy_(torch.randn(n, generator=g) * 0.2)


def _batch(feat_in: int, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    x = torch.randn(len(lengths), feat_in, T, generator=g)
    L = torch.tensor(lengths)
    x = x * (torch.arange(T)[None, :] < L[:, None])[:, None, :]  # log-mel is zero beyond the length
    return x, L


def _compare(enc: ConformerEncoder, feats, lens, transforms=ALL_TRANSFORMS, exact=False):
    enc.eval()
    fused = copy.deepcopy(enc)
    counts = fuse_encoder(fused, transforms)
    with torch.no_grad():
        a, la = enc(feats, lens, channels_last=True)
        b, lb = fused(feats, lens, channels_last=True)
    assert torch.equal(la, lb)
    for i, n in enumerate(la.tolist()):
        if exact:
            assert torch.equal(a[i, :n], b[i, :n]), i
        else:
            torch.testing.assert_close(b[i, :n], a[i, :n], rtol=1e-4, atol=1e-4)
    return fused, counts


def test_fixture_encoder_fused_equals_unfused():
    from flashasr.models.parakeet.model import ParakeetASR

    model = ParakeetASR.from_nemo(TINY / "model.nemo")
    enc = model.encoder
    _randomise_bn(enc, 1)
    z = np.load(TINY / "reference.npz")
    audio = torch.from_numpy(z["audio"]).float()
    alen = torch.from_numpy(z["audio_lengths"]).long()
    feats, flen = model.preprocessor(audio, alen)
    fused, counts = _compare(enc, feats, flen)
    n = len(enc.layers)
    assert counts == {"bn_fold": n, "conv_pad": n, "inplace": n, "sub_masks": 1, "conv_nhwc": n, "add_norm": n}
    # the fold really changed the weights, and the BatchNorm no longer runs
    assert not torch.equal(fused.layers[0].conv.depthwise_conv.weight, enc.layers[0].conv.depthwise_conv.weight)
    calls = []
    h = fused.layers[0].conv.batch_norm.register_forward_hook(lambda *a: calls.append(1))
    with torch.no_grad():
        fused(feats[:1], flen[:1])
    h.remove()
    assert calls == []
    # idempotent
    assert fuse_encoder(fused) == {t: 0 for t in ALL_TRANSFORMS}
    # the bit-identical transforms alone
    _compare(enc, feats, flen, ("conv_pad", "inplace", "sub_masks", "add_norm"), exact=True)


CONFIGS = [
    dict(d_model=32, n_layers=2, n_heads=2, subsampling_factor=8, subsampling_conv_channels=8, feat_in=20,
         conv_kernel_size=9),
    dict(d_model=24, n_layers=1, n_heads=3, subsampling_factor=4, subsampling_conv_channels=6, feat_in=16,
         conv_kernel_size=5, use_bias=False, xscaling=False),
    dict(d_model=16, n_layers=2, n_heads=2, subsampling_factor=16, subsampling_conv_channels=4, feat_in=24,
         conv_kernel_size=7, conv_context_size="causal"),
    dict(d_model=16, n_layers=1, n_heads=2, subsampling_factor=8, subsampling_conv_channels=4, feat_in=16,
         conv_kernel_size=3, conv_norm_type="layer_norm"),
]


@pytest.mark.parametrize("i", range(len(CONFIGS)))
def test_random_configs_fused_equals_unfused(i):
    cfg = EncoderConfig(**CONFIGS[i])
    torch.manual_seed(10 + i)
    enc = ConformerEncoder(cfg)
    _randomise_bn(enc, i)
    lengths = [333, 101, 260, 17]
    feats, lens = _batch(cfg.feat_in, lengths, seed=i)
    fused, counts = _compare(enc, feats, lens)
    bn = cfg.conv_norm_type == "batch_norm"
    assert counts["bn_fold"] == (cfg.n_layers if bn else 0)
    assert counts["conv_pad"] == (cfg.n_layers if cfg.conv_context_size is None else 0)
    assert counts["sub_masks"] == 1
    assert counts["add_norm"] == cfg.n_layers
    _compare(enc, feats, lens, ("conv_pad", "inplace", "sub_masks", "add_norm"), exact=True)
    # padding invariance survives the fusions: each row alone == its row in the padded batch
    with torch.no_grad():
        b, lb = fused(feats, lens, channels_last=True)
        for r, n in enumerate(lengths):
            a1, l1 = fused(feats[r:r + 1, :, :n], lens[r:r + 1], channels_last=True)
            torch.testing.assert_close(b[r, : int(l1)], a1[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("i", range(len(CONFIGS)))
def test_conv_nhwc_equals_unfused(i):
    """The channels-last conv module (matmul pointwise convs, NHWC depthwise conv), alone
    and with the other fusions, on every config (symmetric/causal padding, BatchNorm/LayerNorm)."""
    from flashasr.engine.fuse import EXTRA_TRANSFORMS

    cfg = EncoderConfig(**CONFIGS[i])
    torch.manual_seed(20 + i)
    enc = ConformerEncoder(cfg)
    _randomise_bn(enc, i)
    feats, lens = _batch(cfg.feat_in, [333, 101, 260, 17], seed=i)
    _, counts = _compare(enc, feats, lens, ("conv_nhwc",))
    assert counts == {"conv_nhwc": cfg.n_layers}
    _, counts = _compare(enc, feats, lens, ALL_TRANSFORMS + EXTRA_TRANSFORMS)
    assert counts["conv_nhwc"] == cfg.n_layers


def test_bf16_precision_path_close_to_float32():
    """Fold in float64 then cast: the bf16 fused encoder stays as close to float32 as the unfused one."""
    from flashasr.engine.profiles import prepare_encoder_precision

    cfg = EncoderConfig(**CONFIGS[0])
    torch.manual_seed(3)
    enc = ConformerEncoder(cfg).eval()
    _randomise_bn(enc, 3)
    feats, lens = _batch(cfg.feat_in, [300, 200], seed=3)
    with torch.no_grad():
        ref, _ = enc(feats, lens, channels_last=True)
        plain = prepare_encoder_precision(copy.deepcopy(enc), torch.bfloat16)
        fused = copy.deepcopy(enc)
        fuse_encoder(fused)
        prepare_encoder_precision(fused, torch.bfloat16)
        e_plain = (plain(feats, lens, channels_last=True)[0].float() - ref)[0].abs().max()
        e_fused = (fused(feats, lens, channels_last=True)[0].float() - ref)[0].abs().max()
    assert e_fused <= 2 * e_plain + 1e-3


def test_fuse_rejects_bad_use():
    enc = ConformerEncoder(EncoderConfig(**CONFIGS[3]))
    with pytest.raises(ValueError, match="eval"):
        fuse_encoder(enc.train())
    with pytest.raises(ValueError, match="unknown"):
        fuse_encoder(enc.eval(), ("bn_fold", "nope"))


def test_engine_applies_fusions_and_opt_out():
    from flashasr.engine.profiles import EncoderProfiles, Profile
    from flashasr.models.parakeet.model import ParakeetASR

    m1 = ParakeetASR.from_nemo(TINY / "model.nemo")
    m2 = ParakeetASR.from_nemo(TINY / "model.nemo")
    for m in (m1, m2):
        _randomise_bn(m.encoder, 5)
    p = [Profile(2, 2.0)]
    on = EncoderProfiles(m1, p)
    off = EncoderProfiles(m2, p, fuse=False)
    assert on.fusions["bn_fold"] == len(m1.encoder.layers) and off.fusions == {}
    audio = torch.from_numpy(np.load(TINY / "reference.npz")["audio"][:2, :32000]).float()
    alen = torch.tensor([32000, 20000])
    a, la = on.run(audio, alen)
    b, lb = off.run(audio, alen)
    assert torch.equal(la, lb)
    for i, n in enumerate(la.tolist()):
        torch.testing.assert_close(a[i, :n], b[i, :n], rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_gpu_profiles_fused_close_to_unfused_bf16_and_fp32():
    """CUDA graphs, channels-last subsampling convs: fused output == unfused (float32 tight, bf16 loose)."""
    from flashasr.engine.profiles import EncoderProfiles, Profile
    from flashasr.models.parakeet.model import ParakeetASR

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    audio = torch.from_numpy(np.load(TINY / "reference.npz")["audio"][:3, :40000]).float()
    alen = torch.tensor([40000, 27000, 9000])
    from flashasr.engine.fuse import EXTRA_TRANSFORMS

    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 0.05)):
        outs = []
        for fuse in (True, False, ALL_TRANSFORMS + EXTRA_TRANSFORMS):
            m = ParakeetASR.from_nemo(TINY / "model.nemo", device="cuda")
            _randomise_bn(m.encoder, 7)
            ep = EncoderProfiles(m, [Profile(4, 3.0)], dtype=dtype, fuse=fuse, conv_channels_last=True,
                                 cudnn_benchmark=True)
            o, ol = ep.run(audio, alen)
            outs.append((o.float().clone(), ol.clone()))
        (a, la), (b, lb), (c, lc) = outs
        assert torch.equal(la, lb) and torch.equal(la, lc)
        for i, n in enumerate(la.tolist()):  # error relative to the output's scale
            assert (a[i, :n] - b[i, :n]).abs().max() <= tol * a[i, :n].abs().max(), (dtype, i)
            assert (c[i, :n] - b[i, :n]).abs().max() <= tol * b[i, :n].abs().max(), (dtype, i, "conv_nhwc")


def test_state_dict_round_trip_after_fold():
    """Saving a fused encoder gives the model's own checkpoint (unfolded depthwise weights, no
    extra bias); loading a checkpoint into a fused encoder re-folds it."""
    cfg = EncoderConfig(**CONFIGS[0])  # use_bias=True
    for use_bias in (True, False):
        cfg = EncoderConfig(**{**CONFIGS[0], "use_bias": use_bias})
        torch.manual_seed(30)
        enc = ConformerEncoder(cfg).eval()
        _randomise_bn(enc, 4)
        want_sd = {k: v.clone() for k, v in enc.state_dict().items()}
        fused = copy.deepcopy(enc)
        assert fuse_encoder(fused)["bn_fold"] == cfg.n_layers
        sd = fused.state_dict()
        assert sd.keys() == want_sd.keys(), set(sd) ^ set(want_sd)
        for k in sd:
            assert torch.equal(sd[k], want_sd[k]), k
        # a fresh unfused encoder takes the fused one's checkpoint strictly, and computes the same
        fresh = ConformerEncoder(cfg).eval()
        fresh.load_state_dict(sd, strict=True)
        feats, lens = _batch(cfg.feat_in, [300, 120], seed=5)
        with torch.no_grad():
            a, la = enc(feats, lens, channels_last=True)
            b, _ = fresh(feats, lens, channels_last=True)
        assert torch.equal(a, b)
        # another model's checkpoint into the fused encoder: re-folded, equals that model
        torch.manual_seed(31)
        other = ConformerEncoder(cfg).eval()
        _randomise_bn(other, 6)
        fused.load_state_dict(other.state_dict(), strict=True)
        with torch.no_grad():
            want, lw = other(feats, lens, channels_last=True)
            got, lg = fused(feats, lens, channels_last=True)
        for i, n in enumerate(lw.tolist()):
            torch.testing.assert_close(got[i, :n], want[i, :n], rtol=1e-4, atol=1e-4)
        assert torch.equal(fused.state_dict()["layers.0.conv.depthwise_conv.weight"],
                           other.state_dict()["layers.0.conv.depthwise_conv.weight"])


def test_fuse_encoder_argument_errors():
    with pytest.raises(TypeError, match="ConformerEncoder"):
        fuse_encoder(torch.nn.Linear(2, 2))
    enc = ConformerEncoder(EncoderConfig(**CONFIGS[3])).eval()
    assert fuse_encoder(enc, "inplace") == {"inplace": 1}  # one name as a string
