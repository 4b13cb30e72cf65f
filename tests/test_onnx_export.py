"""ONNX export of the encoders: onnxruntime (CPU) equals our PyTorch encoders for two batch sizes
and two input lengths from ONE export (fp32, tolerance 1e-4); TensorRT backend: the
profile -> optimisation-profile translation (no TensorRT needed), and a clean skip of the
engine build where TensorRT is missing."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from conftest import AUDIO, PARAKEET_FIXTURES
from flashasr.engine import trt_backend
from flashasr.engine.onnx_export import (OnnxExportError, ParakeetEncoderForExport, WhisperEncoderForExport,
                                         export_parakeet_encoder, export_whisper_encoder)
from flashasr.engine.profiles import Profile
from flashasr.errors import FlashASRError

ort = pytest.importorskip("onnxruntime")
NEMO = PARAKEET_FIXTURES / "tiny-tdt" / "model.nemo"


@functools.lru_cache(maxsize=None)
def parakeet():
    import flashasr

    return flashasr.load_model(str(NEMO))


@functools.lru_cache(maxsize=None)
def whisper():
    import flashasr

    return flashasr.load_model("tiny.en")


def _session(path):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def parakeet_onnx(tmp_path_factory):
    return export_parakeet_encoder(parakeet(), tmp_path_factory.mktemp("onnx") / "parakeet_encoder.onnx",
                                   project=True)


def test_parakeet_encoder_onnx_equals_torch(parakeet_onnx):
    m = parakeet()
    sess = _session(parakeet_onnx)
    assert [i.name for i in sess.get_inputs()] == ["features", "lengths"]
    ref_mod = ParakeetEncoderForExport(m, project=True).eval()
    g = torch.Generator().manual_seed(0)
    # real log-mel of the fixture's audio for one shape, random features for the other
    z = np.load(PARAKEET_FIXTURES / "tiny-tdt" / "reference.npz")
    audio = torch.from_numpy(z["audio"][:3]).float()
    alen = torch.from_numpy(z["audio_lengths"][:3]).long()
    with torch.no_grad():
        feats, flen = m.features(audio, alen)
    cases = [(feats, flen), (torch.randn(1, feats.shape[1], 173, generator=g), torch.tensor([173]))]
    shapes = set()
    for f, L in cases:
        with torch.no_grad():
            ref, ref_len = ref_mod(f.float(), L)
        out, out_len = sess.run(None, {"features": f.float().numpy(), "lengths": L.numpy()})
        assert out.shape == tuple(ref.shape) and out.shape[-1] == m.joint.enc.out_features
        assert np.array_equal(out_len, ref_len.numpy())
        valid = np.arange(out.shape[1])[None, :] < out_len[:, None]
        np.testing.assert_allclose(out[valid], ref.numpy()[valid], rtol=1e-4, atol=1e-4)
        shapes.add(f.shape)
    assert len({s[0] for s in shapes}) == 2 and len({s[2] for s in shapes}) == 2


def test_parakeet_export_refuses_local_attention_and_half(tmp_path):
    m = parakeet()
    m.encoder.set_attention_context([8, 8])
    try:
        with pytest.raises(OnnxExportError) as e:
            export_parakeet_encoder(m, tmp_path / "x.onnx")
        assert e.value.code == "onnx_export_unsupported"
    finally:
        m.encoder.set_attention_context([-1, -1])
    assert not (tmp_path / "x.onnx").exists()


def test_whisper_encoder_onnx_equals_torch(tmp_path):
    m = whisper().model
    path = export_whisper_encoder(m, tmp_path / "whisper_encoder.onnx", example_frames=600)
    sess = _session(path)
    from flashasr.audio import load_audio
    from flashasr.models.whisper.features import N_FRAMES, N_SAMPLES, log_mel_spectrogram, pad_or_trim

    mels = [pad_or_trim(log_mel_spectrogram(load_audio(AUDIO / rel).samples, 80, padding=N_SAMPLES), N_FRAMES)
            for rel in ("en/en-ls-61-70968-0002.wav", "en/en-jfk-inaugural.wav")]
    mel_full = mels[0][None]  # one real 30 s window (3000 frames)
    mel_short = torch.stack([m_[:, 100:900] for m_ in mels])  # two 8 s crops (800 frames)
    with torch.no_grad():
        ref_full = m.encode(mel_full)  # the reference path (exactly 3000 frames)
        ref_short = WhisperEncoderForExport(m)(mel_short)
    out_full = sess.run(None, {"mel": mel_full.numpy()})[0]
    out_short = sess.run(None, {"mel": mel_short.numpy()})[0]
    assert out_full.shape == (1, 1500, 384) and out_short.shape == (2, 400, 384)
    # element-wise |onnx - torch| <= 1e-4 + 1e-4 |torch| (outputs reach ~12 in magnitude)
    np.testing.assert_allclose(out_full, ref_full.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(out_short, ref_short.numpy(), rtol=1e-4, atol=1e-4)


def test_whisper_export_needs_float32(tmp_path):
    from flashasr.models.whisper.model import WhisperDims, WhisperModel

    dims = WhisperDims(n_mels=80, n_audio_ctx=10, n_audio_state=8, n_audio_head=2, n_audio_layer=1,
                       n_vocab=20, n_text_ctx=4, n_text_state=8, n_text_head=2, n_text_layer=1)
    with pytest.raises(OnnxExportError):
        export_whisper_encoder(WhisperModel(dims).half(), tmp_path / "w.onnx")


# ------------------------------------------------------------------------ TensorRT backend
def test_profile_to_trt_shapes():
    """Each encoder profile -> one optimisation profile: min/opt/max shapes of features and
    lengths from the profile's batch and seconds (feature frames = samples // hop + 1)."""
    profiles = [Profile(8, 4.16), Profile(1, 30.0), Profile(64, 30.0)]
    shapes = trt_backend.optimization_profiles(profiles, n_mels=128, hop_length=160)
    assert len(shapes) == 3
    s0 = shapes[0]
    frames = 4.16 * 16000 // 160 + 1
    assert s0.inputs["features"] == ((1, 128, 1), (8, 128, int(frames)), (8, 128, int(frames)))
    assert s0.inputs["lengths"] == ((1,), (8,), (8,))
    assert shapes[2].inputs["features"][2] == (64, 128, 3001)
    assert shapes[1].profile == Profile(1, 30.0)
    # min_frames lets the engine accept short inputs in a long profile; opt = the profile's shape
    s = trt_backend.optimization_profiles([Profile(4, 10.0)], n_mels=80, hop_length=160, min_frames=16)[0]
    assert s.inputs["features"][0] == (1, 80, 16) and s.inputs["features"][1] == (4, 80, 1001)


def test_profile_to_trt_bad_input():
    with pytest.raises(FlashASRError):
        trt_backend.optimization_profiles([], n_mels=80)
    with pytest.raises(FlashASRError):
        trt_backend.optimization_profiles([Profile(0, 1.0)], n_mels=80)


def test_select_profile_index():
    shapes = trt_backend.optimization_profiles([Profile(8, 4.0), Profile(2, 30.0), Profile(16, 30.0)], n_mels=80)
    assert trt_backend.select_profile(shapes, batch=2, frames=300) == 0      # fits the short one
    assert trt_backend.select_profile(shapes, batch=2, frames=2000) == 1     # cheapest long one
    assert trt_backend.select_profile(shapes, batch=9, frames=2000) == 2
    with pytest.raises(FlashASRError):
        trt_backend.select_profile(shapes, batch=17, frames=10)


def test_trt_engine_skips_cleanly_without_tensorrt(parakeet_onnx):
    if trt_backend.tensorrt_available():
        pytest.skip("TensorRT present: the build is exercised by the GPU tests")
    with pytest.raises(trt_backend.TensorRTUnavailableError) as e:
        trt_backend.TRTEncoderProfiles.from_onnx(parakeet_onnx, [Profile(1, 4.0)], n_mels=128)
    assert e.value.code == "tensorrt_unavailable"
    assert "tensorrt" in str(e.value).lower()


@pytest.mark.skipif(not trt_backend.tensorrt_available(),
                    reason="TensorRT is not installed (not on this machine, not on the device image)")
def test_trt_engine_build_and_run(parakeet_onnx):  # pragma: no cover - needs TensorRT + CUDA
    eng = trt_backend.TRTEncoderProfiles.from_onnx(parakeet_onnx, [Profile(2, 4.0)], n_mels=128)
    f = torch.randn(2, 128, 300, device="cuda")
    out, out_len = eng.run(f, torch.tensor([300, 200], device="cuda"))
    assert out.shape[0] == 2 and out_len.tolist()[0] >= out_len.tolist()[1]


def test_parakeet_export_after_an_engine_was_built_on_the_model(tmp_path):
    """The engine fuses the encoder in place (BatchNorm fold, fast attention, add+LayerNorm): the
    export still works and onnxruntime equals the untouched model's encoder."""
    from flashasr.engine.offline import OfflineParakeetEngine
    from flashasr.models.parakeet.model import ParakeetASR

    m = ParakeetASR.from_nemo(NEMO)
    plain = ParakeetASR.from_nemo(NEMO)
    eng = OfflineParakeetEngine(m, profiles=[Profile(2, 2.0)])
    assert eng.encoder.fast_attention_modules == len(m.encoder.layers)
    path = export_parakeet_encoder(m, tmp_path / "after_engine.onnx", project=True)
    f = torch.randn(2, m.encoder.cfg.feat_in, 150, generator=torch.Generator().manual_seed(3))
    L = torch.tensor([150, 97])
    with torch.no_grad():
        ref, ref_len = ParakeetEncoderForExport(plain, project=True).eval()(f, L)
    out, out_len = _session(path).run(None, {"features": f.numpy(), "lengths": L.numpy()})
    assert np.array_equal(out_len, ref_len.numpy())
    valid = np.arange(out.shape[1])[None, :] < out_len[:, None]
    np.testing.assert_allclose(out[valid], ref.numpy()[valid], rtol=1e-4, atol=1e-4)
