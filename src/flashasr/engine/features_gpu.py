"""Batched log-mel features on the GPU (same torch code runs on CPU), and pinned uploads.

Two variants, each equal to the model family's CPU reference path:

* :class:`NemoLogMel` - Parakeet / NeMo ``AudioToMelSpectrogramPreprocessor`` (pre-emphasis,
  centred zero-padded STFT, power, Slaney mel, ``log(x + guard)``, per-feature mean/std over
  the valid frames, padded frames set to 0). Reference:
  :class:`flashasr.models.parakeet.preprocessor.MelPreprocessor` (NeMo 3.0.0 notes (a)).
* :class:`WhisperLogMel` - OpenAI Whisper ``log_mel_spectrogram`` (reflect-padded STFT with a
  periodic Hann window, last frame dropped, ``log10(max(mel, 1e-10))``, clamp to ``max - 8``,
  ``(x + 4) / 4``), batched: the ``max`` is taken per item over that item's own frames.
  Reference: :func:`flashasr.models.whisper.features.log_mel_spectrogram`.

Neither variant synchronises with the host (no ``.item()``), so both can be captured in a CUDA
graph with static shapes. :class:`PinnedUploader` stages numpy waveforms in a reusable pinned
host buffer and copies them to the device with ``non_blocking=True``.
"""

from __future__ import annotations

import itertools
import math
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import AudioError

_NORM_EPS = 1e-5  # NeMo normalize_batch: added to the std


class NemoLogMel(torch.nn.Module):
    """NeMo/Parakeet log-mel: waveform ``[B, N]`` float32 16 kHz + lengths ``[B]`` (samples) ->
    ``features [B, n_mels, 1 + N // hop]`` float32 and ``feature_lengths [B]`` int64
    (``(len + 2 * (n_fft // 2) - n_fft) // hop``). Frames at or beyond a row's length are 0.

    Build it from a Parakeet preprocessor with :meth:`from_preprocessor` (shares its ``fb`` and
    ``window`` values) so both paths use identical constants.
    """

    def __init__(self, fb: torch.Tensor, window: torch.Tensor, *, n_fft: int = 512, hop: int = 160,
                 preemph: float | None = 0.97, mag_power: float = 2.0, guard: float = 2.0 ** -24,
                 guard_type: str = "add", normalize: str | None = "per_feature", pad_value: float = 0.0,
                 log: bool = True):
        super().__init__()
        fb = fb.float()
        self.register_buffer("fb", fb.reshape(fb.shape[-2], fb.shape[-1]).clone())  # [n_mels, n_fft//2+1]
        self.register_buffer("window", window.float().clone())
        self.n_fft, self.hop, self.win_length = int(n_fft), int(hop), int(window.numel())
        self.preemph, self.mag_power = preemph, float(mag_power)
        self.guard, self.guard_type, self.log = float(guard), guard_type, bool(log)
        self.normalize, self.pad_value = normalize, float(pad_value)

    @classmethod
    def from_preprocessor(cls, pre) -> "NemoLogMel":
        """From :class:`flashasr.models.parakeet.preprocessor.MelPreprocessor`."""
        cfg = pre.cfg
        if getattr(cfg, "pad_to", 0):
            raise AudioError("NemoLogMel does not implement pad_to > 0", code="unsupported_features")
        return cls(pre.fb, pre.window, n_fft=pre.n_fft, hop=pre.hop_length, preemph=cfg.preemph,
                   mag_power=cfg.mag_power, guard=pre._guard(), guard_type=cfg.log_zero_guard_type,
                   normalize=cfg.normalize, pad_value=cfg.pad_value, log=cfg.log)

    def output_lengths(self, lengths: torch.Tensor) -> torch.Tensor:
        """Valid feature frames for ``lengths`` samples (NeMo ``get_seq_len``)."""
        pad = (self.n_fft // 2) * 2
        return torch.div(lengths.long() + pad - self.n_fft, self.hop, rounding_mode="floor").clamp(min=0)

    @torch.no_grad()
    def forward(self, audio: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = audio.float()
        B, N = x.shape
        lengths = lengths.to(device=x.device, dtype=torch.long)
        flen = self.output_lengths(lengths)
        if self.preemph is not None and N > 1:
            x = torch.cat([x[:, :1], x[:, 1:] - self.preemph * x[:, :-1]], dim=1)
        x = x * (torch.arange(N, device=x.device)[None, :] < lengths[:, None])
        spec = torch.stft(x, n_fft=self.n_fft, hop_length=self.hop, win_length=self.win_length,
                          window=self.window, center=True, pad_mode="constant", return_complex=True)
        spec = torch.view_as_real(spec)
        mag = spec.pow(2).sum(-1).sqrt()
        if self.mag_power != 1.0:
            mag = mag.pow(self.mag_power)
        mel = torch.matmul(self.fb, mag)  # [B, n_mels, T]
        if self.log:
            mel = torch.log(mel + self.guard) if self.guard_type == "add" else torch.log(mel.clamp(min=self.guard))
        T = mel.shape[-1]
        tm = (torch.arange(T, device=x.device)[None, :] < flen[:, None])[:, None, :]  # [B, 1, T]
        if self.normalize in ("per_feature", "all_features"):
            dims = (2,) if self.normalize == "per_feature" else (1, 2)
            cnt = flen.to(mel.dtype).view(B, 1, 1) * (1 if self.normalize == "per_feature" else mel.shape[1])
            mean = torch.where(tm, mel, 0.0).sum(dims, keepdim=True) / cnt
            var = torch.where(tm, mel - mean, 0.0).pow(2).sum(dims, keepdim=True) / (cnt - 1.0)
            std = var.sqrt()
            std = torch.where(torch.isnan(std), 0.0, std) + _NORM_EPS
            mel = (mel - mean) / std
        mel = torch.where(tm, mel, self.pad_value)
        return mel, flen


class WhisperLogMel(torch.nn.Module):
    """Whisper log-mel, batched: ``audio [B, N]`` + ``lengths [B]`` -> ``[B, n_mels, (N + padding) // 160]``.

    Row ``b`` equals the reference on ``audio[b, :lengths[b]]`` with the same ``padding`` for its
    first ``(lengths[b] + padding) // 160`` frames (its own frames), provided the reflect padding
    at its end sees zeros, i.e. ``padding >= 200`` samples or ``lengths[b] == N``; the ``max - 8``
    clamp uses only those frames. Later frames hold the value of silence.
    """

    def __init__(self, n_mels: int = 80, n_fft: int = 400, hop: int = 160):
        super().__init__()
        from ..models.whisper.features import mel_filterbank

        self.register_buffer("fb", torch.from_numpy(mel_filterbank(n_mels)))
        self.register_buffer("window", torch.hann_window(n_fft, periodic=True, dtype=torch.float32))
        self.n_fft, self.hop = int(n_fft), int(hop)

    @torch.no_grad()
    def forward(self, audio: torch.Tensor, lengths: torch.Tensor, padding: int = 0) -> torch.Tensor:
        x = audio.float()
        B, N = x.shape
        lengths = lengths.to(device=x.device, dtype=torch.long)
        x = x * (torch.arange(N, device=x.device)[None, :] < lengths[:, None])
        if padding > 0:
            x = F.pad(x, (0, padding))
        if x.shape[1] <= self.n_fft // 2:
            x = F.pad(x, (0, self.n_fft // 2 + 1 - x.shape[1]))
        spec = torch.stft(x, self.n_fft, self.hop, window=self.window, center=True, pad_mode="reflect",
                          return_complex=True)
        power = spec[..., :-1].abs() ** 2
        mel = self.fb @ power
        log_spec = mel.clamp(min=1e-10).log10()
        T = log_spec.shape[-1]
        own = (torch.arange(T, device=x.device)[None, :] < ((lengths + padding) // self.hop)[:, None])[:, None, :]
        mx = torch.where(own, log_spec, -math.inf).amax(dim=(1, 2), keepdim=True)
        log_spec = torch.maximum(log_spec, mx - 8.0)
        return (log_spec + 4.0) / 4.0


class PinnedUploader:
    """Packs a list of 1-D float32 waveforms into a zero-padded ``[B, N]`` batch on ``device``.

    ``upload(waveforms, batch=None, samples=None)`` returns ``(audio [B', N'] float32 on device,
    lengths [B'] int64 on device)`` with ``B' = batch or len(waveforms)`` and
    ``N' = samples or max length`` (rows/samples beyond the inputs are zero); raises
    :class:`~flashasr.errors.AudioError`: ``invalid_audio`` for a waveform that is not 1-D,
    ``batch_too_small`` when the inputs do not fit.

    On CUDA the samples travel unpadded: joined end to end in a reusable pinned host buffer
    (:func:`_copy_rows`: no GIL release per row), one asynchronous copy (``non_blocking=True``) to
    the device, and one kernel there (``aten._jagged_to_padded_dense_forward``) spreads them into
    padded rows. The per-row numpy loop this replaces released and re-took the GIL twice per row:
    with other threads running Python (the offline job's writer and result threads) each re-take
    waits up to a GIL switch interval (H100 machine, 512 rows of 5-15 s, one other Python thread:
    638 ms against 69 ms alone, now 92 ms; ``bench/results/uploader_h100.json``). The host buffers
    are reused only after the previous copies finished (an event on ``device``'s current stream
    guards them). Batches of ``B * N >= 2**30`` samples are padded on the host instead.
    """

    def __init__(self, device: str | torch.device = "cuda"):
        self.device = torch.device(device)
        self.pin = self.device.type == "cuda" and torch.cuda.is_available()
        self._buf: torch.Tensor | None = None  # [capacity] float32 samples, pinned on CUDA
        self._offsets: torch.Tensor | None = None  # [capacity + 1] int64 row offsets, pinned on CUDA
        self._event = None

    def upload(self, waveforms: Sequence[np.ndarray], batch: int | None = None,
               samples: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        arrays = []
        for i, w in enumerate(waveforms):
            a = np.asarray(w)
            if a.ndim != 1:  # checked before the copy below, which makes a 0-d array 1-D
                raise AudioError(f"waveform {i}: expected mono samples of shape [N], got shape {a.shape}",
                                 code="invalid_audio")
            arrays.append(np.ascontiguousarray(a, dtype=np.float32))
        n = len(arrays)
        B = batch or n
        lens = [a.size for a in arrays]
        N = samples or max(lens, default=0)
        if n > B or any(m > N for m in lens):
            raise AudioError(f"{n} waveforms (longest {max(lens, default=0)} samples) do not fit "
                             f"a [{B}, {N}] batch", code="batch_too_small")
        if self.device.type != "cuda":
            return self._rows_on_host(arrays, lens, B, N)
        if B * N >= _JAGGED_LIMIT:  # the padding kernel indexes with 32-bit ints: pad on the host
            audio, lengths = self._rows_on_host(arrays, lens, B, N)
            return audio.to(self.device), lengths.to(self.device)
        if self._event is not None:
            self._event.synchronize()
        total = sum(lens)
        if self._buf is None or self._buf.numel() < total or self._offsets.numel() < B + 1:
            cap = max(total, 1 if self._buf is None else self._buf.numel())
            rows = max(B, 1 if self._offsets is None else self._offsets.numel() - 1)
            self._buf = torch.empty(cap, dtype=torch.float32, pin_memory=self.pin)
            self._offsets = torch.empty(rows + 1, dtype=torch.long, pin_memory=self.pin)
        flat = self._buf[:total]
        _copy_rows(flat.numpy(), arrays, list(itertools.accumulate(lens[:-1], initial=0)))
        off = self._offsets[: B + 1].numpy()
        off[0] = 0
        np.cumsum(lens, out=off[1: n + 1])
        off[n + 1:] = total  # padding rows: empty
        d_flat = flat.to(self.device, non_blocking=True)
        d_off = self._offsets[: B + 1].to(self.device, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream(self.device))  # where the copies were queued
        audio = torch.ops.aten._jagged_to_padded_dense_forward(d_flat.unsqueeze(-1), [d_off], [N], 0.0)
        return audio.view(B, N), d_off[1:] - d_off[:-1]

    @staticmethod
    def _rows_on_host(arrays: list[np.ndarray], lens: list[int], B: int, N: int):
        """On the host (the CPU device; CUDA batches over the kernel's limit): the rows of a fresh
        zero ``[B, N]`` array, filled by :func:`_copy_rows`, and the lengths."""
        audio = np.zeros((B, N), np.float32)
        _copy_rows(audio.reshape(-1), arrays, [i * N for i in range(len(arrays))])
        return torch.from_numpy(audio), torch.tensor(lens + [0] * (B - len(lens)), dtype=torch.long)


#: ``B * N`` from which :class:`PinnedUploader` pads on the host: the CUDA kernel of
#: ``_jagged_to_padded_dense_forward`` indexes its output with 32-bit ints (2**30: a margin below
#: its loop's overflow). The offline engine's largest batch is ~31 M samples.
_JAGGED_LIMIT = 1 << 30


def _copy_rows(dst: np.ndarray, arrays: list[np.ndarray], starts: list[int]) -> None:
    """Copy each float32 ``arrays[i]`` into the 1-D float32 ``dst`` at element ``starts[i]``.

    Through memoryview slices: a plain ``memcpy`` that keeps the GIL (numpy releases and re-takes
    it around every copy of more than a few hundred elements, which costs up to a GIL switch
    interval each while other threads run Python) and starts no intra-op threads (``torch.cat``
    into the same buffer was tried first: its OpenMP threads on cores the decode workers keep busy
    made it far slower than this under load).
    """
    view = memoryview(dst).cast("B")
    for a, s in zip(arrays, starts):
        if a.size:
            view[4 * s: 4 * s + a.nbytes] = memoryview(a).cast("B")


__all__ = ["NemoLogMel", "WhisperLogMel", "PinnedUploader"]
