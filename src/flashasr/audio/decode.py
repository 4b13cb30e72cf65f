"""Decode any audio input to 16 kHz mono float32: containers via PyAV (in-process FFmpeg),
raw PCM and numpy arrays; resampling with soxr (HQ); energy-keeping downmix.

Pipeline (one pass, streaming, bounded memory)::

    source -> native blocks float32 [C, n] (one decoded frame, or 0.1 s of array/raw PCM)
           -> Downmixer (energy-keeping, see downmix.py) -> [n]
           -> soxr.ResampleStream (HQ, float32) -> target-rate block
           -> sink: one growing float32 buffer (load_audio) or fixed-size blocks (iter_audio)

Nothing holds the whole native-rate PCM: only one decoded frame plus the resampler state
lives at a time, so ``load_audio`` peaks at about the size of its 16 kHz output
(4 bytes x 16000 x seconds; 2.3 GB for 10 hours, preallocated from the declared duration
and grown by 1.5x when the declaration was short) and ``iter_audio`` at one block.
PyAV's decode and soxr's resample release the GIL, so a thread pool scales over cores.
"""

from __future__ import annotations

import io
import math
import numbers
import operator
import os
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from ..errors import ABSURD_SAMPLE  # beyond it a decoded sample is damage, not audio: clipped to +-1
from .downmix import Downmixer
from .errors import (
    AudioArgumentError,
    AudioError,
    AudioFileNotFoundError,
    AudioTooLongError,
    CorruptAudioError,
    EmptyAudioError,
    NoAudioStreamError,
    UnsupportedFormatError,
    UnsupportedSampleRateError,
)

#: Raw PCM formats accepted by ``raw_format``: numpy dtype.
RAW_FORMATS = {
    "s16le": "<i2",
    "s16be": ">i2",
    "s32le": "<i4",
    "f32le": "<f4",
    "f64le": "<f8",
    "u8": "u1",
}

_MAX_CHANNELS = 64
_MAX_DEMUX_ERRORS = 200
_ARRAY_BLOCK_S = 0.1


#: (lowest, highest) input sample rate in Hz accepted from any source (containers, WAV headers, raw
#: PCM, arrays): 1 kHz is below any speech recording (telephony is 8 kHz), 768 kHz is the highest PCM
#: rate in use. Outside it a header is damaged or hostile (UnsupportedSampleRateError).
SOURCE_RATES = (1_000, 768_000)


@dataclass
class DecodedAudio:
    """Decoded, resampled mono audio.

    Attributes:
        samples: float32 np.ndarray of shape [N], nominally in [-1, 1], at ``sample_rate``.
        sample_rate: Hz of ``samples`` (== the requested ``target_rate``, 16000 by default).
        duration: seconds, ``N / sample_rate`` (what was actually decoded, not what the
            container header claims).
        source_sample_rate: Hz of the input (the first decoded frame's rate for containers).
        source_channels: channel count of the input.
        source_format: ``container/codec`` (``"wav/pcm_s16le"``, ``"ogg/opus"``, ``"m4a/aac"``;
            just ``"flac"``/``"mp3"`` when both are the same), ``"raw/s16le"`` for raw PCM,
            ``"numpy/int16"`` for arrays.
        warnings: human-readable notes on what was tolerated, e.g.
            ``"skipped 3 undecodable packets"``.
        declared_duration: seconds the container's header declares (None: unknown, or not
            recorded by the decode that made this object).
        resample_cpu_s: CPU seconds spent in soxr (part of the decode's CPU time; the job
            report's ``resample`` stage).
        other_threads_cpu_s: CPU seconds of the decode spent in threads other than the caller's
            (:func:`flashasr.audio.load_audio_parallel`'s ranges; 0 for a sequential decode).
        segment: the name of a POSIX shared-memory segment whose first bytes are ``samples``
            (:func:`flashasr.audio.load_audio_parallel` with ``keep_segment=True``; the caller
            unlinks it), else None.
    """

    samples: np.ndarray
    sample_rate: int
    duration: float
    source_sample_rate: int
    source_channels: int
    source_format: str
    warnings: list[str] = field(default_factory=list)
    declared_duration: float | None = None
    resample_cpu_s: float = 0.0
    other_threads_cpu_s: float = 0.0
    segment: str | None = None

    def __len__(self) -> int:
        return int(self.samples.shape[0])

    def damage(self, source: Any = None) -> list[dict]:
        """What the decode tolerated, as :attr:`flashasr.types.Transcript.warnings` entries: none for
        a clean decode, else one ``damaged_input`` warning (all of :attr:`warnings`, the decoded
        and the declared duration in seconds; the declared one read from ``source``'s header when
        this object does not hold it)."""
        if not self.warnings:
            return []
        declared = self.declared_duration
        if declared is None and source is not None:
            declared = declared_duration(source)
        return [damage_warning("; ".join(self.warnings), self.duration, declared)]


def truncation(decoded_s: float, declared_s: float | None) -> str | None:
    """The one rule for a truncated input: the decode gave less than 98 % and over 0.25 s less than
    the header declares. Returns the warning text, or None."""
    if declared_s and decoded_s < 0.98 * declared_s and declared_s - decoded_s > 0.25:
        return f"decoded {decoded_s:.2f} s but the header declares {declared_s:.2f} s (truncated or damaged input?)"
    return None


def damage_warning(what: str, decoded_s: float, declared_s: float | None) -> dict:
    """A ``damaged_input`` entry of :attr:`flashasr.types.Transcript.warnings`."""
    from ..types import warning

    return warning("damaged_input", f"{what}; the transcript covers what decodes", decoded_s=round(decoded_s, 3),
                   declared_s=None if declared_s is None else round(float(declared_s), 3))


def declared_duration(source: Any) -> float | None:
    """What ``source``'s header declares (seconds), or None (unknown, unreadable, not a path)."""
    if not isinstance(source, (str, os.PathLike)):
        return None
    try:
        return probe(source)["duration"]
    except Exception:  # noqa: BLE001 - only a figure for a warning
        return None


# --------------------------------------------------------------------------- helpers


def _label(source: Any) -> str:
    if isinstance(source, (str, os.PathLike)):
        return repr(os.fspath(source))
    if isinstance(source, (bytes, bytearray, memoryview)):
        return f"<{len(memoryview(source).cast('B'))} bytes input>"
    name = getattr(source, "name", None)
    if isinstance(name, str):
        return repr(name)
    return f"<{type(source).__name__} input>"


def _is_array(source: Any) -> bool:
    if isinstance(source, np.ndarray):
        return True
    if isinstance(source, (str, os.PathLike, bytes, bytearray, memoryview)):
        return False
    if hasattr(source, "read"):
        return False
    return hasattr(source, "__array__") or hasattr(source, "detach")


def _int_scale(dtype: np.dtype) -> tuple[float, float]:
    """(offset, scale) mapping integer PCM to float32 in [-1, 1)."""
    if dtype.kind == "u":
        half = float(2 ** (8 * dtype.itemsize - 1))
        return -half, 1.0 / half
    return 0.0, 1.0 / float(2 ** (8 * dtype.itemsize - 1))


def _narrow(a: np.ndarray) -> np.ndarray:
    """Float samples wider than float32 with their magnitudes capped at twice ABSURD_SAMPLE (NaN
    kept): a finite float64 sample beyond float32's range became inf in the cast, with numpy's
    overflow warning, and was then reported as non-finite instead of clipped (a new user's trial)."""
    if a.dtype.kind == "f" and a.dtype.itemsize > 4:
        return np.clip(a, -2 * ABSURD_SAMPLE, 2 * ABSURD_SAMPLE)
    return a


def _to_float32(a: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Integer PCM -> float32 scaled to [-1, 1); float input is cast (no rescaling; wider floats
    capped first: :func:`_narrow`)."""
    if a.dtype.kind == "f":
        a = _narrow(a)
        if out is None:
            return a.astype(np.float32, copy=a.dtype != np.float32)
        out[...] = a
        return out
    if a.dtype.kind not in "iu":
        raise AudioArgumentError(f"unsupported sample dtype {a.dtype} (use an int or float dtype)")
    off, scale = _int_scale(a.dtype)
    if out is None:
        out = np.empty(a.shape, np.float32)
    if off:
        np.add(a, off, out=out, casting="unsafe")
        out *= scale
    else:
        np.multiply(a, scale, out=out, casting="unsafe")
    return out


class _Sink:
    """Collects target-rate mono output into one growing float32 buffer."""

    def __init__(self, capacity: int):
        self.buf = np.empty(max(int(capacity), 1024), np.float32)
        self.n = 0

    def add(self, x: np.ndarray) -> None:
        m = x.shape[0]
        if m == 0:
            return
        need = self.n + m
        if need > self.buf.shape[0]:
            self.buf.resize(max(need, int(self.buf.shape[0] * 1.5)), refcheck=False)
        self.buf[self.n:need] = x
        self.n = need

    def result(self) -> np.ndarray:
        self.buf.resize(self.n, refcheck=False)
        return self.buf


class _Pipeline:
    """max_duration check -> non-finite check -> downmix -> soxr stream resample."""

    def __init__(self, target_rate: int | None, max_duration: float | None, label: str,
                 check_finite: bool = False):
        self.target_rate = target_rate
        self.max_duration = max_duration
        self.label = label
        self.check_finite = check_finite
        self.downmix = Downmixer()
        self.in_rate: int | None = None
        self.first_rate: int | None = None
        self.first_channels: int | None = None
        self.rate_changes = 0
        self.nonfinite = 0
        self.clipped = 0  # finite samples beyond ABSURD_SAMPLE, clipped to full scale
        self.overshoot = 0  # resampled samples beyond ABSURD_SAMPLE (ringing), saturated at it
        self.in_seconds = 0.0
        self.resample_cpu_s = 0.0  # thread CPU seconds inside soxr
        self._rs = None

    def _resampler(self, rate: int):
        import soxr

        self.in_rate = rate
        if self.target_rate is None:
            self.target_rate = rate
        self._rs = None if rate == self.target_rate else soxr.ResampleStream(
            rate, self.target_rate, 1, dtype="float32", quality="HQ")

    def push(self, x: np.ndarray, rate: int) -> list[np.ndarray]:
        """x: float32 [C, n]; returns target-rate mono pieces (possibly empty)."""
        out: list[np.ndarray] = []
        if self.first_rate is None:
            self.first_rate = rate
            self.first_channels = x.shape[0] if x.ndim == 2 else 1
        if rate != self.in_rate:
            _check_rate(rate, self.label)  # a rate change mid-stream too
            if self.in_rate is not None:
                self.rate_changes += 1
                out.extend(self.flush())
            self._resampler(rate)
        n = x.shape[-1]
        self.in_seconds += n / rate
        if self.max_duration is not None and self.in_seconds > self.max_duration:
            raise AudioTooLongError(
                f"{self.label}: audio is longer than the limit of {self.max_duration:g} s "
                f"(decoding passed {self.in_seconds:.1f} s)")
        if self.check_finite:  # before the downmix, whose running energies NaN would poison
            rows = x if x.ndim == 2 else x[None]
            for row in rows:
                with np.errstate(over="ignore"):  # an overflow is what the test looks for
                    energy = np.dot(row, row)  # one BLAS pass per channel
                if not energy <= ABSURD_SAMPLE ** 2:  # NaN, Inf, or a sample beyond ABSURD_SAMPLE (real audio's
                    # sum of squares stays far below: a block of a million full-scale samples is 1e6)
                    bad = ~np.isfinite(row)
                    self.nonfinite += int(bad.sum())
                    row[bad] = 0.0  # x is always a buffer of ours (never the caller's array)
                    # absurd finite magnitudes (a float file scaled by 1e30: its features overflowed in
                    # the models, Whisper's sampling met inf probabilities, a 500; 1e6 wrecked the text)
                    # are clipped to full scale
                    huge = np.abs(row) > ABSURD_SAMPLE
                    if huge.any():
                        self.clipped += int(huge.sum())
                        row[huge] = np.sign(row[huge])
        mono = self.downmix(x, rate)
        if self._rs is None:
            out.append(mono)
        else:
            c0 = time.thread_time()
            y = self._rs.resample_chunk(mono, last=False)
            self.resample_cpu_s += time.thread_time() - c0
            if y.shape[0]:
                out.append(self._limit(y))
        return out

    def _limit(self, y: np.ndarray) -> np.ndarray:
        """Resampled float samples held within +-ABSURD_SAMPLE: the resampler's ringing can lift a
        loud source that passed the check (a float file hard-limited at +-9,500 at 44.1 kHz reached
        11,072 at 16 kHz, and the models then refused the decoded file: found by a new user's trial).
        Those samples are saturated at the limit and counted (a warning)."""
        if not self.check_finite:
            return y
        with np.errstate(over="ignore"):
            if np.dot(y, y) <= ABSURD_SAMPLE ** 2:
                return y
        over = np.abs(y) > ABSURD_SAMPLE
        n = int(over.sum())
        if n:
            self.overshoot += n
            np.clip(y, -ABSURD_SAMPLE, ABSURD_SAMPLE, out=y)
        return y

    def flush(self) -> list[np.ndarray]:
        if self._rs is None:
            return []
        c0 = time.thread_time()
        y = self._rs.resample_chunk(np.zeros(0, np.float32), last=True)
        self.resample_cpu_s += time.thread_time() - c0
        self._rs = None
        self.in_rate = None
        return [self._limit(y)] if y.shape[0] else []

    def warnings(self) -> list[str]:
        w = []
        if self.downmix.fallback_samples and self.first_rate:
            w.append(
                "channels cancel when averaged (phase-inverted?); used the strongest channel "
                f"for {self.downmix.fallback_samples / self.first_rate:.2f} s of "
                f"{self.downmix.total_samples / self.first_rate:.2f} s")
        if self.rate_changes:
            w.append(f"sample rate changed {self.rate_changes} time(s) mid-stream")
        if self.nonfinite:
            w.append(f"replaced {self.nonfinite} non-finite (NaN/Inf) samples with 0")
        if self.clipped:
            w.append(f"clipped {self.clipped} samples beyond +-{ABSURD_SAMPLE:g} to full scale (+-1)")
        if self.overshoot:
            w.append(f"limited {self.overshoot} resampled samples to +-{ABSURD_SAMPLE:g} (the resampler's "
                     f"ringing on a source near that level)")
        return w


# --------------------------------------------------------------------------- containers


_PCM_DTYPES = {"u8": np.uint8, "s16": np.int16, "s32": np.int32, "s64": np.int64,
               "flt": np.float32, "dbl": np.float64}


_FMT_CACHE: dict[str, tuple[np.dtype, bool, float, float]] = {}


def _fmt(name: str) -> tuple[np.dtype, bool, float, float]:
    """sample format name -> (dtype, planar, offset, scale) for int->float conversion."""
    got = _FMT_CACHE.get(name)
    if got is None:
        planar = name.endswith("p") and name[:-1] in _PCM_DTYPES
        dtype = np.dtype(_PCM_DTYPES[name[:-1] if planar else name])  # KeyError: unknown format
        off, scale = _int_scale(dtype) if dtype.kind in "iu" else (0.0, 1.0)
        got = _FMT_CACHE[name] = (dtype, planar, off, scale)
    return got


def _frame_info(frame) -> tuple[np.dtype, bool, int, int]:
    dtype, planar, _, _ = _fmt(frame.format.name)
    return dtype, planar, frame.layout.nb_channels, frame.samples


_LFE = {"LFE", "LFE2", "LFE3"}
_KEEP_CACHE: dict[str, list[int] | None] = {}


def _kept_channels(frame, c: int) -> list[int] | None:
    """Channel indices that enter the downmix: all but LFE (low-frequency effects, no speech;
    FFmpeg's own downmix also leaves it out by default) for layouts of more than 2 channels.
    None means all channels."""
    if c <= 2:
        return None
    key = frame.layout.name
    if key not in _KEEP_CACHE:
        names = [ch.name for ch in frame.layout.channels]
        keep = [i for i, nm in enumerate(names) if nm not in _LFE]
        _KEEP_CACHE[key] = keep if 0 < len(keep) < c else None
    return _KEEP_CACHE[key]


def _frame_into(frame, out: np.ndarray, c: int, n: int, keep: list[int] | None = None) -> None:
    """Write an ``av.AudioFrame`` (c channels, n samples) as float32 into ``out``
    [len(keep) or c, n] (integer PCM scaled to [-1, 1)); ``keep`` selects channels.

    Reads the planes directly: PyAV 18's ``to_ndarray`` crashes on 8-channel planar
    frames (it builds one plane too many), so only the first C planes are touched.
    """
    dtype, planar, off, scale = _fmt(frame.format.name)
    planes = frame.planes
    if planar:
        if len(planes) < c:
            raise UnsupportedFormatError(f"planar audio with {c} channels is not supported")
        srcs = [np.frombuffer(planes[i], dtype, count=n) for i in (keep if keep is not None else range(c))]
    else:
        a = np.frombuffer(planes[0], dtype, count=n * c)
        if c == 1:
            srcs, out = [a], out[0]
        else:
            a = a.reshape(n, c)
            srcs = [(a if keep is None else a[:, keep]).T]
    for i, src in enumerate(srcs):
        dst = out[i] if planar else out
        if off:
            np.add(src, off, out=dst, casting="unsafe")
            dst *= scale
        elif scale != 1.0:
            np.multiply(src, scale, out=dst, casting="unsafe")
        else:
            dst[...] = src


def _joined(views: list[list], n: int) -> np.ndarray:
    """Per channel, views of float32 frame planes -> one writable float32 [C, n] block."""
    if len(views) == 1:
        return np.frombuffer(bytearray().join(views[0]), np.float32, count=n).reshape(1, n)
    out = np.empty((len(views), n), np.float32)
    for ch, v in enumerate(views):
        out[ch] = np.frombuffer(b"".join(v), np.float32, count=n)
    return out


def _codec_name(stream) -> str:
    name = stream.codec_context.name or "unknown"
    for suffix in ("float", "_fixed", "_float"):
        if name.endswith(suffix) and len(name) > len(suffix):
            name = name[: -len(suffix)]
    return name


def _format_name(container, stream) -> str:
    names = container.format.name.split(",")
    cname = names[0]
    if cname == "mov":
        cname = "m4a" if not container.streams.video else "mp4"
    elif cname == "matroska" and "webm" in names:
        codecs = {s.codec_context.name for s in container.streams if s.codec_context is not None}
        if codecs <= {"opus", "libopus", "vorbis", "libvorbis", "vp8", "vp9", "av1", "libdav1d"}:
            cname = "webm"
    codec = _codec_name(stream)
    return cname if codec == cname else f"{cname}/{codec}"


#: Demuxer options for a RIFF/WAVE input: the header gives the codec, rate, channels and length,
#: so FFmpeg's stream probe (``avformat_find_stream_info``, which by default reads up to 5 s of
#: 1,024-sample packets) learns nothing more. Measured on the 63 shared WAVs (2-core VM): open
#: 4.18 ms -> 0.23 ms mean, 19.8 ms -> 0.5 ms worst; a 10 s 16 kHz WAV's ``load_audio`` ~4.5 ms,
#: so the probe was most of it.
_WAV_PROBE = {"probesize": "32", "analyzeduration": "0"}


def _is_wave(head: bytes) -> bool:
    return len(head) >= 12 and head[:4] in (b"RIFF", b"RF64") and head[8:12] == b"WAVE"


def _open_container(source: Any, label: str, *, wave: bool = False):
    """Open with PyAV; maps every failure to an AudioError subclass naming the input.
    ``wave``: the input's first bytes are a RIFF/WAVE header (:data:`_WAV_PROBE` applies)."""
    import av

    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.exists(path):
            raise AudioFileNotFoundError(f"{label}: no such file")
        if os.path.isdir(path):
            raise AudioArgumentError(f"{label}: is a directory, not an audio file")
        if not os.access(path, os.R_OK):
            raise AudioError(f"{label}: permission denied", code="permission_denied")
        if os.path.getsize(path) == 0:
            raise EmptyAudioError(f"{label}: file is empty (0 bytes)")
        target = path
        # only local files (no http/tcp/... from playlists or concat lists inside the file)
        opts = {"protocol_whitelist": "file"}
    elif isinstance(source, (bytes, bytearray, memoryview)):
        if len(memoryview(source).cast("B")) == 0:
            raise EmptyAudioError(f"{label}: input is empty (0 bytes)")
        target = io.BytesIO(source)
        opts = {"protocol_whitelist": "none"}  # untrusted bytes may not open anything else
    elif hasattr(source, "read"):
        target = source
        opts = {"protocol_whitelist": "none"}
        try:
            if source.seekable():
                pos = source.tell()
                end = source.seek(0, io.SEEK_END)
                source.seek(pos)
                if end - pos <= 0:
                    raise EmptyAudioError(f"{label}: input is empty (0 bytes)")
        except (AttributeError, OSError, ValueError):
            pass
    else:
        raise AudioArgumentError(
            f"unsupported audio source type {type(source).__name__}: pass a path, bytes, a binary "
            "file object or a numpy array")
    if wave:
        opts = {**opts, **_WAV_PROBE}
    try:
        container = av.open(target, mode="r", metadata_errors="ignore", container_options=opts)
    except av.error.FileNotFoundError as e:
        raise AudioFileNotFoundError(f"{label}: no such file") from e
    except (av.error.PermissionError, av.error.ArgumentError) as e:
        # e.g. an ffconcat list / playlist that refers to other files or URLs
        raise UnsupportedFormatError(
            f"{label}: refused: refers to other files or URLs, or is not an audio file ({_why(e)})") from e
    except av.error.EOFError as e:
        raise EmptyAudioError(f"{label}: no data (end of file while reading the header)") from e
    except av.error.FFmpegError as e:
        raise UnsupportedFormatError(
            f"{label}: not a readable audio file ({_why(e)})") from e
    except (OSError, ValueError) as e:
        raise UnsupportedFormatError(f"{label}: could not be opened ({e})") from e
    try:
        streams = container.streams.audio
        if not streams:
            kinds = sorted({f"{s.type}:{s.codec_context.name if s.codec_context else '?'}"
                            for s in container.streams})
            found = ", ".join(kinds) if kinds else "no streams at all"
            raise NoAudioStreamError(
                f"{label}: contains no audio stream (container {container.format.name}; found {found})")
        try:
            stream = container.streams.best("audio") or streams[0]
        except Exception:
            stream = streams[0]
        if stream.codec_context is None:
            raise UnsupportedFormatError(f"{label}: no decoder for its audio codec")
    except BaseException:
        container.close()
        raise
    return container, stream


def _why(e: Exception) -> str:
    msg = getattr(e, "strerror", None) or str(e)
    return f"FFmpeg: {msg}"


def _declared_duration(container, stream) -> float | None:
    try:
        if stream.duration is not None and stream.time_base is not None and stream.duration > 0:
            return float(stream.duration * stream.time_base)
    except Exception:
        pass
    if container.duration is not None and container.duration > 0:
        return container.duration / 1_000_000.0
    return None


def _head(source: Any, n: int = 1 << 16) -> bytes:
    """The first ``n`` bytes of a path, bytes or seekable file object (left where it was); b"" when
    they cannot be read without side effects."""
    try:
        if isinstance(source, (str, os.PathLike)):
            with open(source, "rb") as f:
                return f.read(n)
        if isinstance(source, (bytes, bytearray, memoryview)):
            return bytes(memoryview(source).cast("B")[:n])
        if hasattr(source, "read") and source.seekable():
            pos = source.tell()
            try:
                source.seek(0)
                return source.read(n) or b""
            finally:
                source.seek(pos)
    except (OSError, ValueError, TypeError, AttributeError):
        pass
    return b""


def _riff_declared(head: bytes) -> float | None:
    """Seconds a RIFF/WAVE header's ``data`` chunk declares (its size over the ``fmt `` byte rate).
    FFmpeg's WAV demuxer clamps the duration to the bytes present, so a truncated WAV looks whole
    to it; this reads what the header says. None: not a WAVE header, or a streaming one whose
    ``data`` size is unset (0 or 0xFFFFFFFF)."""
    if len(head) < 12 or head[:4] != b"RIFF" or head[8:12] != b"WAVE":
        return None
    pos, byte_rate = 12, None
    while pos + 8 <= len(head):
        cid, size = head[pos:pos + 4], int.from_bytes(head[pos + 4:pos + 8], "little")
        if cid == b"fmt " and pos + 20 <= len(head) and byte_rate is None:  # the first one counts (FFmpeg)
            byte_rate = int.from_bytes(head[pos + 16:pos + 20], "little")
        elif cid == b"data":
            if not byte_rate or size in (0, 0xFFFFFFFF) or size >= 0xFFFFFF00:
                return None
            return size / byte_rate
        pos += 8 + size + (size & 1)
    return None


#: ``fmt `` tag and bits per sample -> (numpy dtype of a sample, FFmpeg's codec name) of the PCM WAVs
#: that :class:`_WavSource` reads itself (24-bit and the rest go to FFmpeg).
_WAV_PCM = {(1, 8): ("u1", "pcm_u8"), (1, 16): ("<i2", "pcm_s16le"), (1, 32): ("<i4", "pcm_s32le"),
            (3, 32): ("<f4", "pcm_f32le"), (3, 64): ("<f8", "pcm_f64le")}
_WAV_GUID_TAIL = bytes.fromhex("000000001000800000aa00389b71")  # KSDATAFORMAT_SUBTYPE_* after the tag


class _WavSource:
    """A plain PCM RIFF/WAVE input read with numpy: the ``data`` chunk's bytes as float32 [C, n]
    blocks, no FFmpeg demuxer or decoder (an 11 s 16 kHz WAV: ~1.8 ms -> ~0.1 ms on the dev VM; the
    server's uploads and a job's WAV files are mostly these). The same samples as FFmpeg's
    ``pcm_*`` decoders (the same integer scaling), the same metadata and warnings (the header's
    declared duration, a truncated ``data`` chunk); blocks of :data:`_WAV_BLOCK_S` instead of
    FFmpeg's packets, which changes only where the energy-keeping downmix may switch mode for
    phase-cancelling stereo (:mod:`flashasr.audio.downmix`). Read here: ``fmt `` tags 1 (PCM) and 3
    (IEEE float) and WAVE_FORMAT_EXTENSIBLE with those subformats, 8/16/32-bit integer or
    32/64-bit float, mono or stereo, a ``data`` chunk within the first 4 KiB whose size is set.
    Everything else (24-bit, more channels, RF64, streamed WAVs, other codecs) returns None from
    :meth:`open` and goes to FFmpeg. Follows the RIFF/WAVE layout of Microsoft's multimedia
    registration spec and FFmpeg's ``wavdec.c``."""

    def __init__(self, source, label: str, fmt: tuple[str, str], channels: int, rate: int, offset: int,
                 size: int, byte_rate: int):
        self.source, self.label = source, label
        self.dtype = np.dtype(fmt[0])
        self.format = f"wav/{fmt[1]}"
        self.channels = self.frame_channels = channels
        self.rate = rate
        self.offset, self.size = offset, size
        self.declared = size / byte_rate
        self._close = None

    @classmethod
    def open(cls, source: Any, label: str, head: bytes) -> "_WavSource | None":
        """The reader for ``source`` (a path, bytes or seekable binary file whose first bytes are
        ``head``), or None when FFmpeg must read it."""
        _check_header_rate(head, label)
        if len(head) < 12 or head[:4] != b"RIFF" or head[8:12] != b"WAVE":
            return None
        if not isinstance(source, (str, os.PathLike, bytes, bytearray, memoryview)) and not (
                hasattr(source, "seekable") and source.seekable()):
            return None
        pos, fmt, seen_fmt = 12, None, False
        while pos + 8 <= len(head):
            cid, size = head[pos:pos + 4], int.from_bytes(head[pos + 4:pos + 8], "little")
            body = head[pos + 8:pos + 8 + size]
            if cid == b"fmt " and not seen_fmt:  # the first one counts, as in FFmpeg
                seen_fmt = True
                if len(body) < 16:
                    return None
                tag, ch, rate, byte_rate, align, bits = (int.from_bytes(body[a:b], "little") for a, b in
                                                         ((0, 2), (2, 4), (4, 8), (8, 12), (12, 14), (14, 16)))
                if tag == 0xFFFE:  # WAVE_FORMAT_EXTENSIBLE: the subformat GUID holds the tag
                    if len(body) < 40 or body[26:40] != _WAV_GUID_TAIL or int.from_bytes(body[18:20], "little") != bits:
                        return None
                    tag = int.from_bytes(body[24:26], "little")
                fmt = _WAV_PCM.get((tag, bits))
                if fmt is None or ch not in (1, 2) or align != ch * bits // 8 or byte_rate != rate * align:
                    return None
            elif cid == b"data":
                if fmt is None or size in (0, 0xFFFFFFFF) or size >= 0xFFFFFF00:
                    return None
                return cls(source, label, fmt, ch, rate, pos + 8, size, byte_rate)
            pos += 8 + size + (size & 1)
        return None

    def source_rate(self, decoded_rate: int) -> int:
        return int(decoded_rate)

    def _reader(self):
        src = self.source
        if isinstance(src, (bytes, bytearray, memoryview)):
            mv = memoryview(src).cast("B")[self.offset:self.offset + self.size]
            at = [0]

            def read(k):
                b = mv[at[0]:at[0] + k]
                at[0] += len(b)
                return b
            return read
        f = open(src, "rb") if isinstance(src, (str, os.PathLike)) else src
        if f is not src:
            self._close = f.close
        f.seek(self.offset)
        return f.read

    def blocks(self) -> Iterator[tuple[np.ndarray, int]]:
        """Yields (float32 [C, n], rate): the ``data`` chunk in blocks of :data:`_WAV_BLOCK_S`; a
        truncated chunk ends where its bytes end (a partial sample frame is dropped, as FFmpeg does)."""
        frame = self.dtype.itemsize * self.channels
        step = max(1, int(self.rate * _WAV_BLOCK_S)) * frame
        off, scale = _int_scale(self.dtype) if self.dtype.kind in "iu" else (0.0, 1.0)
        read, left = self._reader(), self.size
        while left >= frame:
            b = read(min(step, left))
            n = len(b) // frame
            if n == 0:
                break
            left -= len(b)
            a = np.frombuffer(b, self.dtype, count=n * self.channels).reshape(n, self.channels).T
            out = np.empty((self.channels, n), np.float32)
            if off:
                np.add(a, off, out=out, casting="unsafe")
                out *= scale
            elif scale != 1.0:
                np.multiply(a, scale, out=out, casting="unsafe")
            else:
                out[...] = _narrow(a)
            yield out, self.rate
            if len(b) % frame:
                break

    def close(self) -> None:
        if self._close is not None:
            self._close()
            self._close = None

    def warnings(self, decoded_s: float) -> list[str]:
        cut = truncation(decoded_s, self.declared)
        return [cut] if cut else []

    def check_nothing_decoded(self) -> None:
        raise EmptyAudioError(f"{self.label}: audio stream ({self.format}) holds no samples")


_WAV_BLOCK_S = 2.0  # seconds of a WAV read, converted and resampled at once


def _check_header_rate(head: bytes, label: str) -> None:
    """A header (``head``: the input's first bytes) claiming a sample rate outside
    :data:`SOURCE_RATES` raises UnsupportedSampleRateError, whatever its codec, layout or chunk
    order: the first ``fmt `` chunk within ``head`` of a RIFF, RF64, BW64 (little-endian) or RIFX
    (big-endian) WAVE; the header of a Sun/NeXT AU file; the ``COMM`` chunk of an AIFF/AIFF-C (an
    80-bit float). FFmpeg refuses 0 Hz and rates of 2^31 Hz and more in these as damaged data
    (``unsupported_format``) before any rate check of ours."""
    rate = None
    if len(head) >= 12 and head[:4] in (b"RIFF", b"RF64", b"BW64", b"RIFX") and head[8:12] == b"WAVE":
        order = "big" if head[:4] == b"RIFX" else "little"
        pos = 12
        while pos + 16 <= len(head):  # a fmt chunk's rate: bytes 4-8 of its body
            cid, size = head[pos:pos + 4], int.from_bytes(head[pos + 4:pos + 8], order)
            if cid == b"fmt ":
                if size >= 8:
                    rate = int.from_bytes(head[pos + 12:pos + 16], order)
                break
            pos += 8 + size + (size & 1)
    elif len(head) >= 24 and head[:4] == b".snd":  # AU: magic, offset, size, encoding, rate, channels
        rate = int.from_bytes(head[16:20], "big")
    elif len(head) >= 12 and head[:4] == b"FORM" and head[8:12] in (b"AIFF", b"AIFC"):
        pos = 12
        while pos + 26 <= len(head):  # COMM: channels (2), frames (4), bits (2), rate (80-bit float)
            cid, size = head[pos:pos + 4], int.from_bytes(head[pos + 4:pos + 8], "big")
            if cid == b"COMM":
                if size >= 18:
                    e = int.from_bytes(head[pos + 16:pos + 18], "big")
                    m = int.from_bytes(head[pos + 18:pos + 26], "big")
                    exp = (e & 0x7FFF) - 16383 - 63
                    rate = 0 if m == 0 or (e & 0x8000) else (m << exp if exp >= 0 else m >> -exp)
                break
            pos += 8 + size + (size & 1)
    if rate is not None and not SOURCE_RATES[0] <= rate <= SOURCE_RATES[1]:
        _check_rate(rate, label)


def plain_pcm_wav(source: Any) -> tuple[int, float] | None:
    """``(sample rate in Hz, declared seconds)`` when ``source`` (a path or seekable binary file;
    its first 4 KiB are read, a file's position is kept) is a WAV that :func:`load_audio` reads
    with numpy rather than FFmpeg (see ``_WavSource``); else None. Raises
    UnsupportedSampleRateError for a WAV header whose rate is outside :data:`SOURCE_RATES`."""
    head = _head(source, 4096)
    wav = _WavSource.open(b"", _label(source), head) if head else None
    return None if wav is None else (wav.rate, wav.declared)


class _ContainerSource:
    """Iterates one container's audio stream as float32 [C, n] blocks, tolerating damage.

    ``target_rate``: the caller's output rate; an Ogg/Opus stream is decoded by libopus at that
    rate where it can (:mod:`flashasr.audio.opus`), so its frames come at ``target_rate`` and
    need no resampling. Every other stream (and Opus without libopus) decodes with FFmpeg at its
    own rate. ``libopus``: None lets :func:`flashasr.audio.opus.enabled` decide; True or False
    forces the choice (the parallel decoder's ranges decode as its plan did)."""

    def __init__(self, source: Any, label: str, target_rate: int | None = None, libopus: bool | None = None):
        self.label = label
        head = _head(source, 4096) if not _is_array(source) else b""
        riff = _riff_declared(head)
        self.container, self.stream = _open_container(source, label, wave=_is_wave(head))
        from .opus import OggOpusStream

        self.opus = OggOpusStream.open(self.container, self.stream, target_rate, libopus, head)
        self.format = _format_name(self.container, self.stream)
        self.declared = _declared_duration(self.container, self.stream)
        if riff is not None and self.format.startswith("wav") and (self.declared is None or riff > self.declared):
            self.declared = riff  # what the header says, not what FFmpeg found
        self.bad_packets = 0
        self.bad_frames = 0
        self.demux_errors = 0
        self.packets = 0
        self.rate = self.stream.codec_context.sample_rate or self.stream.rate or 0
        self.channels = self.stream.codec_context.channels or 0
        self.frame_channels: int | None = None  # channel count of the first decoded frame

    def close(self) -> None:
        try:
            self.container.close()
        except Exception:
            pass
        if self.opus is not None:
            self.opus.close()

    def source_rate(self, decoded_rate: int) -> int:
        """The input's sample rate to report for frames decoded at ``decoded_rate``: the stream's
        own (48 kHz for Opus, as FFmpeg decodes it) when libopus decodes at another rate."""
        return int(self.rate or decoded_rate) if self.opus is not None else int(decoded_rate)

    def blocks(self) -> Iterator[tuple[np.ndarray, int]]:
        """Yields (float32 [C, n], rate): decoded frames gathered into blocks of ~0.5 s
        (fewer, larger numpy/soxr calls). Float frames (``flt``/``fltp``, what the mp3, AAC,
        Opus and Vorbis decoders give) are gathered as views of their planes and joined once per
        block (one copy, no numpy call per frame: ~4 us less per frame, 180,000 frames per audio
        hour of Opus); other formats are converted straight into their block. Opus decoded by
        libopus goes straight into its block (:meth:`_opus_blocks`)."""
        import av

        if self.opus is not None:
            yield from self._opus_blocks(av)
            return
        acc: np.ndarray | None = None  # integer / packed multichannel frames, converted
        views: list[list] | None = None  # float frames: per channel, views of the frames' planes
        fill = cap = acc_rate = acc_ch = 0
        for frame in self._frames(av):
            try:
                dtype, planar, c, n = _frame_info(frame)
            except KeyError:
                self.bad_frames += 1
                continue
            if n == 0:
                continue
            rate = frame.sample_rate
            if self.frame_channels is None:
                self.frame_channels = c
            keep = _kept_channels(frame, c)
            ck = c if keep is None else len(keep)
            fast = dtype == np.float32 and keep is None and (planar or c == 1)
            if fill and (rate != acc_rate or ck != acc_ch or fill + n > cap or fast != (views is not None)):
                yield _joined(views, fill) if views is not None else acc[:, :fill], acc_rate
                fill = 0
            if fill == 0:
                acc_rate, acc_ch, cap = rate, ck, max(n, rate // 2)
                acc, views = (None, [[] for _ in range(ck)]) if fast else (np.empty((ck, cap), np.float32), None)
            if views is not None:
                planes, nbytes = frame.planes, 4 * n
                for ch in range(ck):
                    views[ch].append(memoryview(planes[ch])[:nbytes])
            else:
                _frame_into(frame, acc[:, fill:fill + n], c, n, keep)
            fill += n
        if fill:
            yield _joined(views, fill) if views is not None else acc[:, :fill], acc_rate

    def _packets(self, av) -> Iterator[Any]:
        """The stream's demuxed packets (the demuxer's empty flush packet last); a demuxer error
        is counted and reading resumes after it."""
        done = False
        while not done:
            try:
                for packet in self.container.demux(self.stream):
                    if packet.size:
                        self.packets += 1
                    yield packet
                done = True
            except av.error.FFmpegError:
                # container-level damage: the demuxer raised; resume reading after it
                self.demux_errors += 1
                if self.demux_errors >= _MAX_DEMUX_ERRORS:
                    done = True

    def _frames(self, av) -> Iterator[Any]:
        """Decoded frames: ``av.AudioFrame`` s from FFmpeg, or :class:`~flashasr.audio.opus.OpusFrame` s
        (the same attributes) from libopus. A packet that fails to decode is counted and skipped."""
        from .opus import OpusPacketError

        decode = self.opus.frames if self.opus is not None else av.Packet.decode
        for packet in self._packets(av):
            try:
                frames = decode(packet)
            except (av.error.FFmpegError, OpusPacketError):
                # the demuxer ends with an empty flush packet: its failure is no packet of
                # the file's (counting it gave "17 of 16 packets failed")
                if packet.size:
                    self.bad_packets += 1
                continue
            yield from frames
        if self.demux_errors and self.opus is None:
            # demux stopped early: flush the decoder's buffered frames ourselves
            try:
                yield from self.stream.codec_context.decode(None)
            except av.error.FFmpegError:
                pass

    def _opus_blocks(self, av) -> Iterator[tuple[np.ndarray, int]]:
        """:meth:`blocks` for libopus: each packet decoded straight into its ~0.5 s block (no frame
        objects, no copy per packet)."""
        from .opus import OpusPacketError

        opus, rate = self.opus, self.opus.rate
        cap = rate // 2 + opus.max_frame
        acc: np.ndarray | None = None
        fill = 0
        for packet in self._packets(av):
            if not packet.size:
                continue
            try:
                skip = opus.prepare(packet)
                if acc is not None and acc.shape[0] != opus.channels:  # a chained link changed them
                    if fill:
                        yield acc[:, :fill], rate
                    acc = None
                if acc is None:
                    acc, fill = np.empty((opus.channels, cap), np.float32), 0
                fill += opus.decode_into(packet, acc, fill, skip)
            except OpusPacketError:
                self.bad_packets += 1
                continue
            if self.frame_channels is None and fill:
                self.frame_channels = opus.channels
            if fill > cap - opus.max_frame:
                yield acc[:, :fill], rate
                acc = None
        if acc is not None and fill:
            yield acc[:, :fill], rate

    def warnings(self, decoded_s: float) -> list[str]:
        w = []
        if self.bad_packets:
            w.append(f"skipped {self.bad_packets} undecodable packets (of {self.packets})")
        if self.bad_frames:
            w.append(f"skipped {self.bad_frames} frames with an unknown sample format")
        if self.demux_errors:
            w.append(f"the container is damaged: {self.demux_errors} demuxer read error(s) skipped")
        cut = truncation(decoded_s, self.declared)
        if cut:
            w.append(cut)
        return w

    def check_nothing_decoded(self) -> None:
        if self.bad_packets or self.demux_errors or self.bad_frames:
            why = " (the header declares 0 channels)" if self.channels == 0 else ""
            raise CorruptAudioError(
                f"{self.label}: has an audio stream ({self.format}) but none of it could be decoded{why} "
                f"({self.bad_packets} of {self.packets} packets failed, "
                f"{self.demux_errors} demuxer errors)")
        raise EmptyAudioError(f"{self.label}: audio stream ({self.format}) holds no samples")


# --------------------------------------------------------------------------- arrays / raw


def _array_input(source: Any, sample_rate: int | None, label: str) -> np.ndarray:
    """numpy-like [N] or [N, C] -> array [N, C] (native dtype, no copy when possible)."""
    if hasattr(source, "detach"):  # torch tensor without importing torch
        source = source.detach().cpu()
        if str(source.dtype) == "torch.bfloat16":  # numpy has no bfloat16: widened, as as_waveform does
            source = source.float()
        source = source.numpy()
    a = np.asarray(source)
    if sample_rate is None or sample_rate <= 0:
        raise AudioArgumentError(f"{label}: a sample array needs sample_rate= (Hz)")
    if a.dtype.kind not in "iuf":
        raise AudioArgumentError(f"{label}: unsupported sample dtype {a.dtype}")
    if a.ndim == 1:
        a = a[:, None]
    elif a.ndim != 2:
        raise AudioArgumentError(f"{label}: expected shape [N] or [N, C], got {list(a.shape)}")
    if a.shape[1] > _MAX_CHANNELS:
        raise AudioArgumentError(
            f"{label}: shape {list(a.shape)} looks like [C, N]; pass [N] or [N, C] "
            f"(at most {_MAX_CHANNELS} channels)")
    if a.shape[0] == 0 or a.shape[1] == 0:
        raise EmptyAudioError(f"{label}: array holds no samples (shape {list(a.shape)})")
    return a


def _array_blocks(a: np.ndarray, rate: int) -> Iterator[tuple[np.ndarray, int]]:
    """[N, C] native array -> float32 [C, n] blocks of 0.1 s."""
    step = max(1, int(rate * _ARRAY_BLOCK_S))
    for s in range(0, a.shape[0], step):
        yield _to_float32(a[s:s + step].T, out=np.empty((a.shape[1], min(step, a.shape[0] - s)),
                                                         np.float32)), rate


def _raw_reader(source: Any, label: str):
    """Returns (read(nbytes) -> bytes, close, total_bytes or None)."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        mv = memoryview(source).cast("B")
        pos = [0]

        def read(k):
            b = mv[pos[0]:pos[0] + k]
            pos[0] += len(b)
            return b

        return read, (lambda: None), len(mv)
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.exists(path):
            raise AudioFileNotFoundError(f"{label}: no such file")
        f = open(path, "rb")
        return f.read, f.close, os.path.getsize(path)
    if hasattr(source, "read"):
        return source.read, (lambda: None), None
    raise AudioArgumentError(f"{label}: raw PCM needs bytes, a path or a binary file object")


def _raw_total(source: Any, label: str) -> int | None:
    """Byte length of a raw PCM input when known without reading it."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return len(memoryview(source).cast("B"))
    if isinstance(source, (str, os.PathLike)):
        if not os.path.exists(os.fspath(source)):
            raise AudioFileNotFoundError(f"{label}: no such file")
        return os.path.getsize(os.fspath(source))
    return None


def _raw_blocks(source: Any, raw_format: str, sample_rate: int, channels: int, label: str,
                stats: dict) -> Iterator[tuple[np.ndarray, int]]:
    dtype = np.dtype(RAW_FORMATS[raw_format])
    frame_bytes = dtype.itemsize * channels
    step = max(1, int(sample_rate * _ARRAY_BLOCK_S)) * frame_bytes * 10  # 1 s per read
    read, close, _ = _raw_reader(source, label)
    carry = b""
    try:
        while True:
            chunk = read(step)
            if not chunk:
                break
            if carry:
                chunk = carry + bytes(chunk)
                carry = b""
            usable = len(chunk) - len(chunk) % frame_bytes
            if usable < len(chunk):
                carry = bytes(chunk[usable:])
            if usable == 0:
                continue
            a = np.frombuffer(chunk, dtype, count=usable // dtype.itemsize).reshape(-1, channels)
            yield from _array_blocks(a, sample_rate)
    finally:
        close()
    stats["trailing_bytes"] = len(carry)


def _check_rate(rate: Any, label: str, given: bool = False) -> int:
    """A source's sample rate as whole Hz within :data:`SOURCE_RATES`: raises AudioArgumentError for a
    caller's ``sample_rate=`` that is not a whole number (NaN, a string, 16000.5; 16000.0 passes) and
    UnsupportedSampleRateError outside the range (before any buffer is sized from it)."""
    try:
        r = operator.index(rate)  # int, numpy integers (bool is refused by the range: 0 or 1 Hz)
    except TypeError:  # a float of any kind (numpy float32, Fraction, Decimal) holding a whole number
        try:
            f = float(rate) if isinstance(rate, numbers.Number) else math.nan
        except (TypeError, ValueError, OverflowError):
            f = math.nan
        if not (math.isfinite(f) and f.is_integer()):
            raise AudioArgumentError(f"{label}: sample_rate must be a whole number of Hz, got {rate!r}") from None
        r = int(f)
    if not SOURCE_RATES[0] <= r <= SOURCE_RATES[1]:
        raise UnsupportedSampleRateError(
            f"{label}: sample rate {r} Hz is outside {SOURCE_RATES[0]}..{SOURCE_RATES[1]} Hz"
            + ("" if given else " (a damaged or hostile header?)"))
    return r


def _check_raw_args(raw_format, sample_rate, channels, label):
    if raw_format not in RAW_FORMATS:
        raise AudioArgumentError(
            f"{label}: unknown raw_format {raw_format!r}; one of {sorted(RAW_FORMATS)}")
    if not sample_rate or sample_rate <= 0:
        raise AudioArgumentError(f"{label}: raw PCM needs sample_rate= (Hz)")
    if channels is None:
        channels = 1
    if not (1 <= int(channels) <= _MAX_CHANNELS):
        raise AudioArgumentError(f"{label}: channels must be 1..{_MAX_CHANNELS}, got {channels}")
    return int(channels)


# --------------------------------------------------------------------------- public API


class _Decode:
    """Shared front of load_audio / iter_audio: picks the source kind, yields output pieces."""

    def __init__(self, source, *, sample_rate, target_rate, raw_format, channels, max_duration):
        self.label = _label(source)
        if target_rate is not None and target_rate <= 0:
            raise AudioArgumentError(f"target_rate must be positive, got {target_rate}")
        if max_duration is not None and max_duration <= 0:
            raise AudioArgumentError(f"max_duration must be positive, got {max_duration}")
        if sample_rate is not None and (raw_format is not None or _is_array(source)):
            sample_rate = _check_rate(sample_rate, self.label, given=True)
        self.container: _ContainerSource | _WavSource | None = None
        self.raw_stats: dict = {}
        self.declared: float | None = None
        check_finite = False
        if raw_format is not None:
            ch = _check_raw_args(raw_format, sample_rate, channels, self.label)
            self.format = f"raw/{raw_format}"
            self._blocks = _raw_blocks(source, raw_format, int(sample_rate), ch, self.label,
                                       self.raw_stats)
            self.src_rate, self.src_channels = int(sample_rate), ch
            check_finite = raw_format.startswith("f")
            total = _raw_total(source, self.label)
            if total is not None:
                self.declared = total / (np.dtype(RAW_FORMATS[raw_format]).itemsize * ch) / sample_rate
                if total == 0:
                    raise EmptyAudioError(f"{self.label}: input is empty (0 bytes)")
        elif _is_array(source):
            a = _array_input(source, sample_rate, self.label)
            self.format = f"numpy/{a.dtype.name}"
            self.src_rate, self.src_channels = int(sample_rate), a.shape[1]
            self.declared = a.shape[0] / sample_rate
            check_finite = a.dtype.kind == "f"
            if max_duration is not None and self.declared > max_duration:
                raise AudioTooLongError(
                    f"{self.label}: audio is {self.declared:.1f} s, longer than the limit of "
                    f"{max_duration:g} s")
            self._blocks = _array_blocks(a, self.src_rate)
        else:
            self.container = _WavSource.open(source, self.label, _head(source, 4096)) or \
                _ContainerSource(source, self.label, target_rate)
            self.format = self.container.format
            self.src_rate, self.src_channels = self.container.rate, self.container.channels
            if self.src_rate:  # a header's rate, checked before load_audio sizes its buffer from it
                _check_rate(self.src_rate, self.label)
            self.declared = self.container.declared
            check_finite = True
            self._blocks = self.container.blocks()
        self.pipe = _Pipeline(target_rate, max_duration, self.label, check_finite=check_finite)

    def pieces(self) -> Iterator[np.ndarray]:
        try:
            for x, rate in self._blocks:
                yield from self.pipe.push(x, rate)
            yield from self.pipe.flush()
        finally:
            self.close()

    def close(self) -> None:
        if self.container is not None:
            self.container.close()
        close = getattr(self._blocks, "close", None)
        if close is not None:
            close()

    @property
    def out_rate(self) -> int:
        return self.pipe.target_rate or self.src_rate

    def finish(self, n_out: int) -> list[str]:
        """Checks that something was decoded; returns warnings."""
        if self.pipe.first_rate is not None:
            self.src_rate = self.pipe.first_rate
            if self.container is not None:  # the pipeline may not see LFE channels
                self.src_rate = self.container.source_rate(self.src_rate)
                self.src_channels = self.container.frame_channels or self.src_channels
            else:
                self.src_channels = self.pipe.first_channels or self.src_channels
        if n_out == 0:
            if self.container is not None:
                self.container.check_nothing_decoded()
            raise EmptyAudioError(f"{self.label}: holds no samples")
        dur = n_out / self.out_rate
        w = []
        if self.container is not None:
            w += self.container.warnings(dur)
        if self.raw_stats.get("trailing_bytes"):
            w.append(f"ignored {self.raw_stats['trailing_bytes']} trailing bytes "
                     "(not a whole sample frame)")
        return w + self.pipe.warnings()


def load_audio(source: Any, *, sample_rate: int | None = None, target_rate: int | None = 16000,
               raw_format: str | None = None, channels: int | None = None,
               max_duration: float | None = None) -> DecodedAudio:
    """Decode ``source`` to mono float32 at ``target_rate`` Hz.

    Args:
        source: a path (str / PathLike) of any container FFmpeg reads (wav int8-32/float,
            mu-law, a-law, flac, mp3, ogg/opus, ogg/vorbis, m4a/aac, aiff, webm, ...); the
            whole file as ``bytes``/``bytearray``/``memoryview``; a binary file object; or a
            numpy array (or CPU torch tensor) of shape [N] or [N, C], any int/float dtype
            (ints are scaled to [-1, 1), floats are taken as they are), with ``sample_rate``.
        sample_rate: Hz of an array or raw PCM input (ignored for containers, which know theirs).
        target_rate: output Hz (16000 for Whisper and Parakeet); None keeps the source rate.
        raw_format: headerless PCM: ``"s16le"`` or ``"f32le"`` (also s16be, s32le, f64le, u8)
            with ``sample_rate`` and ``channels`` (default 1), from bytes, path or file object.
        channels: channel count of raw PCM (interleaved).
        max_duration: seconds; :class:`~flashasr.errors.AudioTooLongError` is raised as soon
            as decoding passes it (not after decoding everything).
    Returns:
        :class:`DecodedAudio` (``samples`` float32 [N] at ``target_rate``).
    Raises:
        EmptyAudioError: 0-byte input, or a valid file with no samples.
        NoAudioStreamError: the container has no audio stream (video-only, subtitles).
        UnsupportedFormatError: not a container/codec FFmpeg can read (text, random bytes).
        CorruptAudioError: an audio stream none of whose packets decode.
        AudioFileNotFoundError: the path does not exist.
        AudioTooLongError: longer than ``max_duration``.
        AudioArgumentError: inconsistent arguments (array without sample_rate, [C, N] shape).

    Damaged inputs decode as far as possible: undecodable packets are skipped and a
    truncated file yields its decodable prefix; both are reported in ``warnings``.
    Downmix: energy-keeping (see :mod:`flashasr.audio.downmix`); resampling: soxr ``HQ``.
    """
    d = _Decode(source, sample_rate=sample_rate, target_rate=target_rate, raw_format=raw_format,
                channels=channels, max_duration=max_duration)
    est_s = d.declared or 60.0
    if max_duration is not None:
        est_s = min(est_s, max_duration)
    est_s = min(est_s, 3600.0)  # a bogus header must not reserve gigabytes; grow past 1 h
    rate_guess = target_rate or d.src_rate or 16000
    sink = _Sink(est_s * rate_guess * 1.01 + 4096)
    for piece in d.pieces():
        sink.add(piece)
    warnings = d.finish(sink.n)
    samples = sink.result()
    return DecodedAudio(samples=samples, sample_rate=d.out_rate,
                        duration=samples.shape[0] / d.out_rate,
                        source_sample_rate=int(d.src_rate), source_channels=int(d.src_channels),
                        source_format=d.format, warnings=warnings,
                        declared_duration=d.declared, resample_cpu_s=d.pipe.resample_cpu_s)


def iter_audio(source: Any, *, target_rate: int = 16000, block_seconds: float = 30.0,
               sample_rate: int | None = None, raw_format: str | None = None,
               channels: int | None = None, max_duration: float | None = None,
               warnings: list[str] | None = None) -> Iterator[np.ndarray]:
    """Stream ``source`` as consecutive mono float32 blocks at ``target_rate``.

    Every block holds exactly ``round(block_seconds * target_rate)`` samples except the last
    (shorter, never empty). Block k starts at sample ``k * block_len`` of the same signal
    :func:`load_audio` returns (identical samples), so ``k * block_seconds`` is its global
    start time. Memory is bounded by one block plus decoder/resampler state, whatever the
    input length. Arguments and errors as :func:`load_audio`; errors that are only known at
    the end (nothing decodable) are raised when the iterator is exhausted. If ``warnings``
    is a list, decode warnings are appended to it when the iterator finishes.
    """
    if block_seconds <= 0:
        raise AudioArgumentError(f"block_seconds must be positive, got {block_seconds}")
    d = _Decode(source, sample_rate=sample_rate, target_rate=target_rate, raw_format=raw_format,
                channels=channels, max_duration=max_duration)
    return _iter_blocks(d, block_seconds, warnings)


def _iter_blocks(d: _Decode, block_seconds: float, warnings: list[str] | None) -> Iterator[np.ndarray]:
    blen = None
    block = None
    fill = 0
    total = 0
    for piece in d.pieces():
        if blen is None:
            blen = max(1, int(round(block_seconds * d.out_rate)))
            block = np.empty(blen, np.float32)
        pos = 0
        m = piece.shape[0]
        while pos < m:
            k = min(blen - fill, m - pos)
            block[fill:fill + k] = piece[pos:pos + k]
            fill += k
            pos += k
            if fill == blen:
                total += blen
                yield block
                block = np.empty(blen, np.float32)
                fill = 0
    if fill:
        total += fill
        yield block[:fill].copy()
    w = d.finish(total)
    if warnings is not None:
        warnings.extend(w)


def probe(source: Any, *, sample_rate: int | None = None, raw_format: str | None = None,
          channels: int | None = None) -> dict:
    """Read only headers: ``{"duration": s or None, "sample_rate": Hz, "channels": int,
    "codec": str, "format": "container/codec", "bit_rate": int or None}``.

    ``duration`` is what the header declares (for mp3 without a Xing header FFmpeg estimates
    it from the bit rate; a truncated file may declare more than it holds). Arrays and raw
    PCM need ``sample_rate`` (and ``raw_format``/``channels``). A seekable file object is
    seeked back to where it was (a non-seekable one is consumed). Raises as :func:`load_audio`.
    """
    label = _label(source)
    if sample_rate is not None and (raw_format is not None or _is_array(source)):
        sample_rate = _check_rate(sample_rate, label, given=True)
    if raw_format is not None:
        ch = _check_raw_args(raw_format, sample_rate, channels, label)
        total = _raw_total(source, label)
        width = np.dtype(RAW_FORMATS[raw_format]).itemsize
        return {"duration": None if total is None else total // (width * ch) / sample_rate,
                "sample_rate": int(sample_rate), "channels": ch, "codec": raw_format,
                "format": f"raw/{raw_format}", "bit_rate": int(sample_rate) * ch * width * 8}
    if _is_array(source):
        a = _array_input(source, sample_rate, label)
        return {"duration": a.shape[0] / sample_rate, "sample_rate": int(sample_rate),
                "channels": int(a.shape[1]), "codec": a.dtype.name,
                "format": f"numpy/{a.dtype.name}", "bit_rate": None}
    pos = None
    if hasattr(source, "read"):
        try:
            pos = source.tell() if source.seekable() else None
        except (AttributeError, OSError, ValueError):
            pos = None
    _check_header_rate(_head(source, 4096), label)  # by name (FFmpeg calls 0 Hz damaged data)
    src = _ContainerSource(source, label, libopus=False)  # headers only: no decoder
    try:
        br = src.stream.codec_context.bit_rate or src.container.bit_rate or None
        if src.rate:
            _check_rate(src.rate, label)
        return {"duration": src.declared, "sample_rate": int(src.rate), "channels": int(src.channels),
                "codec": _codec_name(src.stream), "format": src.format,
                "bit_rate": int(br) if br else None}
    finally:
        src.close()
        if pos is not None:  # a seekable file object is left where it was
            source.seek(pos)


__all__ = ["DecodedAudio", "load_audio", "iter_audio", "probe", "RAW_FORMATS", "truncation", "damage_warning",
           "declared_duration"]
