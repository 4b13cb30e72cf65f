"""Encoder shape profiles: choice from a length distribution, selection, padding invariance.

CPU (eager, same interface as the CUDA-graph path) on the NeMo tiny fixture model; the
``gpu`` test checks graph replay == eager on the device machine.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import PARAKEET_FIXTURES
from flashasr.engine.profiles import (EncoderProfiles, Profile, choose_profiles,
                                      prepare_encoder_precision)
from flashasr.errors import AudioTooLongError


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py


TINY = PARAKEET_FIXTURES / "tiny-tdt"


def _model(device="cpu"):
    from flashasr.models.parakeet.model import ParakeetASR

    return ParakeetASR.from_nemo(TINY / "model.nemo", device=device)


def test_choose_profiles_from_distribution():
    ds = [0.5, 1.0, 1.2, 2.0, 3.3, 5.0, 7.0, 9.0, 12.0, 25.0, 45.0]
    ps = choose_profiles(ds, n_profiles=4, max_seconds=30.0, seconds_per_batch=240.0, small_batches=(1,))
    secs = sorted({p.seconds for p in ps})
    assert secs[-1] == 30.0 and len(secs) <= 5
    assert all(abs(s / 0.08 - round(s / 0.08)) < 1e-6 for s in secs)  # whole encoder frames
    full = {p.seconds: p.batch for p in ps if p.batch > 1}
    # equal audio per launch: batch x seconds ~ 240 s, batches multiples of 8
    assert all(b % 8 == 0 and b * s <= 240.0 + 1e-6 and (b + 8) * s > 240.0 for s, b in full.items())
    assert {p.seconds for p in ps if p.batch == 1} == set(secs)
    with pytest.raises(Exception):
        choose_profiles([100.0], max_seconds=30.0)


def test_select_smallest_fitting_profile():
    ep = EncoderProfiles(_model(), [Profile(1, 2.0), Profile(8, 2.0), Profile(2, 10.0), Profile(16, 10.0)])
    sr = 16000
    assert ep.select(1, sr) == Profile(1, 2.0)
    assert ep.select(3, sr) == Profile(8, 2.0)
    assert ep.select(2, 3 * sr) == Profile(2, 10.0)
    assert ep.select(9, sr) == Profile(16, 10.0)  # more rows than any 2 s profile holds
    with pytest.raises(AudioTooLongError):
        ep.select(1, 11 * sr)


def test_padded_profile_equals_unpadded_eager():
    z = np.load(TINY / "reference.npz")
    model = _model()
    ep = EncoderProfiles(model, [Profile(4, 6.0), Profile(8, 12.0)], project=False)
    rows = [0, 1, 2]
    lens = torch.from_numpy(z["audio_lengths"][rows])
    N = int(lens.max())
    audio = torch.from_numpy(z["audio"][rows, :N])
    ref, ref_len = ep.forward_eager(audio, lens)  # [3, T, d], unpadded batch shape
    for p in ep.profiles:
        out, out_len = ep.run(audio, lens, p)
        assert out.shape[0] == 3 and out.shape[1] == int(round(p.seconds / 0.08)) + 1
        assert out_len.tolist() == ref_len.tolist() == z["encoded_lengths"][rows].tolist()
        for b in range(3):
            n = int(out_len[b])
            torch.testing.assert_close(out[b, :n], ref[b, :n], rtol=1e-4, atol=1e-4)
    # the encoder output also matches NeMo's (fixture) on valid frames
    enc = z["encoder_output"].transpose(0, 2, 1)
    for b in range(3):
        n = int(ref_len[b])
        np.testing.assert_allclose(ref[b, :n].numpy(), enc[b, :n], rtol=1e-3, atol=5e-4)


def test_projection_output_for_decoder():
    model = _model()
    ep = EncoderProfiles(model, [Profile(2, 3.0)], project=True)
    audio = torch.randn(2, 30000) * 0.1
    lens = torch.tensor([30000, 17000])
    out, L = ep.run(audio, lens)
    assert out.shape[-1] == model.joint.enc.out_features
    enc, _ = model.encoder(*ep.features(audio, lens), channels_last=True)
    torch.testing.assert_close(out[0, : int(L[0])], model.joint.project_encoder(enc)[0, : int(L[0])],
                               rtol=1e-4, atol=1e-4)


def test_precision_keeps_norms_fp32():
    model = _model()
    prepare_encoder_precision(model.encoder, torch.bfloat16)
    kinds = {type(m).__name__: next(m.parameters()).dtype for m in model.encoder.modules()
             if "Norm" in type(m).__name__}
    assert kinds and all(dt == torch.float32 for dt in kinds.values())
    lin = [m for m in model.encoder.modules() if isinstance(m, torch.nn.Linear)]
    assert all(m.weight.dtype == torch.bfloat16 for m in lin)
    feats = torch.randn(1, 128, 200)
    out, _ = model.encoder(feats, torch.tensor([200]), channels_last=True)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


@pytest.mark.gpu
def test_gpu_profile_graph_equals_eager():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    z = np.load(TINY / "reference.npz")
    model = _model("cuda")
    ep = EncoderProfiles(model, [Profile(2, 3.0), Profile(4, 10.0)], dtype=torch.float32, project=False)
    lens = torch.from_numpy(z["audio_lengths"]).cuda()
    audio = torch.from_numpy(z["audio"]).cuda()
    ref, ref_len = ep.forward_eager(audio, lens)
    for _ in range(2):
        out, L = ep.run(audio, lens)
        assert L.tolist() == ref_len.tolist()
        for b in range(4):
            n = int(L[b])
            torch.testing.assert_close(out[b, :n], ref[b, :n], rtol=1e-4, atol=2e-4)
    small, Ls = ep.run(audio[:1, :16000], torch.tensor([11200], device="cuda"))
    assert ep.memory_report()[0]["captured"]
    n = int(Ls[0])
    torch.testing.assert_close(small[0, :n], ref[0, :n], rtol=1e-4, atol=2e-4)
