"""Ogg/Opus decoded by libopus at the rate the caller needs, not at 48 kHz.

FFmpeg's own Opus decoder always gives 48 kHz (its SILK layer is resampled up to 48 kHz inside
it), and FFmpeg's wrapper of libopus forces 48 kHz as well; the pipeline then resampled 48 ->
16 kHz with soxr. libopus itself decodes at any of 8, 12, 16, 24 or 48 kHz (RFC 6716 s. 4.3: a
decoder may run at a lower rate; RFC 7845 s. 4.2: pre-skip and end trimming scale with it), and
at 16 kHz it skips both resampling steps. Measured on the 2-core VM over the benchmark corpus's
27 Ogg/Opus files (``bench/bench_offline_e2e.py prepare``: speech at 12-24 kb/s, SILK and hybrid
packets; CPU s per audio hour of ``load_audio`` to 16 kHz, FFmpeg + soxr -> libopus, same run):
8 kHz sources 2.48 -> 1.67, 16 kHz 3.38 -> 2.14, 48 kHz 3.56 -> 2.55.

CELT-only streams (music-grade bit rates) are the exception: FFmpeg's CELT has SIMD code this
libopus build does not beat, and libopus decodes CELT at 48 kHz whatever the output rate (69 s of
speech, same measure, libopus against FFmpeg: SILK wideband at 16-32 kb/s 2.03-2.51 against
3.20-3.90; hybrid at 32 kb/s 3.54 against 4.06; CELT-only at 64 kb/s 3.35-3.99 against 3.03-3.56).
So a stream whose first packets are mostly CELT-only stays with FFmpeg (:func:`first_packet_modes`).

Data flow, per packet (PyAV demuxes; this module only decodes)::

    av.Packet (Opus bytes, pts in 1/48000 s, side data 'skip_samples')
        --opus_decode_float--> float32 [n, C] at the decode rate (n = frame duration x rate)
        --trim: skip_samples' start/end counts (48 kHz units, / (48000 / rate))-->
        OpusFrame: what :mod:`flashasr.audio.decode` reads from an ``av.AudioFrame``
                   (``samples``, ``pts``, ``sample_rate``, ``format.name``, ``layout``, ``planes``)

Trimming follows the container exactly as FFmpeg does: FFmpeg's Ogg demuxer marks the first
packet of every chained link with its pre-skip and the last packet with the end trim (the
``skip_samples`` side data), so the lengths equal FFmpeg's decode (tested). A frame's ``pts`` is
its packet's plus the trimmed start, as FFmpeg gives it, so the parallel range decoder
(:mod:`flashasr.audio.parallel`) places frames the same way.

Used only where nothing is lost by it: an Ogg container, an ``OpusHead`` of version 0.x with
channel mapping family 0 (mono or stereo; families 1 and 255 go to FFmpeg), first packets that
are mostly SILK or hybrid (above), and a
libopus that can be loaded -- PyAV's wheels ship one (``av.libs``), else the system's (``libopus.so.0``).
Anything else, or ``FLASHASR_OPUS_DECODER=ffmpeg``, decodes with FFmpeg as before. The output
gain of the header (Q7.8 dB) is applied, as FFmpeg does. A packet libopus refuses is counted as
an undecodable packet, as FFmpeg's decoder failures are.

Agreement with FFmpeg's decoder (two independent implementations, both conformant; the 2-core
VM, the corpus's 27 Ogg/Opus files, 16 kHz output): equal lengths; median SNR 35 dB; narrowband
(8 kHz) sources are 2 samples (0.125 ms) apart because the two resample SILK's 8 kHz output
differently.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import threading

import numpy as np

#: Rates libopus decodes at (RFC 6716 s. 4.3).
OPUS_RATES = (8000, 12000, 16000, 24000, 48000)
#: Longest Opus frame: 120 ms (RFC 6716 s. 3.2.3).
_MAX_FRAME_S = 0.12
_OPUS_SET_GAIN_REQUEST = 4034  # opus_defines.h
_ENV = "FLASHASR_OPUS_DECODER"

_lib_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_lib_tried = False


class OpusPacketError(Exception):
    """libopus refused a packet (its negative return code and name in the message)."""


def _candidates() -> list[str]:
    """libopus files to try: PyAV's bundled copy (Linux ``av.libs``, macOS ``av/.dylibs``,
    Windows ``av.libs``), then the system's."""
    out: list[str] = []
    try:
        import av

        base = os.path.dirname(av.__file__)
        for pat in ("../av.libs/libopus*.so*", ".dylibs/libopus*.dylib", "../av.libs/opus*.dll",
                    "../av.libs/libopus*.dll"):
            out += sorted(glob.glob(os.path.join(base, pat)))
    except ImportError:
        pass
    found = ctypes.util.find_library("opus")
    if found:
        out.append(found)
    return out


def _load() -> ctypes.CDLL | None:
    for path in _candidates():
        try:
            lib = ctypes.CDLL(path)
            lib.opus_decoder_create.restype = ctypes.c_void_p
            lib.opus_decoder_create.argtypes = [ctypes.c_int32, ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
            lib.opus_decode_float.restype = ctypes.c_int
            lib.opus_decode_float.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int32,
                                              ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
            lib.opus_decoder_destroy.restype = None
            lib.opus_decoder_destroy.argtypes = [ctypes.c_void_p]
            lib.opus_decoder_ctl.restype = ctypes.c_int
            lib.opus_strerror.restype = ctypes.c_char_p
            lib.opus_strerror.argtypes = [ctypes.c_int]
            lib.opus_get_version_string.restype = ctypes.c_char_p
            return lib
        except (OSError, AttributeError):
            continue
    return None


def libopus() -> ctypes.CDLL | None:
    """The loaded libopus (cached), or None when no copy can be loaded."""
    global _lib, _lib_tried
    if not _lib_tried:
        with _lib_lock:
            if not _lib_tried:
                _lib = _load()
                _lib_tried = True
    return _lib


def version() -> str | None:
    """libopus's version string (``"libopus 1.6.1"``), or None when it is not loaded."""
    lib = libopus()
    return lib.opus_get_version_string().decode() if lib is not None else None


def enabled() -> bool:
    """Whether Ogg/Opus goes to libopus: a copy loads and ``$FLASHASR_OPUS_DECODER`` is not
    ``ffmpeg`` (any other value, or none, means libopus)."""
    return os.environ.get(_ENV, "").strip().lower() != "ffmpeg" and libopus() is not None


def decode_rate(target_rate: int | None) -> int:
    """The rate to decode at for output at ``target_rate`` Hz: itself when libopus has it,
    else 48 kHz (then resampled as any other source)."""
    return int(target_rate) if target_rate in OPUS_RATES else 48000


def first_packet_modes(head: bytes) -> tuple[int, int]:
    """Counts (SILK or hybrid, CELT-only) among the audio packets that start in ``head``, the first
    bytes of an Ogg/Opus file: Ogg pages (RFC 3533) split into packets by their lacing values, the
    first two packets (``OpusHead``, ``OpusTags``) skipped, each audio packet's mode read from its
    TOC byte (RFC 6716 s. 3.1: configurations 0-15 SILK or hybrid, 16-31 CELT-only). (0, 0) when
    ``head`` holds no audio packet (not Ogg, or long tags)."""
    silk = celt = 0
    pos, packet, new_packet = 0, 0, True
    while pos + 27 <= len(head) and head[pos:pos + 4] == b"OggS":
        nseg = head[pos + 26]
        body = pos + 27 + nseg
        if body > len(head):
            break
        lacing = head[pos + 27:body]
        if not (head[pos + 5] & 1):  # a page that starts a fresh packet (not a continuation)
            new_packet = True
        at = body
        for lace in lacing:
            if new_packet and packet >= 2 and at < len(head):
                if head[at] >> 3 < 16:
                    silk += 1
                else:
                    celt += 1
            at += lace
            new_packet = lace < 255
            if new_packet:
                packet += 1
        pos = at
    return silk, celt


def parse_head(extradata: bytes | None) -> tuple[int, int, int] | None:
    """``OpusHead`` (RFC 7845 s. 5.1) -> (channels, pre-skip in 48 kHz samples, output gain Q7.8
    dB), or None when this module does not decode it (not an OpusHead, a version other than
    0.x, a mapping family other than 0, or not 1-2 channels)."""
    if not extradata or len(extradata) < 19 or extradata[:8] != b"OpusHead":
        return None
    if extradata[8] >> 4 != 0:  # major version 0 (RFC 7845: decoders must refuse others)
        return None
    channels, family = extradata[9], extradata[18]
    if family != 0 or channels not in (1, 2):
        return None
    pre_skip = int.from_bytes(extradata[10:12], "little")
    gain = int.from_bytes(extradata[16:18], "little", signed=True)
    return channels, pre_skip, gain


class _Format:
    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name


class _Layout:
    __slots__ = ("nb_channels", "name", "channels")

    def __init__(self, c: int):
        self.nb_channels = c
        self.name = "mono" if c == 1 else "stereo"
        self.channels = ()


_MONO, _STEREO = _Layout(1), _Layout(2)
_FLT, _FLTP = _Format("flt"), _Format("fltp")


class OpusFrame:
    """One decoded packet, shaped as the parts of an ``av.AudioFrame`` that
    :mod:`flashasr.audio.decode` reads: ``samples`` (per channel), ``pts`` (stream time base, 1/48000
    s; None when the packet had none), ``sample_rate`` (the decode rate), ``format.name``
    (``flt`` mono, ``fltp`` stereo), ``layout`` (``nb_channels``, ``name``) and ``planes`` (one
    uint8 view of float32 samples per channel)."""

    __slots__ = ("samples", "pts", "sample_rate", "format", "layout", "planes")

    def __init__(self, x: np.ndarray, pts: int | None, rate: int):
        c = x.shape[0]
        self.samples = x.shape[1]
        self.pts = pts
        self.sample_rate = rate
        self.format = _FLT if c == 1 else _FLTP
        self.layout = _MONO if c == 1 else _STEREO
        self.planes = [row.view(np.uint8) for row in x]


class OpusDecoder:
    """libopus decoding Ogg/Opus packets at ``rate`` Hz (one of :data:`OPUS_RATES`).

    Args:
        rate: output Hz.
        channels: 1 or 2 (the ``OpusHead``'s count).
        gain_q8: the header's output gain, Q7.8 dB (applied by libopus).
    Raises:
        RuntimeError: libopus is not loaded or refuses the arguments.
    """

    def __init__(self, rate: int, channels: int, gain_q8: int = 0):
        lib = libopus()
        if lib is None:
            raise RuntimeError("libopus is not available")
        if rate not in OPUS_RATES or channels not in (1, 2):
            raise RuntimeError(f"libopus cannot decode {channels} channel(s) at {rate} Hz")
        err = ctypes.c_int(0)
        handle = lib.opus_decoder_create(rate, channels, ctypes.byref(err))
        if not handle or err.value != 0:
            raise RuntimeError(f"opus_decoder_create failed: {lib.opus_strerror(err.value).decode()}")
        self._lib, self._h = lib, handle
        if gain_q8:
            lib.opus_decoder_ctl(ctypes.c_void_p(handle), ctypes.c_int(_OPUS_SET_GAIN_REQUEST),
                                 ctypes.c_int32(gain_q8))
        self.rate, self.channels = rate, channels
        self.per_48k = 48000 // rate  # 48 kHz samples per output sample
        self.max_frame = int(rate * _MAX_FRAME_S)
        self._buf = np.empty(self.max_frame * channels, np.float32)
        self._ptr = self._buf.ctypes.data

    def _decode(self, data: bytes, ptr: int) -> int:
        n = self._lib.opus_decode_float(self._h, data, len(data), ptr, self.max_frame, 0)
        if n < 0:
            raise OpusPacketError(f"libopus: {self._lib.opus_strerror(n).decode()} ({n})")
        return n

    def _trim(self, n: int, skip_start: int, skip_end: int) -> tuple[int, int]:
        """(first, end) of the ``n`` decoded samples kept after trimming 48 kHz counts."""
        if not (skip_start or skip_end):
            return 0, n
        lo = min(n, round(skip_start / self.per_48k))
        return lo, n - min(n - lo, round(skip_end / self.per_48k))

    def decode(self, data: bytes, skip_start: int = 0, skip_end: int = 0) -> np.ndarray:
        """One packet -> float32 [C, n] (a new array), ``skip_start`` / ``skip_end`` 48 kHz samples
        trimmed from its ends. Raises :class:`OpusPacketError` for a packet libopus refuses."""
        n = self._decode(data, self._ptr)
        lo, hi = self._trim(n, skip_start, skip_end)
        if self.channels == 1:
            return self._buf[lo:hi].copy().reshape(1, -1)
        return np.ascontiguousarray(self._buf[:2 * n].reshape(n, 2)[lo:hi].T)

    def decode_into(self, data: bytes, out: np.ndarray, at: int, skip_start: int = 0, skip_end: int = 0) -> int:
        """One packet into ``out[:, at:]`` (float32 [C, cap], C-contiguous, ``cap - at`` at least
        :attr:`max_frame`): mono is decoded in place, stereo through a scratch buffer. Returns the
        samples written after trimming. Raises :class:`OpusPacketError` as :meth:`decode`."""
        if out.dtype != np.float32 or out.shape[0] != self.channels or out.shape[1] - at < self.max_frame \
                or not out.flags.c_contiguous:
            raise ValueError(f"decode_into needs float32 [{self.channels}, >= {at + self.max_frame}], "
                             f"C-contiguous; got {out.dtype} {list(out.shape)}")
        if self.channels == 1:
            n = self._decode(data, out.ctypes.data + 4 * at)
            lo, hi = self._trim(n, skip_start, skip_end)
            if lo:
                out[0, at:at + hi - lo] = out[0, at + lo:at + hi]  # numpy copies overlapping slices safely
            return hi - lo
        n = self._decode(data, self._ptr)
        lo, hi = self._trim(n, skip_start, skip_end)
        out[:, at:at + hi - lo] = self._buf[:2 * n].reshape(n, 2)[lo:hi].T
        return hi - lo

    def close(self) -> None:
        if self._h:
            self._lib.opus_decoder_destroy(self._h)
            self._h = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class OggOpusStream:
    """Decodes the packets of one Ogg/Opus stream as :class:`OpusFrame` s.

    Args:
        stream: the PyAV audio stream (its ``codec_context.extradata`` is the ``OpusHead``).
        target_rate: the caller's output rate (decoded at :func:`decode_rate` of it).
    Raises:
        ValueError: the header is not one :func:`parse_head` accepts (use FFmpeg then).
    """

    def __init__(self, stream, target_rate: int | None):
        head = parse_head(bytes(stream.codec_context.extradata or b""))
        if head is None:
            raise ValueError("not an OpusHead this decoder takes")
        self.rate = decode_rate(target_rate)
        self._head = head
        self._dec = OpusDecoder(self.rate, head[0], head[2])

    @classmethod
    def open(cls, container, stream, target_rate: int | None, use: bool | None = None,
             head: bytes = b"") -> "OggOpusStream | None":
        """The decoder for ``stream`` of ``container``, or None where FFmpeg decodes it: not Ogg, not
        Opus, a header this module does not take, libopus missing, switched off (``use`` False, or
        ``use`` None and :func:`enabled` False), or -- ``use`` None -- a stream whose first packets
        (in ``head``, the file's first bytes) are mostly CELT-only, where FFmpeg's own decoder is the
        cheaper (the module docstring)."""
        try:
            if use is False or stream.codec_context.name not in ("opus", "libopus"):
                return None
            if container.format.name.split(",")[0] != "ogg" or not (enabled() if use is None else libopus()):
                return None
            if use is None:
                silk, celt = first_packet_modes(head)
                if celt > silk:
                    return None
            return cls(stream, target_rate)
        except (ValueError, RuntimeError, AttributeError):
            return None

    @property
    def channels(self) -> int:
        """Channels of the current link (1 or 2)."""
        return self._dec.channels

    @property
    def max_frame(self) -> int:
        """Most samples per channel one packet decodes to (120 ms at :attr:`rate`)."""
        return self._dec.max_frame

    def prepare(self, packet) -> tuple[int, int]:
        """Reads ``packet`` 's side data before it is decoded: a chained link's new header (the
        decoder follows it; :attr:`channels` may change) and the samples to trim, (start, end) in
        48 kHz samples (FFmpeg's ``skip_samples``: the pre-skip on a link's first packet, the end
        trim on its last). Raises :class:`OpusPacketError` for a new header this module does not
        take."""
        skip = (0, 0)
        for sd in packet.iter_sidedata():  # no side data on most packets: one cheap call
            kind = sd.data_type
            if kind == "skip_samples":
                b = bytes(sd)
                if len(b) >= 8:
                    skip = (int.from_bytes(b[0:4], "little"), int.from_bytes(b[4:8], "little"))
            elif kind == "new_extradata":
                self._relink(bytes(sd))
        return skip

    def decode_into(self, packet, out: np.ndarray, at: int, skip: tuple[int, int] = (0, 0)) -> int:
        """Decodes ``packet`` into ``out[:, at:]`` (float32 [C, cap], C = :attr:`channels`, at least
        :attr:`max_frame` free samples), trimmed by ``skip`` (from :meth:`prepare`); returns the
        samples written. Raises :class:`OpusPacketError` for a packet libopus refuses."""
        return self._dec.decode_into(bytes(packet), out, at, skip[0], skip[1])

    def frames(self, packet) -> list[OpusFrame]:
        """One demuxed packet -> its frame (none for the demuxer's empty flush packet); the frame's
        ``pts`` is the packet's plus the trimmed start, as FFmpeg's. Raises
        :class:`OpusPacketError` for a packet libopus refuses."""
        if not packet.size:
            return []
        skip = self.prepare(packet)
        x = self._dec.decode(bytes(packet), skip[0], skip[1])
        if x.shape[1] == 0:
            return []
        pts = packet.pts
        if pts is not None and skip[0]:
            pts += skip[0]
        return [OpusFrame(x, pts, self.rate)]

    def _relink(self, extradata: bytes) -> None:
        head = parse_head(extradata)
        if head is None:
            raise OpusPacketError("a chained link's OpusHead is not one this decoder takes")
        if head != self._head:
            self._dec.close()
            self._dec = OpusDecoder(self.rate, head[0], head[2])
            self._head = head

    def close(self) -> None:
        self._dec.close()


__all__ = ["OPUS_RATES", "OggOpusStream", "OpusDecoder", "OpusFrame", "OpusPacketError", "decode_rate",
           "enabled", "first_packet_modes", "libopus", "parse_head", "version"]
