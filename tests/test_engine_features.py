"""Engine GPU features: batched NeMo / Whisper log-mel equal the models' CPU reference paths.

The same torch code runs on CPU here (CI) and on CUDA (``gpu`` tests on the device machine).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import PARAKEET_FIXTURES
from flashasr.engine.features_gpu import NemoLogMel, PinnedUploader, WhisperLogMel


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py


TINY = PARAKEET_FIXTURES / "tiny-tdt"


@pytest.fixture(scope="module")
def tiny():
    from flashasr.models.parakeet.model import ParakeetASR

    return ParakeetASR.from_nemo(TINY / "model.nemo")


def _check_nemo(device, tiny):
    z = np.load(TINY / "reference.npz")
    audio = torch.from_numpy(z["audio"]).to(device)
    lengths = torch.from_numpy(z["audio_lengths"]).to(device)
    mel = NemoLogMel.from_preprocessor(tiny.preprocessor).to(device)
    feats, flen = mel(audio, lengths)
    assert flen.cpu().tolist() == z["feature_lengths"].tolist()
    ref = z["features"]
    assert feats.shape == ref.shape
    got = feats.cpu().numpy()
    for b, n in enumerate(z["feature_lengths"]):
        np.testing.assert_allclose(got[b, :, :n], ref[b, :, :n], rtol=1e-4, atol=5e-4)
        assert np.all(got[b, :, n:] == 0.0)
    # equals the Parakeet preprocessor (CPU reference path) on every frame
    want, wlen = tiny.preprocessor(audio.cpu(), lengths.cpu())
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-4)
    # a row alone == the same row in the padded batch (valid frames)
    one, _ = mel(audio[1:2, : int(lengths[1])], lengths[1:2])
    np.testing.assert_allclose(one[0].cpu().numpy(), got[1, :, : one.shape[-1]], rtol=1e-4, atol=1e-4)


def test_nemo_logmel_matches_fixture_and_reference_cpu(tiny):
    _check_nemo("cpu", tiny)


def _check_whisper(device):
    from flashasr.models.whisper.features import N_SAMPLES, log_mel_spectrogram

    rng = np.random.default_rng(0)
    z = np.load(TINY / "reference.npz")
    waves = [z["audio"][b, : z["audio_lengths"][b]] for b in range(4)] + [rng.standard_normal(3000).astype(np.float32) * 0.1]
    up = PinnedUploader(device)
    audio, lengths = up.upload(waves)
    for n_mels in (80, 128):
        for padding in (N_SAMPLES, 400):
            got = WhisperLogMel(n_mels).to(device)(audio, lengths, padding=padding).cpu()
            for b, w in enumerate(waves):
                ref = log_mel_spectrogram(w, n_mels, padding=padding)
                n = ref.shape[-1]
                assert n == (len(w) + padding) // 160
                torch.testing.assert_close(got[b, :, :n], ref, rtol=1e-4, atol=2e-4)


def test_whisper_logmel_batched_matches_reference_cpu():
    _check_whisper("cpu")


def test_uploader_pads_and_reuses_buffer():
    up = PinnedUploader("cpu")
    a, la = up.upload([np.ones(5, np.float32), np.full(3, 2.0, np.float32)], batch=4, samples=8)
    assert a.shape == (4, 8) and la.tolist() == [5, 3, 0, 0]
    assert a[0].tolist() == [1] * 5 + [0] * 3 and a[1].tolist() == [2] * 3 + [0] * 5 and a[2:].abs().sum() == 0
    b, lb = up.upload([np.full(2, 7.0, np.float32)], batch=4, samples=8)
    assert b[0].tolist() == [7, 7] + [0] * 6 and b[1:].abs().sum() == 0 and lb.tolist() == [2, 0, 0, 0]
    assert a[0].tolist() == [1] * 5 + [0] * 3  # earlier result not clobbered
    from flashasr.errors import AudioError

    with pytest.raises(AudioError):
        up.upload([np.ones(9, np.float32)], batch=1, samples=8)
    stereo = np.stack([np.full(3, 1.0), np.full(3, 2.0)], 1).astype(np.float32)  # [N, 2]: never copied as bytes
    with pytest.raises(AudioError, match=r"waveform 0: expected mono samples of shape \[N\], got shape \(3, 2\)") as e:
        up.upload([stereo, np.full(1, 9.0, np.float32)], samples=8)
    assert e.value.code == "invalid_audio"
    for scalar in (np.float32(0.5), np.array(0.5)):  # 0-d: not a waveform either
        with pytest.raises(AudioError, match=r"waveform 0: expected mono samples of shape \[N\], got shape \(\)"):
            up.upload([scalar])
    with pytest.raises(AudioError, match=r"0 waveforms \(longest 0 samples\) do not fit a \[-1, 0\] batch"):
        up.upload([], batch=-1)


def _check_uploader_random(device):
    """Fresh random batches against a plain per-row loop: exact samples, zero padding, lengths."""
    rng = np.random.default_rng()
    up = PinnedUploader(device)
    for _ in range(12):
        n = int(rng.integers(0, 9))
        lens = rng.integers(0, 5000, n).tolist() + ([0] if rng.random() < 0.3 else [])
        waves = [rng.standard_normal(m).astype(np.float32) for m in lens]
        if waves and rng.random() < 0.5:  # a read-only view (shared memory, bytes) and a float64 row
            ro = waves[0].copy()
            ro.setflags(write=False)
            waves[0] = ro
            waves[-1] = waves[-1].astype(np.float64)
        B = len(waves) + int(rng.integers(0, 3)) or 1
        N = max(lens, default=0) + int(rng.integers(0, 50))
        audio, lengths = up.upload(waves, batch=B, samples=N)
        ref = np.zeros((B, N), np.float32)
        for i, w in enumerate(waves):
            ref[i, : len(w)] = w
        assert audio.shape == (B, N) and audio.dtype == torch.float32 and audio.device.type == device
        assert lengths.dtype == torch.int64 and lengths.cpu().tolist() == [len(w) for w in waves] + [0] * (B - len(waves))
        np.testing.assert_array_equal(audio.cpu().numpy(), ref)


def test_uploader_random_batches_match_plain_loop():
    _check_uploader_random("cpu")


def test_jagged_padding_op_the_uploader_uses_on_cuda():
    """The private ATen op PinnedUploader pads with on CUDA: its signature and meaning, on CPU."""
    vals = torch.arange(1, 8, dtype=torch.float32).unsqueeze(-1)  # rows [1, 2, 3], [], [4 .. 7]
    off = torch.tensor([0, 3, 3, 7, 7])  # and one empty padding row
    out = torch.ops.aten._jagged_to_padded_dense_forward(vals, [off], [5], 0.0)
    assert out.shape == (4, 5, 1)
    assert out.squeeze(-1).tolist() == [[1, 2, 3, 0, 0], [0] * 5, [4, 5, 6, 7, 0], [0] * 5]


@pytest.mark.gpu
def test_uploader_random_batches_match_plain_loop_gpu():
    _check_uploader_random("cuda")


@pytest.mark.gpu
def test_uploader_reuses_pinned_buffer_only_after_its_copy_ran():
    """A second upload while the first copy still waits behind GPU work must not overwrite it."""
    up = PinnedUploader("cuda")
    w1 = [np.full(50_000, 1.0, np.float32), np.full(30_000, 2.0, np.float32)]
    w2 = [np.full(50_000, 7.0, np.float32), np.full(30_000, 8.0, np.float32)]
    torch.cuda._sleep(500_000_000)  # keeps the stream busy: the first copy is queued behind it
    a, la = up.upload(w1)
    b, lb = up.upload(w2)
    assert a[0, :50_000].eq(1).all() and a[1, :30_000].eq(2).all() and a[1, 30_000:].eq(0).all()
    assert b[0].eq(7).all() and b[1, :30_000].eq(8).all() and la.tolist() == lb.tolist() == [50_000, 30_000]


@pytest.mark.gpu
def test_features_gpu_match_cpu(tiny):
    torch.backends.cuda.matmul.allow_tf32 = False
    _check_nemo("cuda", tiny)
    _check_whisper("cuda")
