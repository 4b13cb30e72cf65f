"""flashasr.audio decoding: real clips, generated formats, raw PCM, numpy, bad inputs, memory."""

from __future__ import annotations

import io
import math
import struct
import tracemalloc
import wave

import av
import numpy as np
import pytest
import soxr
from conftest import AUDIO, manifest

from flashasr.audio import (
    AudioArgumentError,
    AudioFileNotFoundError,
    AudioTooLongError,
    CorruptAudioError,
    DecodedAudio,
    EmptyAudioError,
    NoAudioStreamError,
    UnsupportedFormatError,
    UnsupportedSampleRateError,
    iter_audio,
    load_audio,
    probe,
)
from flashasr.audio.encode import encode_audio
from flashasr.errors import AudioError, FlashASRError

CLIPS = manifest() if (AUDIO / "manifest.jsonl").exists() else []


def _sine(rate: int, seconds: float = 1.0, freq: float = 440.0, amp: float = 0.5) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return amp * np.sin(2 * np.pi * freq * t)


def _peak_hz(y: np.ndarray, rate: int = 16000) -> float:
    spec = np.abs(np.fft.rfft(y * np.hanning(len(y))))
    return float(np.argmax(spec) * rate / len(y))


def _rms(y: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.asarray(y, np.float64) ** 2)))


def _native(path) -> tuple[np.ndarray, int]:
    """Reference path: PyAV to_ndarray of a whole mono/stereo (<= 2 ch) file -> float64 [C, N]."""
    with av.open(str(path)) as c:
        frames = []
        rate = None
        for f in c.decode(audio=0):
            a = f.to_ndarray()
            rate = f.sample_rate
            ch = len(f.layout.channels)
            if not f.format.is_planar:
                a = a.reshape(-1, ch).T
            frames.append(a)
        x = np.concatenate(frames, axis=1)
    if x.dtype == np.int16:
        x = x / 32768.0
    elif x.dtype == np.int32:
        x = x / 2147483648.0
    return x.astype(np.float64), rate


# ----------------------------------------------------------------------------- real clips


@pytest.mark.parametrize("clip", CLIPS, ids=[c["id"] for c in CLIPS])
def test_manifest_clip_decodes(clip):
    d = load_audio(AUDIO / clip["path"])
    assert isinstance(d, DecodedAudio)
    assert d.sample_rate == 16000
    assert d.samples.dtype == np.float32 and d.samples.ndim == 1
    assert np.isfinite(d.samples).all()
    assert d.duration == pytest.approx(len(d.samples) / 16000)
    # ffprobe's duration counts mp3 encoder delay/padding that gapless decoding removes
    # (up to ~2 frames: 0.13 s at 8 kHz), hence the absolute allowance for mp3.
    tol = max(0.015 * clip["duration_s"], 0.15 if clip["format"] == "mp3" else 0.02)
    assert abs(d.duration - clip["duration_s"]) <= tol, (d.duration, clip["duration_s"])
    assert d.source_sample_rate == clip["sample_rate"]
    assert d.source_channels == clip["channels"]
    assert d.source_format.split("/")[0] == clip["format"].split("/")[0]
    assert not [w for w in d.warnings if "skipped" in w or "truncated" in w], d.warnings
    assert np.abs(d.samples).max() <= 1.5


SAME_RECORDING = [  # (variant, 16 kHz original): other rate / codec / channels of one recording
    ("hard/hard-stereo-44k-timit.wav", "en/en-timit-ldc93s1.wav"),
    ("hard/hard-8k-timit.wav", "en/en-timit-ldc93s1.wav"),
    ("hard/hard-48k-es-arenas.wav", "multi/es-picovoice-arenas.wav"),
    ("hard/hard-32k-de-portal.wav", "multi/de-picovoice-portal.wav"),
    ("hard/hard-mp3-ls-1272-141231-0002.mp3", "en/en-ls-1272-141231-0002.wav"),
    ("hard/hard-flac-ls-1272-141231-0002.flac", "en/en-ls-1272-141231-0002.wav"),
    ("hard/hard-stereo-44k-jfk.flac", "en/en-jfk-inaugural.wav"),
    ("hard/hard-m4a-44k-jfk.m4a", "en/en-jfk-inaugural.wav"),
]


@pytest.mark.parametrize("variant,orig", SAME_RECORDING, ids=[v.split("/")[1] for v, _ in SAME_RECORDING])
def test_same_recording_decodes_aligned(variant, orig):
    """Resampling, downmix, mp3/aac priming removal keep time alignment (lag 0) and the
    waveform (correlation > 0.99) against the 16 kHz version of the same recording."""
    x = load_audio(AUDIO / variant).samples.astype(np.float64)
    y = load_audio(AUDIO / orig).samples.astype(np.float64)
    assert abs(len(x) - len(y)) <= 0.01 * len(y)
    n = min(len(x), len(y)) - 40
    corr = {lag: np.corrcoef(x[20 + lag:20 + lag + n], y[20:20 + n])[0, 1] for lag in range(-20, 21)}
    assert max(corr, key=corr.get) == 0, corr
    assert corr[0] > 0.99


def test_bytes_filelike_path_agree():
    p = AUDIO / "en" / "en-fleurs-003.ogg"
    a = load_audio(p)
    b = load_audio(p.read_bytes())
    c = load_audio(io.BytesIO(p.read_bytes()))
    d = load_audio(memoryview(bytearray(p.read_bytes())))
    for x in (b, c, d):
        np.testing.assert_array_equal(a.samples, x.samples)


class _ReadOnly:
    """A non-seekable binary stream (like a socket or pipe)."""

    def __init__(self, data: bytes):
        self._b = io.BytesIO(data)

    def read(self, n=-1):
        return self._b.read(n)


def test_nonseekable_stream():
    p = AUDIO / "en" / "en-fleurs-003.ogg"
    a = load_audio(p)
    b = load_audio(_ReadOnly(p.read_bytes()))
    np.testing.assert_array_equal(a.samples, b.samples)


def test_streaming_resample_matches_one_shot_reference():
    """Fast path (frame-by-frame soxr stream) == simple path (whole array, soxr.resample)."""
    p = AUDIO / "hard" / "hard-48k-fr-consulat.wav"
    x, rate = _native(p)
    ref = soxr.resample(x.mean(axis=0).astype(np.float32), rate, 16000, quality="HQ")
    d = load_audio(p)
    assert abs(len(ref) - len(d.samples)) <= 1
    n = min(len(ref), len(d.samples))
    assert np.abs(ref[:n] - d.samples[:n]).max() < 1e-5


def test_probe_reads_headers_only():
    info = probe(AUDIO / "hard" / "hard-8ch-m4a-channel-id.m4a")
    assert info["channels"] == 8 and info["sample_rate"] == 48000
    assert info["codec"] == "aac" and info["format"] == "m4a/aac"
    assert info["duration"] == pytest.approx(8.05, abs=0.05)
    f = io.BytesIO((AUDIO / "en" / "en-fleurs-003.ogg").read_bytes())
    assert probe(f)["format"] == "ogg/opus" and f.tell() == 0
    assert load_audio(f).duration == pytest.approx(5.766, abs=0.02)  # still decodable
    info = probe(np.zeros((800, 2), np.int16), sample_rate=8000)
    assert info["duration"] == pytest.approx(0.1) and info["channels"] == 2
    info = probe(b"\0" * 3200, raw_format="s16le", sample_rate=16000)
    assert info["duration"] == pytest.approx(0.1)


# ----------------------------------------------------------------------------- generated formats


PCM_CODECS = ["pcm_u8", "pcm_s16le", "pcm_s24le", "pcm_s32le", "pcm_f32le", "pcm_f64le",
              "pcm_mulaw", "pcm_alaw"]
# allowed max error vs the exact signal after resampling
PCM_TOL = {"pcm_u8": 2e-2, "pcm_s16le": 1e-3, "pcm_s24le": 1e-3, "pcm_s32le": 1e-3,
           "pcm_f32le": 1e-3, "pcm_f64le": 1e-3, "pcm_mulaw": 3e-2, "pcm_alaw": 3e-2}


@pytest.mark.parametrize("codec", PCM_CODECS)
@pytest.mark.parametrize("rate", [8000, 16000, 44100, 48000])
def test_wav_pcm_widths(tmp_path, codec, rate):
    sig = _sine(rate, 0.5, freq=300.0)
    path = tmp_path / f"{codec}.wav"
    encode_audio(sig, rate, path, format="wav", codec=codec)
    d = load_audio(path)
    assert d.source_sample_rate == rate and d.source_channels == 1
    assert d.source_format == f"wav/{codec}"
    assert len(d.samples) == round(0.5 * 16000)
    ref = _sine(16000, 0.5, freq=300.0)
    mid = slice(800, -800)  # the resampler's edges
    assert np.abs(d.samples[mid] - ref[mid]).max() < PCM_TOL[codec]


def test_wave_module_file(tmp_path):
    sig = (_sine(22050, 1.0) * 32767).astype("<i2")
    p = tmp_path / "w.wav"
    with wave.open(str(p), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(22050)
        w.writeframes(sig.tobytes())
    d = load_audio(p)
    assert d.duration == pytest.approx(1.0, abs=1e-3)
    assert _peak_hz(d.samples) == pytest.approx(440, abs=2)
    assert _rms(d.samples[1000:-1000]) == pytest.approx(0.5 / np.sqrt(2), rel=0.01)



@pytest.mark.parametrize("codec,rate,ch", [("pcm_s16le", 16000, 1), ("pcm_s24le", 48000, 6),
                                           ("adpcm_ms", 22050, 1), ("adpcm_ima_wav", 16000, 2),
                                           ("pcm_mulaw", 8000, 1)])
def test_wav_without_stream_probe_decodes_the_same(monkeypatch, codec, rate, ch):
    """The WAV shortcut (no FFmpeg stream probe: the header says it all) must lose nothing:
    same samples, format, declared length and damage warnings as the probed open, whole and cut."""
    import flashasr.audio.decode as decode

    sig = _sine(rate, 1.5, freq=300.0)
    data = encode_audio(np.stack([sig] * ch, 1) if ch > 1 else sig, rate, format="wav", codec=codec)
    for blob in (data, data[: len(data) * 2 // 3]):
        fast = load_audio(blob)
        monkeypatch.setattr(decode, "_WAV_PROBE", {})
        probed = load_audio(blob)
        monkeypatch.undo()
        assert np.array_equal(fast.samples, probed.samples)
        assert (fast.source_format, fast.source_sample_rate, fast.source_channels, fast.declared_duration,
                fast.warnings) == (probed.source_format, probed.source_sample_rate, probed.source_channels,
                                   probed.declared_duration, probed.warnings)
    assert fast.warnings  # the cut copy says it is truncated

def _decoded_both_ways(monkeypatch, make_source):
    """load_audio of ``make_source()`` through the numpy WAV reader and through FFmpeg: (whether
    the reader took it, the two results: a DecodedAudio's fields or the error's type and text)."""
    import flashasr.audio.decode as decode

    took, real = [], decode._WavSource.open

    def spy(*a):
        got = real(*a)
        took.append(got is not None)
        return got

    out = []
    for opener in (spy, lambda *a: None):
        monkeypatch.setattr(decode._WavSource, "open", opener)
        try:
            d = load_audio(make_source())
            out.append((d.samples, d.source_format, d.source_sample_rate, d.source_channels,
                        d.declared_duration, d.warnings))
        except AudioError as e:
            out.append((type(e).__name__, str(e)))
        monkeypatch.undo()
    return any(took), out[0], out[1]


def _assert_same(a, b):
    assert len(a) == len(b)
    if len(a) == 2:
        assert a == b
    else:
        assert np.array_equal(a[0], b[0])
        assert a[1:] == b[1:]


@pytest.mark.parametrize("codec", ["pcm_u8", "pcm_s16le", "pcm_s32le", "pcm_f32le", "pcm_f64le"])
@pytest.mark.parametrize("rate,ch", [(16000, 1), (44100, 2), (8000, 2)])
def test_wav_numpy_reader_equals_ffmpeg(monkeypatch, tmp_path, codec, rate, ch):
    """A plain PCM WAV is read with numpy, not FFmpeg: the same samples (bit for bit), format, rate,
    channels, declared length and warnings, whole, cut mid-sample and cut inside its header, from
    bytes, a path and a file object."""
    rng = np.random.default_rng(rate + ch)
    sig = (rng.standard_normal((int(rate * 1.3), ch)) * 0.2).astype(np.float32)
    data = encode_audio(sig if ch > 1 else sig[:, 0], rate, format="wav", codec=codec)
    path = tmp_path / "a.wav"
    for blob, fast in ((data, True), (data[: len(data) * 2 // 3 + 1], True), (data[:30], False)):
        path.write_bytes(blob)
        for make in (lambda: blob, lambda: path, lambda: io.BytesIO(blob)):
            took, a, b = _decoded_both_ways(monkeypatch, make)
            assert took == fast
            _assert_same(a, b)
    assert "truncated" in " ".join(_decoded_both_ways(monkeypatch, lambda: data[: len(data) * 2 // 3 + 1])[1][5])


def _riff(chunks: list[tuple[bytes, bytes]]) -> bytes:
    body = b"WAVE" + b"".join(cid + len(c).to_bytes(4, "little") + c + b"\0" * (len(c) & 1) for cid, c in chunks)
    return b"RIFF" + len(body).to_bytes(4, "little") + body


def test_wav_numpy_reader_chunks_and_extensible(monkeypatch):
    """Chunks around ``data`` (``fact`` before, ``LIST`` after: never read as audio) and
    WAVE_FORMAT_EXTENSIBLE stereo PCM16 read as FFmpeg reads them; 24-bit and mu-law go to FFmpeg."""
    pcm = (np.random.default_rng(1).standard_normal(2 * 24000) * 3000).astype("<i2").tobytes()
    plain = (1).to_bytes(2, "little") + (2).to_bytes(2, "little") + (24000).to_bytes(4, "little") + \
        (96000).to_bytes(4, "little") + (4).to_bytes(2, "little") + (16).to_bytes(2, "little")
    guid = (1).to_bytes(2, "little") + bytes.fromhex("000000001000800000aa00389b71")
    ext = (0xFFFE).to_bytes(2, "little") + plain[2:] + (22).to_bytes(2, "little") + (16).to_bytes(2, "little") + \
        (3).to_bytes(4, "little") + guid
    for fmt in (plain, ext):
        blob = _riff([(b"fmt ", fmt), (b"fact", (24000).to_bytes(4, "little")), (b"data", pcm),
                      (b"LIST", b"INFOISFT\x05\0\0\0test\0")])
        took, a, b = _decoded_both_ways(monkeypatch, lambda: blob)
        assert took
        _assert_same(a, b)
        assert a[0].size == 16000  # 1 s: the LIST chunk is not audio
    for codec in ("pcm_s24le", "pcm_mulaw"):
        blob = encode_audio(_sine(16000, 0.5), 16000, format="wav", codec=codec)
        took, a, b = _decoded_both_ways(monkeypatch, lambda: blob)
        assert not took
        _assert_same(a, b)


def test_plain_wavs_are_not_split_into_ranges(tmp_path, monkeypatch):
    """Which files load_audio_parallel leaves to one thread without opening them with FFmpeg: PCM
    WAVs that are short, or already at the target rate (unless the caller keeps the ranges'
    shared-memory segment); and plain_pcm_wav's answer (a file's position kept)."""
    import flashasr.audio.parallel as par
    from flashasr.audio.decode import plain_pcm_wav

    planned = []
    real = par._plan
    monkeypatch.setattr(par, "_plan", lambda *a, **k: planned.append(a[0]) or real(*a, **k))

    def wav(rate, seconds, codec="pcm_s16le"):
        p = tmp_path / f"{rate}_{seconds}_{codec}.wav"
        encode_audio(np.zeros(int(rate * seconds), np.float32), rate, p, format="wav", codec=codec)
        return p

    for p, ranges in ((wav(44100, 30), False), (wav(16000, 90), False), (wav(44100, 90), True),
                      (wav(16000, 90, "pcm_s24le"), True)):
        planned.clear()
        par.load_audio_parallel(p, workers=2, pool="thread")
        assert bool(planned) == ranges, p.name
    planned.clear()
    par.load_audio_parallel(wav(16000, 90), workers=2, pool="thread", keep_segment=True)
    assert planned  # the caller wants the ranges' segment (the server's engine maps it)
    assert plain_pcm_wav(wav(44100, 30)) == (44100, pytest.approx(30.0))
    assert plain_pcm_wav(wav(16000, 90, "pcm_s24le")) is None
    mp3 = tmp_path / "a.mp3"
    encode_audio(np.zeros(16000 * 5, np.float32), 16000, mp3, format="mp3")
    assert plain_pcm_wav(mp3) is None
    with open(wav(16000, 90), "rb") as f:
        f.seek(100)
        assert plain_pcm_wav(f) == (16000, pytest.approx(90.0)) and f.tell() == 100


LOSSY = [
    ("flac", "flac", 44100, 2, 0.001),
    ("flac", "flac", 8000, 1, 0.001),
    ("mp3", "libmp3lame", 44100, 1, 0.06),
    ("mp3", "libmp3lame", 16000, 2, 0.06),
    ("ogg", "libopus", 48000, 1, 0.06),
    ("ogg", "vorbis", 44100, 2, 0.06),
    ("webm", "libopus", 48000, 2, 0.06),
    ("ipod", "aac", 44100, 1, 0.06),
    ("aiff", "pcm_s16be", 32000, 1, 0.001),
]


@pytest.mark.parametrize("fmt,codec,rate,ch,rms_tol", LOSSY, ids=[f"{f}-{c}-{r}-{ch}" for f, c, r, ch, _ in LOSSY])
def test_codecs_and_containers(fmt, codec, rate, ch, rms_tol):
    sig = _sine(rate, 1.0)
    data = encode_audio(np.stack([sig] * ch, 1) if ch > 1 else sig, rate, format=fmt, codec=codec)
    d = load_audio(data)
    assert d.source_sample_rate == rate and d.source_channels == ch
    assert d.duration == pytest.approx(1.0, abs=0.03)  # aac/opus priming without an edit list
    assert _peak_hz(d.samples) == pytest.approx(440, abs=3)
    body = d.samples[2000:-2000]
    assert _rms(body) == pytest.approx(0.5 / np.sqrt(2), rel=max(rms_tol, 0.01))


# ----------------------------------------------------------------------------- raw PCM / numpy


def test_raw_pcm_s16le_and_f32le():
    rate = 8000
    st = np.stack([_sine(rate, 1.0), _sine(rate, 1.0, amp=0.25)], 1)
    s16 = np.round(st * 32767).astype("<i2")
    a = load_audio(s16.tobytes(), raw_format="s16le", sample_rate=rate, channels=2)
    b = load_audio(st.astype("<f4").tobytes(), raw_format="f32le", sample_rate=rate, channels=2)
    c = load_audio(s16, sample_rate=rate)
    assert a.source_format == "raw/s16le" and b.source_format == "raw/f32le"
    assert a.source_channels == 2 and a.duration == pytest.approx(1.0)
    np.testing.assert_array_equal(a.samples, c.samples)
    assert np.abs(a.samples - b.samples).max() < 1e-3
    # mean of the two in-phase channels: amplitude 0.375
    assert _rms(a.samples[500:-500]) == pytest.approx(0.375 / np.sqrt(2), rel=0.01)
    # from a file object and a path, with a trailing partial frame
    d = load_audio(io.BytesIO(s16.tobytes() + b"\x01"), raw_format="s16le", sample_rate=rate, channels=2)
    np.testing.assert_array_equal(d.samples, a.samples)
    assert any("trailing" in w for w in d.warnings)


def test_raw_pcm_bad_args():
    with pytest.raises(AudioArgumentError):
        load_audio(b"\0\0" * 100, raw_format="s16le")  # no sample_rate
    with pytest.raises(AudioArgumentError):
        load_audio(b"\0\0" * 100, raw_format="mp3", sample_rate=16000)
    with pytest.raises(EmptyAudioError):
        load_audio(b"", raw_format="s16le", sample_rate=16000)
    with pytest.raises(EmptyAudioError):
        load_audio(b"\0", raw_format="s16le", sample_rate=16000)  # not one whole sample


@pytest.mark.parametrize("dtype,scale", [(np.int16, 32767), (np.int32, 2**31 - 1), (np.uint8, None),
                                         (np.float32, 1.0), (np.float64, 1.0), (np.int8, 127)])
def test_numpy_dtypes(dtype, scale):
    sig = _sine(24000, 0.5)
    if dtype is np.uint8:
        arr = np.round(sig * 127 + 128).astype(np.uint8)
    else:
        arr = (np.round(sig * scale) if scale != 1.0 else sig).astype(dtype)
    d = load_audio(arr, sample_rate=24000)
    assert d.source_format == f"numpy/{np.dtype(dtype).name}"
    ref = _sine(16000, 0.5)
    tol = 2e-2 if np.dtype(dtype).itemsize == 1 else 1e-3
    assert np.abs(d.samples[500:-500] - ref[500:-500]).max() < tol


def test_numpy_multichannel_and_shapes():
    sig = _sine(16000, 0.5)
    nc = np.stack([sig, sig, sig], 1).astype(np.float32)  # [N, 3]
    d = load_audio(nc, sample_rate=16000)
    assert d.source_channels == 3 and len(d.samples) == 8000
    np.testing.assert_allclose(d.samples, sig, atol=1e-6)  # mean of identical channels
    with pytest.raises(AudioArgumentError, match=r"\[C, N\]"):
        load_audio(nc.T.copy(), sample_rate=16000)
    with pytest.raises(AudioArgumentError, match="sample_rate"):
        load_audio(sig)
    with pytest.raises(EmptyAudioError):
        load_audio(np.zeros(0, np.float32), sample_rate=16000)
    with pytest.raises(AudioArgumentError):
        load_audio(np.zeros((2, 2, 2)), sample_rate=16000)


def test_numpy_nonfinite_replaced():
    x = _sine(16000, 0.5).astype(np.float32)
    x[100] = np.nan
    x[200] = np.inf
    d = load_audio(x, sample_rate=16000)
    assert np.isfinite(d.samples).all()
    assert any("replaced 2 non-finite" in w for w in d.warnings)
    assert x[100] != x[100]  # the caller's array is not modified
    # stereo, NaN in one channel of a phase-inverted pair: the downmix must still recover
    st = np.stack([x, -x], 1)
    d = load_audio(st, sample_rate=16000)
    assert np.isfinite(d.samples).all()
    assert _rms(d.samples[4000:]) == pytest.approx(0.5 / np.sqrt(2), rel=0.02)


def test_sample_rate_change_mid_stream():
    """Two mp3 streams back to back (44.1 kHz then 48 kHz): both parts decode."""
    a = encode_audio(_sine(44100, 1.0, amp=0.3), 44100, format="mp3")
    b = encode_audio(_sine(48000, 2.0, amp=0.3), 48000, format="mp3")
    d = load_audio(a + b)
    assert d.duration == pytest.approx(3.0, abs=0.1)
    assert any("sample rate changed" in w for w in d.warnings)
    assert _rms(d.samples[16000:-16000]) == pytest.approx(0.3 / np.sqrt(2), rel=0.1)


def test_target_rate_none_keeps_rate():
    d = load_audio(_sine(22050, 0.2), sample_rate=22050, target_rate=None)
    assert d.sample_rate == 22050 and len(d.samples) == 4410


# ----------------------------------------------------------------------------- bad inputs


def _assert_names(err, name: str):
    assert isinstance(err.value, FlashASRError) and err.value.code
    assert name in str(err.value)


def test_empty_file(tmp_path):
    p = tmp_path / "empty.wav"
    p.write_bytes(b"")
    with pytest.raises(EmptyAudioError) as e:
        load_audio(p)
    _assert_names(e, "empty.wav")
    with pytest.raises(EmptyAudioError):
        load_audio(b"")
    with pytest.raises(EmptyAudioError):
        load_audio(io.BytesIO(b""))


def test_zero_length_wav(tmp_path):
    p = tmp_path / "zero.wav"
    with wave.open(str(p), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(b"")
    with pytest.raises(EmptyAudioError) as e:
        load_audio(p)
    _assert_names(e, "zero.wav")
    assert e.value.code == "empty_audio"


def _pcm16_wav(rate: int, n: int = 8000) -> bytes:
    """A mono 16-bit WAV whose header claims ``rate`` Hz (byte rate wrapped at 32 bits, as a writer's
    overflow would leave it)."""
    data = (np.sin(np.arange(n) / 10) * 8000).astype("<i2").tobytes()
    fmt = struct.pack("<HHIIHH", 1, 1, rate, (rate * 2) & 0xFFFFFFFF, 2, 16)
    body = b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt + b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


@pytest.mark.parametrize("rate", [2**32 - 1, 2**31 - 1, 1_000_000, 999, 1, 0])
def test_a_sample_rate_no_recording_uses_is_refused_by_name(rate):
    """2^31-1 Hz made a WAV's samples microseconds of audio (an empty transcript, answered 200); 1 Hz
    made 16 KB hours of audio. Refused from a WAV header (our reader or FFmpeg's), raw PCM and arrays."""
    with pytest.raises(UnsupportedSampleRateError, match=f"{rate} Hz is outside") as e:
        load_audio(io.BytesIO(_pcm16_wav(rate)))
    with pytest.raises(UnsupportedSampleRateError, match=f"{rate} Hz is outside"):
        probe(io.BytesIO(_pcm16_wav(rate)))
    assert e.value.code == "unsupported_sample_rate" and isinstance(e.value, UnsupportedFormatError)
    if rate in (0, 2**32 - 1):  # 0 and 2^32-1 Hz went to FFmpeg, refused there as unsupported_format
        return
    with pytest.raises(UnsupportedSampleRateError):
        load_audio(np.zeros(4000, np.int16).tobytes(), raw_format="s16le", sample_rate=rate)
    with pytest.raises(UnsupportedSampleRateError):
        load_audio(np.zeros(4000, np.float32), sample_rate=rate)


def test_a_sample_rate_argument_is_checked_before_any_buffer_is_sized_from_it():
    """sample_rate=2**31-1 for raw PCM with target_rate=None sized a 60 s output buffer from it first
    (485 GiB: a MemoryError, not the rate's error); NaN, a string or 16000.5 gave bare Python errors;
    probe() reported any rate."""
    raw = np.zeros(1000, np.int16).tobytes()
    for bad in (2**31 - 1, 1, 0, -16000):
        with pytest.raises(UnsupportedSampleRateError):
            load_audio(raw, raw_format="s16le", sample_rate=bad, target_rate=None)
        with pytest.raises(UnsupportedSampleRateError):
            probe(raw, raw_format="s16le", sample_rate=bad)
    for bad in (float("nan"), "16000", 16000.5):
        with pytest.raises(AudioArgumentError, match="whole number of Hz"):
            load_audio(np.zeros(100, np.float32), sample_rate=bad)
    assert load_audio(np.zeros(1600, np.float32), sample_rate=16000.0).duration == pytest.approx(0.1)
    assert load_audio(np.zeros(800, np.float32), sample_rate=np.int64(8000)).source_sample_rate == 8000
    from decimal import Decimal
    from fractions import Fraction

    for whole in (np.float32(16000), Fraction(16000), Decimal("16000")):  # a trial found these refused
        assert load_audio(np.zeros(1600, np.float32), sample_rate=whole).source_sample_rate == 16000
    with pytest.raises(UnsupportedSampleRateError):
        probe(io.BytesIO(_pcm16_wav(2**31 - 1)))
    with pytest.raises(UnsupportedSampleRateError):
        load_audio(io.BytesIO(_pcm16_wav(700_000_000)), target_rate=None)


@pytest.mark.parametrize("rate", [1000, 8000, 768_000])
def test_the_sample_rates_recordings_use_still_decode(rate):
    d = load_audio(io.BytesIO(_pcm16_wav(rate)))
    assert d.source_sample_rate == rate and abs(d.duration - 8000 / rate) < 1e-3


def test_text_renamed_wav(tmp_path):
    p = tmp_path / "notes.wav"
    p.write_text("This is a text file, not audio.\n" * 20)
    with pytest.raises((UnsupportedFormatError, NoAudioStreamError)) as e:
        load_audio(p)
    _assert_names(e, "notes.wav")


def test_subtitle_file_has_no_audio_stream(tmp_path):
    p = tmp_path / "subs.wav"
    p.write_text("1\n00:00:01,000 --> 00:00:02,000\nhello\n\n")
    with pytest.raises(NoAudioStreamError) as e:
        load_audio(p)
    _assert_names(e, "subs.wav")
    assert "no audio stream" in str(e.value)


def test_video_only_file():
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as o:
        s = o.add_stream("mpeg4", rate=10)
        s.width, s.height, s.pix_fmt = 64, 64, "yuv420p"
        for i in range(3):
            fr = av.VideoFrame.from_ndarray(np.zeros((64, 64, 3), np.uint8), format="rgb24")
            fr.pts = i
            for pkt in s.encode(fr):
                o.mux(pkt)
        for pkt in s.encode(None):
            o.mux(pkt)
    with pytest.raises(NoAudioStreamError, match="video"):
        load_audio(buf.getvalue())


@pytest.mark.parametrize("seed", range(5))
def test_random_bytes(seed):
    data = np.random.default_rng(seed).integers(0, 256, 20000, dtype=np.uint8).tobytes()
    with pytest.raises((UnsupportedFormatError, CorruptAudioError, NoAudioStreamError)) as e:
        load_audio(data)
    assert isinstance(e.value, AudioError)


def test_lists_referring_to_other_files_are_refused(tmp_path):
    """An uploaded ffconcat list / HLS playlist must not make FFmpeg read other files."""
    wav = AUDIO / "en" / "en-jfk-inaugural.wav"
    concat = f"ffconcat version 1.0\nfile '{wav}'\n".encode()
    hls = (f"#EXTM3U\n#EXT-X-TARGETDURATION:20\n#EXTINF:11.0,\nfile://{wav}\n#EXT-X-ENDLIST\n").encode()
    for data in (concat, hls):
        with pytest.raises(UnsupportedFormatError):
            load_audio(data)
        p = tmp_path / "list.txt"
        p.write_bytes(data)
        with pytest.raises(UnsupportedFormatError):
            load_audio(p)


def test_missing_file(tmp_path):
    with pytest.raises(AudioFileNotFoundError) as e:
        load_audio(tmp_path / "nope.flac")
    assert isinstance(e.value, FileNotFoundError) and isinstance(e.value, AudioError)
    _assert_names(e, "nope.flac")


def test_truncated_mp3_gives_prefix():
    p = AUDIO / "hard" / "hard-mp3-ls-1272-141231-0002.mp3"
    data = p.read_bytes()
    full = load_audio(data)
    for frac in (0.1, 0.5, 0.9):
        d = load_audio(data[: int(len(data) * frac)])
        # constant bit rate: the prefix duration follows the byte fraction
        assert d.duration == pytest.approx(full.duration * frac, rel=0.1, abs=0.15)
        n = len(d.samples) - 2000  # the resampler tail differs at the cut
        np.testing.assert_allclose(d.samples[:n], full.samples[:n], atol=1e-6)
        assert any("truncated" in w for w in d.warnings), d.warnings


def test_truncated_wav_gives_prefix():
    p = AUDIO / "en" / "en-ls-61-70968-0002.wav"
    data = p.read_bytes()
    full = load_audio(data)
    d = load_audio(data[: len(data) // 2 + 1])  # odd cut: half a sample
    assert d.duration == pytest.approx(full.duration / 2, abs=0.02)
    n = len(d.samples) - 200
    np.testing.assert_allclose(d.samples[:n], full.samples[:n], atol=1e-6)


def test_corrupted_middle_mp3_skips_and_warns():
    data = bytearray((AUDIO / "hard" / "hard-mp3-ls-1272-141231-0002.mp3").read_bytes())
    data[40000:42000] = np.random.default_rng(1).integers(0, 256, 2000, dtype=np.uint8).tobytes()
    d = load_audio(bytes(data))
    assert d.duration > 12.0  # only the damaged packets are lost
    assert d.warnings


class _CountingReader(io.BytesIO):
    def __init__(self, data):
        super().__init__(data)
        self.bytes_read = 0

    def read(self, n=-1):
        b = super().read(n)
        self.bytes_read += len(b)
        return b


def test_max_duration_raises_early():
    data = (AUDIO / "long" / "long-silero-test-60s.wav").read_bytes()
    r = _CountingReader(data)
    with pytest.raises(AudioTooLongError) as e:
        load_audio(r, max_duration=5.0)
    assert e.value.code == "audio_too_long"
    assert r.bytes_read < 0.25 * len(data)  # stopped soon after 5 s, not at the end
    assert load_audio(data, max_duration=61.0).duration == pytest.approx(60.0, abs=0.01)
    with pytest.raises(AudioTooLongError):
        load_audio(np.zeros(16000 * 3, np.float32), sample_rate=16000, max_duration=2.0)
    with pytest.raises(AudioTooLongError):
        list(iter_audio(data, max_duration=5.0, block_seconds=1.0))


# ----------------------------------------------------------------------------- iter_audio / memory


def test_iter_audio_blocks_equal_load_audio():
    p = AUDIO / "hard" / "hard-8k-harvard-list72.wav"
    full = load_audio(p).samples
    warns: list[str] = []
    blocks = list(iter_audio(p, block_seconds=4.0, warnings=warns))
    assert all(len(b) == 64000 for b in blocks[:-1]) and 0 < len(blocks[-1]) <= 64000
    np.testing.assert_array_equal(np.concatenate(blocks), full)
    assert warns == []


def test_iter_audio_array_and_raw():
    x = _sine(16000, 2.5).astype(np.float32)
    blocks = list(iter_audio(x, sample_rate=16000, block_seconds=1.0))
    assert [len(b) for b in blocks] == [16000, 16000, 8000]
    raw = np.round(x * 32767).astype("<i2").tobytes()
    blocks = list(iter_audio(raw, raw_format="s16le", sample_rate=16000, block_seconds=1.0))
    assert sum(len(b) for b in blocks) == 40000


def _write_long_wav(path, seconds: float, rate: int = 44100):
    """~seconds of real speech (tiled) as 16-bit stereo WAV, written block by block."""
    speech = load_audio(AUDIO / "en" / "en-ls-1272-141231-0002.wav", target_rate=rate).samples
    pcm = np.round(np.clip(speech, -1, 1) * 32767).astype("<i2")
    st = np.repeat(pcm[:, None], 2, axis=1).tobytes()
    reps = int(np.ceil(seconds * rate / len(pcm)))
    with wave.open(str(path), "wb") as w:
        w.setnchannels(2)
        w.setsampwidth(2)
        w.setframerate(rate)
        for _ in range(reps):
            w.writeframes(st)
    return reps * len(pcm) / rate


def test_memory_bounded_on_long_input(tmp_path):
    """10 min of 44.1 kHz stereo (106 MB of PCM): iter_audio stays near one block, load_audio
    near its 16 kHz output (38 MB); neither holds the native-rate PCM."""
    p = tmp_path / "long.wav"
    seconds = _write_long_wav(p, 600)
    out_bytes = seconds * 16000 * 4
    tracemalloc.start()
    try:
        n = 0
        for b in iter_audio(p, block_seconds=30.0):
            n += len(b)
        _, peak_iter = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        d = load_audio(p)
        _, peak_load = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert n == len(d.samples)
    assert d.duration == pytest.approx(seconds, abs=0.01)
    block_bytes = 30 * 16000 * 4
    assert peak_iter < 3 * block_bytes + 2_000_000, peak_iter
    assert peak_load < 1.1 * out_bytes + 2_000_000, (peak_load, out_bytes)


def test_spooled_upload_and_threads():
    """The server passes SpooledTemporaryFile uploads and decodes in a thread pool."""
    import concurrent.futures as cf
    import tempfile

    paths = [AUDIO / "en" / n for n in ("en-fleurs-000.ogg", "en-jfk-inaugural.wav",
                                         "en-ls-2412-153948-0000.flac")]
    paths += [AUDIO / "hard" / n for n in ("hard-m4a-44k-jfk.m4a", "hard-mp3-stereo-silero.mp3",
                                           "hard-stereo-44k-jfk.flac")]
    ref = [load_audio(p).samples for p in paths]

    def spooled(p):
        f = tempfile.SpooledTemporaryFile(max_size=100_000)
        f.write(p.read_bytes())
        f.seek(0)
        return load_audio(f).samples

    with cf.ThreadPoolExecutor(4) as ex:
        got = list(ex.map(spooled, paths * 2))
    for a, b in zip(ref * 2, got):
        np.testing.assert_array_equal(a, b)


def test_absurd_float_magnitudes_are_clipped_with_a_warning():
    """A float WAV scaled by 1e30 (finite, far beyond full scale) once reached Whisper's sampling as
    inf probabilities (a 500): such samples are clipped to +-1 and named in a warning; loud but sane
    float audio (a few times full scale) is left as it is."""
    import struct

    def float_wav(x, rate=16000):
        data = x.astype("<f4").tobytes()
        fmt = struct.pack("<HHIIHH", 3, 1, rate, rate * 4, 4, 32)
        return (b"RIFF" + struct.pack("<I", 4 + 8 + len(fmt) + 8 + len(data)) + b"WAVE" + b"fmt "
                + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data)

    x = _sine(16000, 0.5).astype(np.float32)
    x[100:110] *= 1e30
    x[300] = np.nan
    d = load_audio(io.BytesIO(float_wav(x)))
    assert np.isfinite(d.samples).all() and np.abs(d.samples).max() <= 1.0
    assert any("clipped 10 samples" in w for w in d.warnings) and any("replaced 1 non-finite" in w for w in d.warnings)
    np.testing.assert_allclose(d.samples[1000:2000], x[1000:2000], atol=1e-6)  # the rest untouched
    y = _sine(16000, 0.5).astype(np.float32)
    y[50:66] = 1e6  # beyond ABSURD_SAMPLE without overflowing a sum of squares: clipped too
    d = load_audio(io.BytesIO(float_wav(y)))
    assert np.abs(d.samples).max() <= 1.0 and any("clipped 16 samples" in w for w in d.warnings)
    loud = (_sine(16000, 0.5) * 6).astype(np.float32)  # a few times full scale: audio, not damage
    d = load_audio(io.BytesIO(float_wav(loud)))
    assert not d.warnings and np.abs(d.samples).max() > 2.9
    # a source within the limit whose resampling rings past it (a trial's float file hard-limited at
    # +-9,500, 44.1 kHz: 11,072 at 16 kHz, and every door then refused the decoded file): the decoder
    # holds its output within the limit, says so, and the file transcribes
    from flashasr.errors import ABSURD_SAMPLE
    from flashasr.models.base import as_waveform

    sq = np.sign(np.sin(2 * np.pi * 3000 * np.arange(44100) / 44100)).astype(np.float32) * 9500
    from flashasr.audio import iter_audio

    d = load_audio(io.BytesIO(float_wav(sq, 44100)))
    warns: list[str] = []  # the block-wise decode (long files) shares the pipeline: the same samples
    blocks = np.concatenate(list(iter_audio(io.BytesIO(float_wav(sq, 44100)), block_seconds=0.25, warnings=warns)))
    np.testing.assert_array_equal(blocks, d.samples)
    for w in (d.warnings, warns):
        assert any("limited" in m and "resampled samples" in m for m in w), w
    assert 9000 < np.abs(d.samples).max() <= ABSURD_SAMPLE
    as_waveform(d.samples)  # what every model applies: accepted
    # float64 samples beyond float32's range are clipped like any absurd sample (they became inf in the
    # cast, with numpy's overflow warning, and were reported as non-finite: a trial), in a file and an array
    import warnings

    z = _sine(16000, 0.5).astype(np.float64)
    z[500] = 1e39
    data = z.astype("<f8").tobytes()
    fmt = struct.pack("<HHIIHH", 3, 1, 16000, 16000 * 8, 8, 64)
    wav64 = (b"RIFF" + struct.pack("<I", 4 + 8 + len(fmt) + 8 + len(data)) + b"WAVE" + b"fmt "
             + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for src in (io.BytesIO(wav64), z):
            d = load_audio(src, sample_rate=None if isinstance(src, io.BytesIO) else 16000)
            assert d.warnings == ["clipped 1 samples beyond +-10000 to full scale (+-1)"], d.warnings
            assert np.abs(d.samples).max() <= 1.0


def _chunks_wav(chunks: list[tuple[bytes, bytes]], riff: bytes = b"RIFF") -> bytes:
    """A WAVE file of the given (id, body) chunks, in order (odd bodies padded)."""
    body = b"WAVE" + b"".join(c + struct.pack("<I", len(b)) + b + (b"\0" if len(b) & 1 else b"") for c, b in chunks)
    return riff + struct.pack("<I", len(body)) + body


def _fmt(rate: int, tag: int = 1, ch: int = 1, bits: int = 16, n: int = 16) -> bytes:
    align = ch * bits // 8
    body = struct.pack("<HHIIHH", tag, ch, rate, (rate * align) & 0xFFFFFFFF, align, bits)
    if tag == 0xFFFE:  # WAVE_FORMAT_EXTENSIBLE, valid bits 12 of 16, subformat PCM
        body += struct.pack("<HHI", 22, 12, 4) + struct.pack("<H", 1) + bytes.fromhex("000000001000800000aa00389b71")
    return body[:n] if n < 16 else body


@pytest.mark.parametrize("layout", ["extensible", "fmt of 14 bytes", "data before fmt", "LIST before fmt", "RF64"])
@pytest.mark.parametrize("rate", [0, 2**32 - 1])
def test_a_wav_rate_out_of_range_is_named_whatever_the_header_layout(layout, rate, tmp_path):
    """A trial found 0 Hz and 2^32-1 Hz refused as FFmpeg's unsupported_format in these layouts
    (FFmpeg refuses them first): the first fmt chunk's rate is checked by name in every one."""
    data = (b"data", np.zeros(800, "<i2").tobytes())
    chunks = {"extensible": [(b"fmt ", _fmt(rate, tag=0xFFFE)), data],
              "fmt of 14 bytes": [(b"fmt ", _fmt(rate, n=14)), data],
              "data before fmt": [data, (b"fmt ", _fmt(rate))],
              "LIST before fmt": [(b"LIST", b"INFOISFT" + struct.pack("<I", 2000) + b"x" * 2000), (b"fmt ", _fmt(rate)), data],
              "RF64": [(b"ds64", bytes(28)), (b"fmt ", _fmt(rate)), data]}[layout]
    blob = _chunks_wav(chunks, b"RF64" if layout == "RF64" else b"RIFF")
    for src in (blob, io.BytesIO(blob)):
        with pytest.raises(UnsupportedSampleRateError, match=f"{rate} Hz is outside"):
            load_audio(src)
        with pytest.raises(UnsupportedSampleRateError, match=f"{rate} Hz is outside"):
            probe(src)


def test_a_large_wav_rate_out_of_range_is_named_by_the_parallel_decode(tmp_path):
    """A trial: uploads of 256 KiB and more (and paths given to ``transcribe``) decode through
    load_audio_parallel, whose WAV check swallowed the rate error, so FFmpeg refused 0 Hz as
    unsupported_format."""
    from flashasr.audio import load_audio_parallel

    for rate in (0, 2**32 - 1, 1):
        p = tmp_path / f"r{rate}.wav"
        p.write_bytes(_pcm16_wav(rate, n=131_072))  # 256 KiB of samples
        with pytest.raises(UnsupportedSampleRateError, match=f"{rate} Hz is outside"):
            load_audio_parallel(str(p), workers=2)


def test_the_first_fmt_chunk_counts_as_in_ffmpeg():
    """Two fmt chunks: FFmpeg reads the first, so does our reader (a second fmt of 0 Hz was refused,
    one of 48 kHz made load_audio read 48 kHz where probe said 16 kHz)."""
    x = (np.sin(np.arange(16000) / 7) * 9000).astype("<i2")
    for second in (0, 48000):
        blob = _chunks_wav([(b"fmt ", _fmt(16000)), (b"fmt ", _fmt(second)), (b"data", x.tobytes())])
        a = load_audio(blob, target_rate=None)
        assert a.sample_rate == 16000 and a.samples.size == 16000
        assert probe(blob)["sample_rate"] == 16000


def _au(rate: int) -> bytes:
    """A Sun/NeXT AU file: 16-bit big-endian PCM, mono, 800 samples, claiming ``rate`` Hz."""
    return b".snd" + struct.pack(">IIIII", 24, 1600, 3, rate & 0xFFFFFFFF, 1) + bytes(1600)


def _aiff(rate: float) -> bytes:
    """An AIFF file, 16-bit mono, 800 samples, its COMM rate ``rate`` as an 80-bit float."""
    if rate == 0:
        ext = bytes(10)
    else:
        m, e = math.frexp(rate)  # rate = m * 2**e, 0.5 <= m < 1
        ext = struct.pack(">HQ", e - 1 + 16383, int(m * 2**64))
    comm = struct.pack(">hIh", 1, 800, 16) + ext
    ssnd = struct.pack(">II", 0, 0) + bytes(1600)
    body = b"AIFF" + b"COMM" + struct.pack(">I", len(comm)) + comm + b"SSND" + struct.pack(">I", len(ssnd)) + ssnd
    return b"FORM" + struct.pack(">I", len(body)) + body


def _rifx(rate: int) -> bytes:
    fmt = struct.pack(">HHIIHH", 1, 1, rate, (rate * 2) & 0xFFFFFFFF, 2, 16)
    body = b"WAVE" + b"fmt " + struct.pack(">I", 16) + fmt + b"data" + struct.pack(">I", 1600) + bytes(1600)
    return b"RIFX" + struct.pack(">I", len(body)) + body


@pytest.mark.parametrize("kind", ["BW64", "RIFX", "AU", "AIFF"])
def test_other_wav_family_headers_rates_out_of_range_are_named(kind):
    """A second trial: BW64, RIFX, AU and AIFF headers claiming 0 Hz or 2^31 Hz and more were FFmpeg's
    unsupported_format; now named like WAV's. Their rates in range still decode."""
    make = {"BW64": lambda r: _chunks_wav([(b"ds64", bytes(28)), (b"fmt ", _fmt(r)),
                                           (b"data", bytes(1600))], b"BW64"),
            "RIFX": _rifx, "AU": _au, "AIFF": _aiff}[kind]
    for rate in (0, 2**31, 2**32 - 1, 999, 800_000):
        with pytest.raises(UnsupportedSampleRateError, match=f"{rate} Hz is outside"):
            load_audio(make(rate))
    if kind in ("AU", "AIFF"):  # FFmpeg reads these: the range's ends still decode
        for rate in (8000, 16000):
            assert load_audio(make(rate), target_rate=None).sample_rate == rate


def test_the_declared_duration_uses_the_first_fmt_chunk():
    """A second trial: with fmt(48 kHz) then fmt(16 kHz), probe() took the last fmt's byte rate (10 s
    declared for 3.3 s decoded: a false damaged_input warning)."""
    data = np.zeros(160_000, "<i2").tobytes()  # 3.33 s at 48 kHz
    blob = _chunks_wav([(b"fmt ", _fmt(48000)), (b"fmt ", _fmt(16000)), (b"data", data)])
    a = load_audio(blob, target_rate=None)
    assert a.sample_rate == 48000 and a.samples.size == 160_000
    assert probe(blob)["duration"] == pytest.approx(160_000 / 48000, abs=0.01)
    assert not [w for w in a.warnings if w.get("code") == "damaged_input"]
