"""ParakeetGPUASR (Parakeet through the GPU engine behind ASRModel) and the ``random:NAME`` spec.

CPU: spec resolution, random-model construction, joint shaping and calibration on real
speech. GPU (device machine): the wrapper's transcripts equal the plain model's on the NeMo
tiny fixture and on real clips, and the engine choice (:mod:`flashasr.pipeline.engines`) wraps
Parakeet on CUDA.
"""

from __future__ import annotations

import io
import tarfile
import wave

import numpy as np
import pytest
import torch

from conftest import AUDIO, PARAKEET_FIXTURES
from flashasr import random_models
from flashasr.errors import ModelLoadError
from flashasr.pipeline import engines

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py

TINY = PARAKEET_FIXTURES / "tiny-tdt" / "model.nemo"


def _clip(name: str) -> np.ndarray:
    with wave.open(str(AUDIO / "en" / name)) as w:
        return np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float32) / 32768.0


def _tiny_yaml(tmp_path):
    """The tiny fixture's own model_config.yaml (NeMo layout), extracted from its .nemo."""
    with tarfile.open(TINY) as t:
        m = next(m for m in t.getmembers() if m.name.endswith("model_config.yaml"))
        p = tmp_path / "tiny.yaml"
        p.write_bytes(t.extractfile(m).read())
    return p


def test_random_spec_finds_shared_config_by_name(monkeypatch):
    monkeypatch.setenv("FLASHASR_SHARED", str(PARAKEET_FIXTURES.parents[1]))
    assert random_models.find_parakeet_config("parakeet-tdt-0.6b-v3") == PARAKEET_FIXTURES / "parakeet-tdt-0.6b-v3.yaml"
    with pytest.raises(ModelLoadError, match="no config nope.yaml"):
        random_models.find_parakeet_config("nope")
    with pytest.raises(ModelLoadError, match="no such config file"):
        engines.load_model("random:/no/such/dir/x.yaml")


def test_random_spec_builds_shaped_model_from_yaml(tmp_path):
    m = engines.load_model(f"random:{_tiny_yaml(tmp_path)}")
    assert type(m).__name__ == "ParakeetASR" and m.name == "random:tiny"
    V = m.blank_id
    bias = m.joint.out.bias.detach()
    assert float(bias[V]) == pytest.approx(4.29)  # shaped; no calibration clips beside a temp yaml
    assert torch.count_nonzero(bias[:V]) == 0
    assert not hasattr(m, "calibration")
    t = m.transcribe_waveform(_clip("en-ls-61-70968-0002.wav"))
    assert t.duration == pytest.approx(2.97, abs=0.01)


def test_calibrate_random_joint_hits_target_rate(tmp_path):
    from flashasr.random_models import calibrate_random_joint

    m = engines.load_model(f"random:{_tiny_yaml(tmp_path)}")
    speech = [_clip("en-ls-61-70968-0002.wav"), _clip("en-librivox-sense-sensibility-0870.wav")]
    audio_s = sum(map(len, speech)) / 16000
    lo = calibrate_random_joint(m, speech, target_tokens_per_s=2.0)
    hi = calibrate_random_joint(m, speech, target_tokens_per_s=8.0)
    assert lo[0] > hi[0]  # more tokens need a lower blank bias
    for (b, tps), target in ((lo, 2.0), (hi, 8.0)):
        m.joint.out.bias.data[m.blank_id] = b
        n = sum(len(h.token_ids) for h in m._decode_pieces(speech))
        assert n / audio_s == pytest.approx(tps)
        assert abs(tps - target) < 0.35 * target


def test_gpu_wrapper_refuses_cpu_model():
    from flashasr.engine.parakeet_gpu import ParakeetGPUASR
    from flashasr.models.parakeet.model import ParakeetASR

    m = ParakeetASR.from_nemo(TINY)
    with pytest.raises(ValueError, match="CUDA"):
        ParakeetGPUASR(m)
    assert engines.accelerate(m) is m


@pytest.mark.gpu
def test_gpu_wrapper_equals_plain_model():
    """float32 engine: identical tokens, text and timestamps to the plain model on CUDA."""
    from flashasr.engine.parakeet_gpu import ParakeetGPUASR
    from flashasr.models.parakeet.model import ParakeetASR

    z = np.load(PARAKEET_FIXTURES / "tiny-tdt" / "reference.npz")
    waves = [z["audio"][b, : z["audio_lengths"][b]] for b in range(4)]
    waves += [_clip("en-ls-61-70968-0002.wav"), _clip("en-librivox-sense-sensibility-0870.wav"),
              np.zeros(800, np.float32)]
    plain = ParakeetASR.from_nemo(TINY, device="cuda")
    want = plain.transcribe_batch(waves, word_timestamps=True)
    fast = ParakeetGPUASR(ParakeetASR.from_nemo(TINY, device="cuda"), dtype=torch.float32)
    got = fast.transcribe_batch(waves, word_timestamps=True)
    for a, b in zip(got, want):
        assert a.text == b.text
        assert [(w.word, w.start, w.end) for w in a.words] == [(w.word, w.start, w.end) for w in b.words]
    single = [fast.transcribe_waveform(w).text for w in waves]
    assert single == [t.text for t in want]


@pytest.mark.gpu
def test_engine_choice_wraps_parakeet_on_cuda(monkeypatch):
    m = engines.load_model(str(TINY), device="cuda")
    assert type(m).__name__ == "ParakeetGPUASR"
    assert m.transcribe_waveform(_clip("en-ls-61-70968-0002.wav")).duration == pytest.approx(2.97, abs=0.01)
    monkeypatch.setenv("FLASHASR_GPU_ENGINE", "0")
    assert type(engines.load_model(str(TINY), device="cuda")).__name__ == "ParakeetASR"


@pytest.mark.gpu
def test_gpu_engine_through_the_pipeline_equals_the_plain_model():
    """A 70 s recording cut by the pipeline (VAD when its package is there, else fixed windows):
    the float32 engine behind the one engine choice gives the plain model's transcript."""
    import importlib.util

    from flashasr.models.parakeet.model import ParakeetASR
    from flashasr.options import TranscribeOptions
    from flashasr.pipeline import transcribe_samples

    speech = [_clip(n) for n in ("en-ls-61-70968-0002.wav", "en-librivox-sense-sensibility-0870.wav")]
    x = np.resize(np.concatenate(speech + [np.zeros(8000, np.float32)]), 70 * 16000).astype(np.float32)
    seg = "vad" if importlib.util.find_spec("silero_vad") is not None else "fixed"
    opts = TranscribeOptions(segmentation=seg, word_timestamps=True, max_segment_s=30)  # the engine's window
    plain = ParakeetASR.from_nemo(TINY, device="cuda")
    fast = engines.accelerate(ParakeetASR.from_nemo(TINY, device="cuda"), dtype=torch.float32)
    assert type(fast).__name__ == "ParakeetGPUASR" and fast.max_segment_seconds == 30.0
    a, b = transcribe_samples(fast, x, opts), transcribe_samples(plain, x, opts)
    assert a.text == b.text and a.duration == b.duration == 70.0
    assert [(w.word, w.start, w.end) for w in a.words] == [(w.word, w.start, w.end) for w in b.words]
