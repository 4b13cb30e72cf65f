"""Log-mel feature extraction with NeMo ``AudioToMelSpectrogramPreprocessor`` semantics.

Follows NeMo 3.0.0 ``FilterbankFeatures`` in eval mode (no dither): pre-emphasis, centred
zero-padded STFT with a symmetric window, magnitude ``** mag_power``, Slaney mel filterbank,
log with a zero guard, per-feature normalisation over the valid frames only, frames beyond the
valid length set to ``pad_value``. Always computed in float32.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from .config import PreprocessorConfig

_NORM_EPS = 1e-5  # NeMo normalize_batch: added to the std (not the variance)


def _hz_to_mel_slaney(f: np.ndarray) -> np.ndarray:
    f = np.asarray(f, dtype=np.float64)
    f_sp = 200.0 / 3
    mels = f / f_sp
    min_log_hz, min_log_mel, logstep = 1000.0, 1000.0 / f_sp, math.log(6.4) / 27.0
    return np.where(f >= min_log_hz, min_log_mel + np.log(np.maximum(f, 1e-10) / min_log_hz) / logstep, mels)


def _mel_to_hz_slaney(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m, dtype=np.float64)
    f_sp = 200.0 / 3
    freqs = f_sp * m
    min_log_hz, min_log_mel, logstep = 1000.0, 1000.0 / f_sp, math.log(6.4) / 27.0
    return np.where(m >= min_log_mel, min_log_hz * np.exp(logstep * (m - min_log_mel)), freqs)


def mel_filterbank(sample_rate: int, n_fft: int, n_mels: int, fmin: float = 0.0,
                   fmax: float | None = None, norm: str | None = "slaney") -> torch.Tensor:
    """Slaney-scale triangular mel filterbank, ``[n_mels, n_fft // 2 + 1]`` float32.

    Same construction as ``librosa.filters.mel(htk=False, norm="slaney")``, which NeMo uses
    (Slaney mel scale: linear below 1 kHz, logarithmic above; area normalisation).
    """
    fmax = sample_rate / 2.0 if fmax is None else float(fmax)
    fft_freqs = np.linspace(0.0, sample_rate / 2.0, n_fft // 2 + 1)
    mel_pts = _mel_to_hz_slaney(np.linspace(_hz_to_mel_slaney(fmin), _hz_to_mel_slaney(fmax), n_mels + 2))
    fdiff = np.diff(mel_pts)
    ramps = mel_pts[:, None] - fft_freqs[None, :]
    weights = np.zeros((n_mels, n_fft // 2 + 1), dtype=np.float32)
    for i in range(n_mels):
        lower = -ramps[i] / fdiff[i]
        upper = ramps[i + 2] / fdiff[i + 1]
        weights[i] = np.maximum(0.0, np.minimum(lower, upper))
    if norm == "slaney":
        enorm = 2.0 / (mel_pts[2: n_mels + 2] - mel_pts[:n_mels])
        weights *= enorm[:, None]
    return torch.from_numpy(weights)


def _window(name: str, length: int) -> torch.Tensor:
    name = str(name).lower()
    fns = {"hann": torch.hann_window, "hamming": torch.hamming_window,
           "blackman": torch.blackman_window, "bartlett": torch.bartlett_window}
    if name in fns:
        return fns[name](length, periodic=False, dtype=torch.float32)
    return torch.ones(length, dtype=torch.float32)


class MelPreprocessor(nn.Module):
    """Waveform ``[B, N]`` float32 (16 kHz) + lengths ``[B]`` (samples) -> log-mel features.

    Output: ``features [B, n_mels, T]`` float32 and ``feature_lengths [B]`` int64 with
    ``feature_lengths = floor((len + 2 * (n_fft // 2) - n_fft) / hop_length)`` (= ``len // 160``
    for v2/v3) and ``T = 1 + N // hop_length`` (rounded up to ``pad_to`` when set). Frames
    ``t >= feature_lengths[b]`` equal ``pad_value`` (0). Buffers ``window [win_length]`` and
    ``fb [1, n_mels, n_fft // 2 + 1]`` have NeMo's state-dict names
    (``preprocessor.featurizer.window`` / ``.fb``).
    """

    def __init__(self, cfg: PreprocessorConfig):
        super().__init__()
        self.cfg = cfg
        self.n_fft = cfg.fft_size
        self.hop_length = cfg.hop_length
        self.win_length = cfg.win_length
        self.register_buffer("window", _window(cfg.window, self.win_length))
        fb = mel_filterbank(cfg.sample_rate, self.n_fft, cfg.features, cfg.lowfreq, cfg.highfreq, cfg.mel_norm)
        self.register_buffer("fb", fb.unsqueeze(0))

    def output_lengths(self, lengths: torch.Tensor) -> torch.Tensor:
        """Valid feature frames for ``lengths`` samples (NeMo ``get_seq_len``, exact_pad off)."""
        pad = (self.n_fft // 2) * 2
        return torch.div(lengths.long() + pad - self.n_fft, self.hop_length, rounding_mode="floor").clamp(min=0)

    def log_mel_from_stft(self, spec: torch.Tensor) -> torch.Tensor:
        """Complex STFT ``[B, n_fft // 2 + 1, T]`` -> float32 (log-)mel ``[B, n_mels, T]``: magnitude
        to ``mag_power``, the mel filterbank, then the log with NeMo's zero guard (``add`` or
        ``clamp``) when ``log`` is set (NeMo ``FilterbankFeatures``; also the streaming step's)."""
        cfg = self.cfg
        spec = torch.view_as_real(spec)
        mag = torch.sqrt(spec.pow(2).sum(-1))
        if cfg.mag_power != 1.0:
            mag = mag.pow(cfg.mag_power)
        mel = torch.matmul(self.fb.float(), mag)
        if cfg.log:
            g = self._guard()
            mel = torch.log(mel + g) if cfg.log_zero_guard_type == "add" else torch.log(torch.clamp(mel, min=g))
        return mel

    def _guard(self) -> float:
        v = self.cfg.log_zero_guard_value
        if isinstance(v, str):
            return torch.finfo(torch.float32).tiny if v == "tiny" else torch.finfo(torch.float32).eps
        return float(v)

    @torch.no_grad()
    def forward(self, waveform: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """See the class docstring. ``waveform`` may be any float dtype; computed in float32."""
        x = waveform.float()
        if x.dim() == 1:
            x = x.unsqueeze(0)
        lengths = lengths.to(device=x.device, dtype=torch.long)
        B, N = x.shape
        feat_len = self.output_lengths(lengths)
        cfg = self.cfg
        if cfg.preemph is not None and N > 0:
            x = torch.cat([x[:, :1], x[:, 1:] - cfg.preemph * x[:, :-1]], dim=1)
        valid = torch.arange(N, device=x.device)[None, :] < lengths[:, None]
        x = x.masked_fill(~valid, 0.0)
        spec = torch.stft(x, n_fft=self.n_fft, hop_length=self.hop_length, win_length=self.win_length,
                          window=self.window.float(), center=True, pad_mode="constant",
                          return_complex=True)
        mel = self.log_mel_from_stft(spec)  # [B, n_mels, T]
        T = mel.shape[-1]
        tmask = torch.arange(T, device=x.device)[None, :] < feat_len[:, None]  # [B, T]
        if cfg.normalize in ("per_feature", "all_features"):
            mel = _normalize(mel, tmask, feat_len, per_feature=cfg.normalize == "per_feature")
        mel = mel.masked_fill(~tmask[:, None, :], cfg.pad_value)
        if cfg.pad_to and cfg.pad_to > 0:
            rem = T % cfg.pad_to
            if rem:
                mel = nn.functional.pad(mel, (0, cfg.pad_to - rem), value=cfg.pad_value)
        return mel, feat_len


def _normalize(x: torch.Tensor, tmask: torch.Tensor, n: torch.Tensor, per_feature: bool) -> torch.Tensor:
    """NeMo ``normalize_batch``: mean and unbiased std over valid frames, std += 1e-5."""
    m = tmask[:, None, :]
    cnt = n.to(x.dtype)
    if per_feature:
        mean = torch.where(m, x, 0.0).sum(2) / cnt[:, None]
        var = torch.where(m, x - mean[:, :, None], 0.0).pow(2).sum(2) / (cnt[:, None] - 1.0)
        std = torch.sqrt(var)
        std = std.masked_fill(torch.isnan(std), 0.0) + _NORM_EPS
        return (x - mean[:, :, None]) / std[:, :, None]
    tot = cnt * x.shape[1]
    mean = torch.where(m, x, 0.0).sum((1, 2)) / tot
    var = torch.where(m, x - mean[:, None, None], 0.0).pow(2).sum((1, 2)) / (tot - 1.0)
    std = torch.sqrt(var)
    std = std.masked_fill(torch.isnan(std), 0.0) + _NORM_EPS
    return (x - mean[:, None, None]) / std[:, None, None]


__all__ = ["MelPreprocessor", "mel_filterbank"]
