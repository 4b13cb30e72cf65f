"""Ogg/Opus through libopus at the output rate (``flashasr.audio.opus``) against FFmpeg's decoder
at 48 kHz + soxr (``FLASHASR_OPUS_DECODER=ffmpeg``): equal lengths (pre-skip, end trim, chained
links), the same level (the header's output gain), the same metadata and damage reports, and
FFmpeg still decoding what libopus does not take here (multichannel mapping families, WebM)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import AUDIO
from flashasr.audio import encode_audio, iter_audio, load_audio
from flashasr.audio import opus
from flashasr.audio.decode import _ContainerSource

pytestmark = pytest.mark.skipif(opus.libopus() is None, reason="no libopus to load")


def _ffmpeg(monkeypatch, source, **kw):
    monkeypatch.setenv("FLASHASR_OPUS_DECODER", "ffmpeg")
    try:
        return load_audio(source, **kw)
    finally:
        monkeypatch.delenv("FLASHASR_OPUS_DECODER")


def _speech(rate: int, seconds: float) -> np.ndarray:
    x = load_audio(AUDIO / "en" / "en-fleurs-000.ogg", target_rate=rate).samples
    return np.tile(x, int(np.ceil(seconds * rate / x.size)))[: int(seconds * rate)]


def _snr_db(ref: np.ndarray, got: np.ndarray) -> float:
    ref, got = ref.astype(np.float64), got.astype(np.float64)
    return float(10 * np.log10(np.sum(ref ** 2) / max(np.sum((ref - got) ** 2), 1e-30)))


# ---------------------------------------------------------------- Ogg pages (CRC-32, poly 0x04C11DB7)

_CRC = []
for _i in range(256):
    _r = _i << 24
    for _ in range(8):
        _r = ((_r << 1) ^ 0x04C11DB7) if _r & 0x80000000 else _r << 1
    _CRC.append(_r & 0xFFFFFFFF)


def _pages(data: bytes) -> list[tuple[int, int, int]]:
    """(page start, body start, page end) of every Ogg page."""
    out, pos = [], 0
    while pos < len(data):
        assert data[pos:pos + 4] == b"OggS"
        nseg = data[pos + 26]
        body = pos + 27 + nseg
        end = body + sum(data[pos + 27:body])
        out.append((pos, body, end))
        pos = end
    return out


def _recrc(data: bytearray, page: tuple[int, int, int]) -> None:
    start, _, end = page
    data[start + 22:start + 26] = b"\0\0\0\0"
    c = 0
    for b in data[start:end]:
        c = ((c << 8) & 0xFFFFFFFF) ^ _CRC[((c >> 24) & 0xFF) ^ b]
    data[start + 22:start + 26] = c.to_bytes(4, "little")


# ----------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("rate,channels", [(48000, 1), (16000, 1), (8000, 1), (48000, 2), (24000, 2)])
def test_libopus_matches_ffmpeg(monkeypatch, rate, channels):
    x = _speech(rate, 6.3)
    if channels == 2:
        x = np.stack([x, 0.5 * np.roll(x, rate // 3)], 1)
    data = encode_audio(x, rate, format="ogg", codec="libopus", bit_rate=12000 if rate == 8000 else 24000)
    src = _ContainerSource(data, "x", 16000)
    assert src.opus is not None  # SILK / hybrid packets: libopus
    src.close()
    got, ref = load_audio(data), _ffmpeg(monkeypatch, data)
    assert len(got) == len(ref)  # pre-skip and end trim as FFmpeg's
    assert (got.source_sample_rate, got.source_channels, got.source_format, got.declared_duration, got.warnings) == \
           (ref.source_sample_rate, ref.source_channels, ref.source_format, ref.declared_duration, ref.warnings)
    assert got.source_sample_rate == 48000 and got.resample_cpu_s == 0.0  # decoded at 16 kHz: no soxr
    # two conformant decoders: same signal, aligned (narrowband SILK within 2 samples)
    lag = int(np.argmax([np.dot(ref.samples[4000:36000], got.samples[4000 + k:36000 + k]) for k in range(-4, 5)])) - 4
    assert abs(lag) <= 2
    a, b = ref.samples[max(0, -lag):len(ref) - max(0, lag)], got.samples[max(0, lag):len(got) - max(0, -lag)]
    assert _snr_db(a, b) > 20


def test_decode_rate_follows_the_target(monkeypatch):
    data = encode_audio(_speech(48000, 3.0), 48000, format="ogg", codec="libopus", bit_rate=24000)
    for target in (8000, 12000, 16000, 24000, 48000):
        d = load_audio(data, target_rate=target)
        assert d.sample_rate == target and d.resample_cpu_s == 0.0
        assert len(d) == len(_ffmpeg(monkeypatch, data, target_rate=target))
    d = load_audio(data, target_rate=44100)  # not a libopus rate: 48 kHz, then soxr
    assert d.sample_rate == 44100 and d.resample_cpu_s > 0 and len(d) == len(_ffmpeg(monkeypatch, data, target_rate=44100))
    assert load_audio(data, target_rate=None).sample_rate == 48000


def test_blocks_iter_audio_and_frames_agree():
    """The block path (packets decoded into ~0.5 s blocks), iter_audio and the frame path (what the
    parallel ranges read) give the same samples."""
    data = encode_audio(_speech(48000, 7.0), 48000, format="ogg", codec="libopus", bit_rate=24000)
    whole = load_audio(data).samples
    assert np.array_equal(np.concatenate(list(iter_audio(data, block_seconds=1.3))), whole)
    src = _ContainerSource(data, "x", 16000)
    assert src.opus is not None
    import av

    frames = [np.frombuffer(bytes(f.planes[0]), np.float32) for f in src._frames(av)]
    src.close()
    assert np.array_equal(np.concatenate(frames), whole)


def test_celt_only_streams_stay_with_ffmpeg(monkeypatch):
    """Mostly CELT-only packets (music-grade bit rates): FFmpeg's decoder is the cheaper one
    (flashasr.audio.opus's docstring), so it decodes them unless libopus is asked for; both give FFmpeg's length."""
    data = encode_audio(_speech(48000, 3.0), 48000, format="ogg", codec="libopus", bit_rate=64000)
    silk, celt = opus.first_packet_modes(data[:4096])
    assert celt > 0 and silk == 0
    src = _ContainerSource(data, "x", 16000)
    assert src.opus is None
    src.close()
    src = _ContainerSource(data, "x", 16000, libopus=True)
    assert src.opus is not None
    src.close()
    assert len(load_audio(data)) == len(_ffmpeg(monkeypatch, data))
    assert opus.first_packet_modes(b"RIFF" + bytes(60)) == (0, 0)
    assert opus.first_packet_modes(data[:200]) == (0, 0)  # no audio packet in so few bytes


def test_chained_links_trim_each_pre_skip(monkeypatch):
    a = encode_audio(_speech(16000, 2.02), 16000, format="ogg", codec="libopus", bit_rate=16000)
    b = encode_audio(_speech(48000, 3.37), 48000, format="ogg", codec="libopus", bit_rate=24000)
    assert _ContainerSource(a + b, "x", 16000).opus is not None
    got, ref = load_audio(a + b), _ffmpeg(monkeypatch, a + b)
    assert len(got) == len(ref) == len(load_audio(a)) + len(load_audio(b))


def test_output_gain_is_applied(monkeypatch):
    plain = encode_audio(_speech(48000, 3.0), 48000, format="ogg", codec="libopus", bit_rate=24000)
    data = bytearray(plain)
    page = _pages(bytes(data))[0]
    head = page[1]
    assert data[head:head + 8] == b"OpusHead"
    data[head + 16:head + 18] = (-6 * 256).to_bytes(2, "little", signed=True)  # -6 dB, Q7.8
    _recrc(data, page)
    rms = lambda y: float(np.sqrt(np.mean(np.asarray(y[4000:-4000], np.float64) ** 2)))  # noqa: E731
    assert _ContainerSource(bytes(data), "x", 16000).opus is not None
    got, ref = load_audio(bytes(data)), _ffmpeg(monkeypatch, bytes(data))
    assert rms(got.samples) == pytest.approx(rms(ref.samples), rel=0.01)
    assert rms(got.samples) == pytest.approx(10 ** (-6 / 20) * rms(load_audio(plain).samples), rel=0.01)


def test_a_refused_packet_is_skipped_and_reported(monkeypatch):
    """A packet whose code-3 frame count is 0 (invalid, RFC 6716 s. 3.2.5) in the middle of the
    stream: both decoders skip it and say so; the rest decodes."""
    data = bytearray(encode_audio(_speech(48000, 4.0), 48000, format="ogg", codec="libopus", bit_rate=24000))
    page = _pages(bytes(data))[3]  # an audio page (0: OpusHead, 1: OpusTags)
    first = page[1]
    data[first] = (data[first] & 0xFC) | 3
    data[first + 1] = 0
    _recrc(data, page)
    got, ref = load_audio(bytes(data)), _ffmpeg(monkeypatch, bytes(data))
    assert got.warnings == ref.warnings and "skipped 1 undecodable packets" in got.warnings[0]
    assert abs(len(got) - len(ref)) <= 320 and got.duration > 3.5
    with pytest.raises(opus.OpusPacketError):
        opus.OpusDecoder(16000, 1).decode(bytes([3, 0]))


def test_truncated_and_damaged_files_report_as_ffmpeg(monkeypatch):
    data = encode_audio(_speech(48000, 8.0), 48000, format="ogg", codec="libopus", bit_rate=24000)
    assert _ContainerSource(data, "x", 16000).opus is not None
    cut = data[: len(data) * 2 // 3]
    got, ref = load_audio(cut), _ffmpeg(monkeypatch, cut)
    assert len(got) == len(ref) and got.warnings == ref.warnings  # Ogg declares no total length: no warning
    bad = bytearray(data)
    bad[len(bad) // 2:len(bad) // 2 + 400] = bytes(400)  # a page's CRC fails: the demuxer drops it
    got, ref = load_audio(bytes(bad)), _ffmpeg(monkeypatch, bytes(bad))
    assert abs(got.duration - ref.duration) < 0.03 and got.duration > 6.5


def test_ffmpeg_decodes_what_libopus_does_not_take_here():
    surround = encode_audio(np.stack([_speech(48000, 2.0)] * 6, 1), 48000, format="ogg", codec="libopus",
                            layout="5.1")  # channel mapping family 1
    src = _ContainerSource(surround, "x", 16000)
    assert src.opus is None
    src.close()
    d = load_audio(surround)
    assert d.source_channels == 6 and d.duration == pytest.approx(2.0, abs=0.03)
    webm = encode_audio(_speech(48000, 2.0), 48000, format="webm", codec="libopus")
    src = _ContainerSource(webm, "x", 16000)
    assert src.opus is None
    src.close()


def test_switch_and_header_rules(monkeypatch):
    data = encode_audio(_speech(48000, 1.0), 48000, format="ogg", codec="libopus")
    monkeypatch.setenv("FLASHASR_OPUS_DECODER", "ffmpeg")
    assert not opus.enabled()
    src = _ContainerSource(data, "x", 16000)
    assert src.opus is None
    src.close()
    src = _ContainerSource(data, "x", 16000, libopus=True)  # forced (the parallel ranges)
    assert src.opus is not None and src.opus.rate == 16000
    src.close()
    monkeypatch.delenv("FLASHASR_OPUS_DECODER")
    assert opus.enabled() and opus.version().startswith("libopus")
    head = b"OpusHead" + bytes([1, 2]) + (312).to_bytes(2, "little") + (48000).to_bytes(4, "little") + \
        (-256).to_bytes(2, "little", signed=True) + bytes([0])
    assert opus.parse_head(head) == (2, 312, -256)
    assert opus.parse_head(head[:18] + bytes([1])) is None  # mapping family 1
    assert opus.parse_head(b"OpusHead" + bytes([0x10]) + head[9:]) is None  # version 1.x
    assert opus.parse_head(b"OpusTags" + head[8:]) is None
    assert opus.decode_rate(16000) == 16000 and opus.decode_rate(44100) == 48000 and opus.decode_rate(None) == 48000
