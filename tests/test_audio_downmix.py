"""Energy-keeping downmix: phase-inverted channels must not cancel; normal stereo = mean."""

from __future__ import annotations

import numpy as np
import pytest
import soxr
from conftest import AUDIO

from flashasr.audio import Downmixer, load_audio
from flashasr.audio.encode import encode_audio


def _native(path) -> tuple[np.ndarray, int]:
    """Reference path: PyAV ``to_ndarray`` of a whole (<= 2 channel) file -> float64 [C, N]."""
    import av

    with av.open(str(path)) as c:
        frames, rate = [], None
        for f in c.decode(audio=0):
            a = f.to_ndarray()
            rate = f.sample_rate
            if not f.format.is_planar:
                a = a.reshape(-1, len(f.layout.channels)).T
            frames.append(a)
        x = np.concatenate(frames, axis=1)
    if x.dtype == np.int16:
        x = x / 32768.0
    elif x.dtype == np.int32:
        x = x / 2147483648.0
    return x.astype(np.float64), rate


def _speech(rate=16000):
    return load_audio(AUDIO / "en" / "en-jfk-inaugural.wav", target_rate=rate).samples.astype(np.float64)


def _energy(x):
    return float(np.mean(np.asarray(x, np.float64) ** 2))


def test_phase_inverted_stereo_file_keeps_energy(tmp_path):
    s = _speech(44100)
    p = tmp_path / "inv.wav"
    encode_audio(np.stack([s, -s], 1), 44100, p, format="wav", codec="pcm_s16le")
    d = load_audio(p)
    ref = load_audio(s, sample_rate=44100).samples
    n = min(len(ref), len(d.samples))
    # the plain mean would be exactly 0 here
    assert _energy(d.samples) > 0.95 * _energy(ref)
    assert abs(np.corrcoef(d.samples[:n], ref[:n])[0, 1]) > 0.99
    assert any("phase-inverted" in w for w in d.warnings)


def test_partly_inverted_keeps_energy_everywhere():
    s = _speech()
    half = len(s) // 2
    r = s.copy()
    r[half:] *= -1  # inverted only in the second half
    d = load_audio(np.stack([s, r], 1), sample_rate=16000)
    y = d.samples
    assert _energy(y[:half]) == pytest.approx(_energy(s[:half]), rel=0.01)  # mean mode: exact
    # second half: at most the 0.2 s averaging lag is lost at the switch
    assert _energy(y[half:]) > 0.9 * _energy(s[half:])


def test_scaled_inversion_falls_back_to_strongest():
    s = _speech()
    d = load_audio(np.stack([-0.8 * s, s], 1), sample_rate=16000)  # mean = 0.1 s
    assert _energy(d.samples) == pytest.approx(_energy(s), rel=0.02)


def test_in_phase_and_independent_channels_use_the_mean():
    """Mono-compatible and independent channels: output == (L + R) / 2 exactly (as ffmpeg -ac 1)."""
    s = _speech()
    rng = np.random.default_rng(0)
    other = np.roll(s, 12345) * 0.7 + 0.01 * rng.standard_normal(len(s))
    for st in (np.stack([s, s], 1), np.stack([s, 0.5 * s], 1), np.stack([s, other], 1)):
        d = load_audio(st.astype(np.float32), sample_rate=16000)
        np.testing.assert_allclose(d.samples, st.astype(np.float32).mean(axis=1), atol=1e-6)
        assert d.warnings == []


def test_silence_does_not_flip_mode():
    dm = Downmixer()
    s = _speech()[:16000].astype(np.float32)
    dm(np.stack([s, -s]), 16000)
    assert dm.mode == "strongest"
    dm(np.zeros((2, 8000), np.float32), 16000)  # digital silence: decision frozen
    assert dm.mode == "strongest"


@pytest.mark.parametrize("name", ["hard-stereo-44k-jfk.flac", "hard-stereo-44k-timit.wav",
                                  "hard-stereo-flac-one-two-three.flac", "hard-mp3-stereo-silero.mp3"])
def test_real_stereo_clips_inverted_keep_energy(tmp_path, name):
    """Real stereo clips, right channel phase-inverted and re-encoded losslessly."""
    x, rate = _native(AUDIO / "hard" / name)
    inv = np.stack([x[0], -x[1]], 1)
    p = tmp_path / "inv.flac"
    encode_audio(inv, rate, p, format="flac")
    d = load_audio(p)
    chans = [soxr.resample(x[i].astype(np.float32), rate, 16000, quality="HQ") for i in range(2)]
    emax = max(_energy(c) for c in chans)
    assert _energy(d.samples) > 0.8 * emax
    plain = load_audio(AUDIO / "hard" / name)
    assert _energy(plain.samples) > 0.8 * emax  # untouched originals are in phase


def test_two_speaker_stereo_keeps_both_channels():
    """hard-stereo-two-speakers: a different speaker per channel; both must survive."""
    p = AUDIO / "hard" / "hard-stereo-two-speakers.wav"
    x, rate = _native(p)
    assert rate == 16000
    d = load_audio(p)
    n = min(x.shape[1], len(d.samples))
    coef = np.linalg.lstsq(x[:, :n].T, d.samples[:n].astype(np.float64), rcond=None)[0]
    assert coef.min() > 0.3, coef  # each channel contributes (mean: 0.5 each)
    for ch in x:
        assert abs(np.corrcoef(ch[:n], d.samples[:n])[0, 1]) > 0.4


def test_eight_channel_file_not_silent():
    from flashasr.audio.vad import speech_segments

    d = load_audio(AUDIO / "hard" / "hard-8ch-m4a-channel-id.m4a")
    assert d.source_channels == 8
    segs = speech_segments(d.samples)
    assert sum(b - a for a, b in segs) > 3.0  # the channel announcements are all there


@pytest.mark.parametrize("fmt", ["wav", "flac"])
def test_lfe_left_out_of_51_downmix(fmt):
    """5.1: speech on the centre, a loud 40 Hz tone on LFE; the LFE stays out of the mean."""
    s = _speech(48000)[: 48000 * 3]
    n = len(s)
    tone = 0.8 * np.sin(2 * np.pi * 40 * np.arange(n) / 48000)
    x = np.zeros((n, 6))
    x[:, 2] = s  # FC
    x[:, 3] = tone  # LFE
    data = encode_audio(x, 48000, format=fmt, codec="flac" if fmt == "flac" else "pcm_s16le", layout="5.1")
    d = load_audio(data)
    assert d.source_channels == 6
    ref = load_audio(s, sample_rate=48000).samples / 5  # mean of the 5 non-LFE channels
    m = min(len(ref), len(d.samples))
    np.testing.assert_allclose(d.samples[:m], ref[:m], atol=2e-4)
