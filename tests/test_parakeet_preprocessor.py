"""Log-mel front end: config options against an independent numpy implementation (NeMo
``FilterbankFeatures`` semantics), and the Slaney filterbank against the one stored by NeMo."""

from __future__ import annotations

import io
import math
import tarfile

import numpy as np
import pytest
import torch
from numpy.testing import assert_allclose

from conftest import PARAKEET_FIXTURES
from flashasr.errors import UnsupportedModelError
from flashasr.models.parakeet.config import PreprocessorConfig
from flashasr.models.parakeet.preprocessor import MelPreprocessor, mel_filterbank

NEMO = PARAKEET_FIXTURES / "tiny-tdt" / "model.nemo"


def _np_window(name, n):
    k = np.arange(n)
    if name == "hann":
        return 0.5 - 0.5 * np.cos(2 * np.pi * k / (n - 1))
    if name == "hamming":
        return 0.54 - 0.46 * np.cos(2 * np.pi * k / (n - 1))
    return np.ones(n)


def _np_features(x, cfg: PreprocessorConfig, fb):
    """Numpy re-statement of NeMo's eval-mode features for ONE unpadded item."""
    n_fft, hop, win = cfg.fft_size, cfg.hop_length, cfg.win_length
    x = x.astype(np.float64)
    if cfg.preemph is not None:
        x = np.concatenate([x[:1], x[1:] - cfg.preemph * x[:-1]])
    n_frames = 1 + len(x) // hop
    xp = np.pad(x, (n_fft // 2, n_fft // 2))
    w = np.zeros(n_fft)
    off = (n_fft - win) // 2
    w[off: off + win] = _np_window(cfg.window, win)
    frames = np.stack([xp[i * hop: i * hop + n_fft] * w for i in range(n_frames)], 1)
    mag = np.abs(np.fft.rfft(frames, axis=0)) ** cfg.mag_power
    mel = fb.astype(np.float64) @ mag
    g = cfg.log_zero_guard_value
    mel = np.log(mel + g) if cfg.log_zero_guard_type == "add" else np.log(np.maximum(mel, g))
    L = (len(x) + 2 * (n_fft // 2) - n_fft) // hop
    v = mel[:, :L]
    if cfg.normalize == "per_feature":
        mean, std = v.mean(1, keepdims=True), v.std(1, ddof=1, keepdims=True) + 1e-5
    else:
        mean, std = v.mean(), v.std(ddof=1) + 1e-5
    out = np.zeros_like(mel)
    out[:, :L] = (v - mean) / std
    if cfg.pad_to:
        T = out.shape[1]
        out = np.pad(out, ((0, 0), (0, (-T) % cfg.pad_to)))
    return out, L


def test_filterbank_equals_nemo_stored_fb():
    with tarfile.open(NEMO) as t:
        sd = torch.load(io.BytesIO(t.extractfile("./model_weights.ckpt").read()), weights_only=True)
    fb = mel_filterbank(16000, 512, 128)
    assert_allclose(fb.numpy(), sd["preprocessor.featurizer.fb"][0].numpy(), rtol=1e-6, atol=1e-9)
    assert torch.equal(torch.hann_window(400, periodic=False), sd["preprocessor.featurizer.window"])


@pytest.mark.parametrize("opts", [
    dict(features=80, window_size=0.02, window_stride=0.01, n_fft=None, window="hamming", normalize="all_features"),
    dict(features=64, window_size=0.025, window_stride=0.01, n_fft=512, preemph=None, mag_power=1.0,
         log_zero_guard_type="clamp", log_zero_guard_value=1e-5, pad_to=16),
    dict(features=128, window_size=0.025, window_stride=0.01, n_fft=512, lowfreq=50, highfreq=7000),
])
def test_options_against_numpy_reference(opts):
    cfg = PreprocessorConfig.from_dict(dict(sample_rate=16000, **opts))
    pre = MelPreprocessor(cfg)
    rng = np.random.default_rng(3)
    t = np.arange(16000 * 2) / 16000
    lengths = [32000, 20001, 4000]
    x = np.zeros((3, 32000), np.float32)
    for b, n in enumerate(lengths):
        x[b, :n] = (0.3 * np.sin(2 * math.pi * (200 + 150 * b) * t[:n]) + 0.05 * rng.standard_normal(n))
    feats, flen = pre(torch.from_numpy(x), torch.tensor(lengths))
    if cfg.pad_to:
        assert feats.shape[-1] % cfg.pad_to == 0
    for b, n in enumerate(lengths):
        want, L = _np_features(x[b, :n], cfg, pre.fb[0].numpy())
        assert int(flen[b]) == L == n // cfg.hop_length
        assert_allclose(feats[b, :, :L].numpy(), want[:, :L], rtol=1e-3, atol=2e-3)
        assert float(feats[b, :, L:].abs().max()) == 0.0 if feats.shape[-1] > L else True


def test_one_valid_frame_and_empty_input_do_not_crash():
    pre = MelPreprocessor(PreprocessorConfig.from_dict(dict(features=128, window_size=0.025, n_fft=512)))
    feats, flen = pre(torch.randn(3, 400), torch.tensor([400, 160, 0]))
    assert flen.tolist() == [2, 1, 0]
    assert torch.isfinite(feats).all()
    assert float(feats[1].abs().max()) == 0.0  # one frame: std guard -> (x - mean) = 0
    assert float(feats[2].abs().max()) == 0.0


@pytest.mark.parametrize("key,value", [("frame_splicing", 3), ("exact_pad", True), ("window", "kaiser"),
                                       ("normalize", "fixed_mean"), ("mel_norm", "htk"),
                                       ("pad_to", "max")])
def test_unsupported_preprocessor_options(key, value):
    with pytest.raises(UnsupportedModelError, match=key):
        PreprocessorConfig.from_dict({key: value})
