"""Whisper's log-mel front end, computed in our own code (torch, runs on CPU or CUDA).

Follows the reference definition (OpenAI Whisper ``audio.py``): 16 kHz input, n_fft = 400
(25 ms), hop = 160 (10 ms, 100 frames/s), periodic Hann window, centred STFT with reflect
padding, power spectrum ``|X|^2`` with the last frame dropped, a Slaney-style mel filterbank
(librosa ``mel(norm="slaney", htk=False)``: linear below 1 kHz, log above, area-normalised
triangles), ``log10(max(mel, 1e-10))``, dynamic range clamped to ``max - 8``, then
``(x + 4) / 4``. One 30 s window is 3000 frames.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
import torch.nn.functional as F

SAMPLE_RATE = 16_000
N_FFT = 400
HOP_LENGTH = 160
CHUNK_SECONDS = 30
N_SAMPLES = CHUNK_SECONDS * SAMPLE_RATE  # 480000 samples per window
N_FRAMES = N_SAMPLES // HOP_LENGTH  # 3000 mel frames per window
FRAMES_PER_SECOND = SAMPLE_RATE // HOP_LENGTH  # 100

__all__ = ["mel_filterbank", "log_mel_spectrogram", "normalise_log_mel", "pad_or_trim", "CHUNK_FRAMES", "SAMPLE_RATE", "N_FFT", "HOP_LENGTH",
           "N_SAMPLES", "N_FRAMES", "FRAMES_PER_SECOND"]


def _hz_to_mel_slaney(f: np.ndarray) -> np.ndarray:
    f = np.asarray(f, dtype=np.float64)
    f_sp = 200.0 / 3.0
    min_log_hz = 1000.0
    min_log_mel = min_log_hz / f_sp
    logstep = math.log(6.4) / 27.0
    return np.where(f >= min_log_hz,
                    min_log_mel + np.log(np.maximum(f, 1e-12) / min_log_hz) / logstep,
                    f / f_sp)


def _mel_to_hz_slaney(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m, dtype=np.float64)
    f_sp = 200.0 / 3.0
    min_log_hz = 1000.0
    min_log_mel = min_log_hz / f_sp
    logstep = math.log(6.4) / 27.0
    return np.where(m >= min_log_mel, min_log_hz * np.exp(logstep * (m - min_log_mel)), f_sp * m)


@functools.lru_cache(maxsize=8)
def mel_filterbank(n_mels: int = 80, sample_rate: int = SAMPLE_RATE, n_fft: int = N_FFT) -> np.ndarray:
    """Slaney mel filterbank, float32 ``[n_mels, n_fft // 2 + 1]`` (librosa-compatible,
    ``fmin=0``, ``fmax=sample_rate/2``, ``norm="slaney"``, ``htk=False``)."""
    n_bins = n_fft // 2 + 1
    fft_hz = np.linspace(0.0, sample_rate / 2.0, n_bins)
    edges = _mel_to_hz_slaney(np.linspace(_hz_to_mel_slaney(0.0), _hz_to_mel_slaney(sample_rate / 2.0), n_mels + 2))
    widths = np.diff(edges)
    dist = edges[:, None] - fft_hz[None, :]
    rising = -dist[:-2] / widths[:-1, None]
    falling = dist[2:] / widths[1:, None]
    fb = np.maximum(0.0, np.minimum(rising, falling))
    fb *= (2.0 / (edges[2:] - edges[:-2]))[:, None]
    return fb.astype(np.float32)


@functools.lru_cache(maxsize=16)
def _cached_tensors(n_mels: int, device: str):
    fb = torch.from_numpy(mel_filterbank(n_mels)).to(device)
    win = torch.hann_window(N_FFT, periodic=True, dtype=torch.float32).to(device)
    return fb, win


#: inputs longer than this (mel frames: 10 min) are computed in chunks of this many frames (same
#: frames: each one's samples, window and reflect padding as in one pass), so the STFT of a long
#: input never exists at once (one pass over 1 h held ~1.3 GB of complex spectrum and powers).
CHUNK_FRAMES = 60_000


def log_mel_spectrogram(audio, n_mels: int = 80, *, padding: int = 0, device: str | torch.device | None = None,
                        normalise: bool = True) -> torch.Tensor:
    """Log-mel spectrogram of one waveform.

    Args:
        audio: float32 samples at 16 kHz, numpy or torch, shape ``[N]``.
        n_mels: 80 or 128 mel bins.
        padding: zeros appended before the STFT (the reference appends 30 s so the last window
            is complete; the max-8 clamp is then taken over the whole padded input).
        device: where to compute (default: the tensor's device / CPU).
        normalise: False returns ``log10(max(mel, 1e-10))`` before the clamp and scaling (for
            :func:`normalise_log_mel` over chosen frame ranges).
    Returns:
        float32 ``[n_mels, (N + padding) // 160]``. Inputs of more than :data:`CHUNK_FRAMES` frames
        are computed chunk by chunk into the result (memory: the result plus one chunk's STFT).
    Raises:
        ValueError: not a 1-D signal.
    """
    x = torch.as_tensor(np.asarray(audio, dtype=np.float32) if not torch.is_tensor(audio) else audio)
    if device is not None:
        x = x.to(device)
    x = x.float()
    if x.ndim != 1:
        raise ValueError(f"log_mel_spectrogram expects a 1-D waveform, got shape {tuple(x.shape)}")
    total = x.numel() + max(padding, 0)
    if total // HOP_LENGTH > CHUNK_FRAMES:
        return _log_mel_chunked(x, n_mels, max(padding, 0), normalise)
    if padding > 0:
        x = F.pad(x, (0, padding))
    if x.numel() <= N_FFT // 2:  # reflect padding needs more than n_fft/2 samples
        x = F.pad(x, (0, N_FFT // 2 + 1 - x.numel()))
    fb, win = _cached_tensors(n_mels, str(x.device))
    spec = torch.stft(x, N_FFT, HOP_LENGTH, window=win, center=True, pad_mode="reflect", return_complex=True)
    power = spec[..., :-1].abs() ** 2
    mel = fb @ power
    log_spec = torch.clamp(mel, min=1e-10).log10()
    if not normalise:
        return log_spec
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    return (log_spec + 4.0) / 4.0


def normalise_log_mel(log_spec: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """The reference's dynamic-range clamp and scaling, ``(max(x, max - 8) + 4) / 4``, with the
    maximum taken over each frame range alone.

    Args:
        log_spec: float32 ``[n_mels, T]`` from ``log_mel_spectrogram(..., normalise=False)``;
            overwritten (returned).
        ranges: disjoint ``(a, b)`` frame ranges, each clamped with its own maximum (a stretch of
            audio decoded in its own windows, so audio outside it cannot push its quiet frames to the
            floor); frames outside every range get the whole input's maximum, as in the reference
            (one range ``(0, T)``: exactly the reference's result).
    Returns:
        float32 ``[n_mels, T]``.
    """
    top = log_spec.max()
    pos = 0
    for a, b in sorted(ranges) + [(log_spec.shape[1], log_spec.shape[1])]:
        if a > pos:  # frames outside every range: the whole input's maximum
            torch.maximum(log_spec[:, pos:a], top - 8.0, out=log_spec[:, pos:a])
        if b > a:
            part = log_spec[:, a:b]
            torch.maximum(part, part.max() - 8.0, out=part)
        pos = max(pos, b)
    return log_spec.add_(4.0).div_(4.0)


def _log_mel_chunked(x: torch.Tensor, n_mels: int, padding: int, normalise: bool = True) -> torch.Tensor:
    """:func:`log_mel_spectrogram` of ``x`` + ``padding`` zeros, :data:`CHUNK_FRAMES` frames at a time.

    Frame ``t`` of the centred STFT covers samples ``[t * 160 - 200, t * 160 + 200)`` of the padded
    signal, reflected at both of its ends; each chunk gathers exactly those samples (the zeros and
    the reflections made here) and runs the STFT uncentred, so every frame sees what it sees in one
    pass. The max-8 clamp then takes the maximum over all chunks."""
    n = x.numel()
    total = n + padding
    frames = total // HOP_LENGTH
    half = N_FFT // 2
    fb, win = _cached_tensors(n_mels, str(x.device))
    out = torch.empty(n_mels, frames, dtype=torch.float32, device=x.device)
    for f0 in range(0, frames, CHUNK_FRAMES):
        f1 = min(frames, f0 + CHUNK_FRAMES)
        idx = torch.arange(f0 * HOP_LENGTH - half, (f1 - 1) * HOP_LENGTH + half + 1, device=x.device)
        idx = torch.where(idx < 0, -idx, idx)  # reflect at the start
        idx = torch.where(idx >= total, 2 * (total - 1) - idx, idx)  # reflect at the (padded) end
        seg = torch.where(idx < n, x[idx.clamp(max=n - 1)], torch.zeros((), device=x.device))
        spec = torch.stft(seg, N_FFT, HOP_LENGTH, window=win, center=False, return_complex=True)
        out[:, f0:f1] = torch.clamp(fb @ (spec.abs() ** 2), min=1e-10).log10()
    if not normalise:
        return out
    out = torch.maximum(out, out.max() - 8.0)
    return out.add_(4.0).div_(4.0)


def pad_or_trim(mel: torch.Tensor, length: int = N_FRAMES) -> torch.Tensor:
    """Zero-pad or cut the last axis of ``mel`` to ``length`` frames."""
    n = mel.shape[-1]
    if n > length:
        return mel[..., :length]
    if n < length:
        return F.pad(mel, (0, length - n))
    return mel
