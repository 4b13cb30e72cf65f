"""Encode float samples to an audio file with PyAV (for tests, benchmarks and fixtures).

Not on the serving path: it exists so tests can generate every PCM width / codec /
container in a temp dir instead of shipping binary fixtures, and so the benchmark can
re-encode real clips.
"""

from __future__ import annotations

import io
import os
from typing import Any

import numpy as np

# container -> default codec
_DEFAULT_CODEC = {
    "wav": "pcm_s16le",
    "flac": "flac",
    "mp3": "libmp3lame",
    "ogg": "libopus",
    "opus": "libopus",
    "webm": "libopus",
    "ipod": "aac",  # .m4a
    "mp4": "aac",
    "aiff": "pcm_s16be",
    "matroska": "flac",
}


def encode_audio(samples: np.ndarray, sample_rate: int, dest: Any = None, *, format: str = "wav",
                 codec: str | None = None, sample_fmt: str | None = None,
                 bit_rate: int | None = None, layout: str | None = None, quality: float | None = None,
                 container_options: dict | None = None) -> bytes | None:
    """Write ``samples`` (float [N] or [N, C], nominally in [-1, 1]) as an audio file.

    Args:
        samples: float array [N] (mono) or [N, C].
        sample_rate: Hz.
        dest: a path, a binary file object, or None to return the file as ``bytes``.
        format: FFmpeg muxer name: ``wav``, ``flac``, ``mp3``, ``ogg``, ``webm``,
            ``ipod`` (m4a), ``aiff``, ...
        codec: FFmpeg encoder (default per container: pcm_s16le, flac, libmp3lame, libopus,
            aac, pcm_s16be). PCM widths: ``pcm_u8``, ``pcm_s16le``, ``pcm_s24le``,
            ``pcm_s32le``, ``pcm_f32le``, ``pcm_f64le``, ``pcm_mulaw``, ``pcm_alaw``.
        sample_fmt: encoder input sample format (default: the encoder's first one).
        bit_rate: bits per second for lossy codecs.
        layout: FFmpeg channel layout name (``"5.1"``, ``"7.1"``); default mono/stereo/``"Nc"``.
        quality: variable-bit-rate quality in the encoder's own scale (``ffmpeg -q:a``; libmp3lame:
            0 best .. 9 smallest), instead of ``bit_rate``.
        container_options: muxer options, e.g. ``{"write_xing": "0"}`` (an mp3 without its
            Xing/LAME header: no frame count, no seek table).
    Returns:
        The encoded bytes when ``dest`` is None, else None.
    """
    import av

    x = np.asarray(samples, dtype=np.float64)
    if x.ndim == 1:
        x = x[:, None]
    n, c = x.shape
    codec = codec or _DEFAULT_CODEC.get(format, "pcm_s16le")
    target = io.BytesIO() if dest is None else (os.fspath(dest) if isinstance(dest, (str, os.PathLike)) else dest)
    layout = layout or {1: "mono", 2: "stereo"}.get(c, f"{c}c")
    with av.open(target, mode="w", format=format, container_options=container_options or {}) as out:
        # "strict": FFmpeg's native vorbis encoder is marked experimental
        st = out.add_stream(codec, rate=sample_rate, options={"strict": "experimental"})
        st.layout = layout
        fmts = [f.name for f in (st.codec_context.codec.audio_formats or [])]
        fmt = sample_fmt or (fmts[0] if fmts else "s16")
        st.format = fmt
        if bit_rate:
            st.bit_rate = bit_rate
        if quality is not None:
            st.codec_context.qscale = True  # AV_CODEC_FLAG_QSCALE: VBR at global_quality
            st.codec_context.global_quality = int(round(quality * 118))  # FF_QP2LAMBDA
        planar = fmt.endswith("p")
        base = fmt[:-1] if planar else fmt
        xc = np.clip(x, -1.0, 1.0)
        if base == "u8":
            arr = np.round(xc * 127.0 + 128.0).astype(np.uint8)
        elif base == "s16":
            arr = np.round(xc * 32767.0).astype(np.int16)
        elif base == "s32":
            arr = np.round(xc * 2147483647.0).astype(np.int32)
        elif base == "flt":
            arr = x.astype(np.float32)
        elif base == "dbl":
            arr = x.astype(np.float64)
        else:
            raise ValueError(f"unsupported encoder sample format {fmt}")
        step = 4096
        pts = 0
        for s in range(0, n, step):
            blk = arr[s:s + step]
            data = np.ascontiguousarray(blk.T) if planar else np.ascontiguousarray(blk.reshape(1, -1))
            frame = av.AudioFrame.from_ndarray(data, format=fmt, layout=layout)
            frame.sample_rate = sample_rate
            frame.pts = pts
            pts += blk.shape[0]
            for pkt in st.encode(frame):
                out.mux(pkt)
        for pkt in st.encode(None):
            out.mux(pkt)
    if dest is None:
        return target.getvalue()
    return None


__all__ = ["encode_audio"]
