"""Encoder shape profiles: a few static (batch, seconds) shapes, each captured as a CUDA graph.

A *profile* is a static input shape ``[batch, seconds * 16000]`` samples. Profiles are chosen
from a distribution of input lengths (:func:`choose_profiles`): the length boundaries are
quantiles of the distribution (plus the maximum), and each profile's batch is set so every
profile holds about the same number of audio seconds (same work per launch). A request batch
runs in the smallest profile that fits (:meth:`EncoderProfiles.select`): a 1 s clip is never
padded to 30 s.

Each profile runs the whole front part of the model on static buffers -- GPU log-mel
(:class:`~flashasr.engine.features_gpu.NemoLogMel`), the FastConformer encoder, and the joint's
encoder projection -- and on CUDA is captured once as a CUDA graph (optionally after
``torch.compile``). All profiles share ONE copy of the weights and one graph memory pool (they
never run concurrently), so activation memory is that of the largest profile, not the sum.

Precision (:func:`prepare_encoder_precision`): matrix weights in bf16, LayerNorm/BatchNorm in
float32 (inputs upcast, outputs cast back), log-mel in float32; the joint projection is
returned in the decoder's dtype.

On CPU (or ``use_graphs=False``) the same interface runs eagerly.

Padding invariance: valid encoder frames of a row do not depend on the padding of its batch
(NeMo 3.0.0 masks padded time steps in the subsampling, attention and convolution), so the
output of a padded profile equals the unpadded output on valid frames (tested).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import torch

from ..errors import AudioTooLongError, FlashASRError
from .capture import graph_capture
from .features_gpu import NemoLogMel

log = logging.getLogger(__name__)

SAMPLE_RATE = 16_000
# Quantiles (10/25/50/75/90/100 %) of the durations of the speech clips <= 30 s with a transcript in
# ../shared/audio (109 clips; LibriSpeech, FLEURS, VoxPopuli, ...), rounded up to 80 ms frames.
DEFAULT_BOUNDARIES_S = (2.08, 4.16, 8.48, 11.12, 14.48, 20.0, 30.0)
DEFAULT_SECONDS_PER_BATCH = 1920.0  # audio seconds held by one profile launch (= 64 x 30 s)


@dataclass(frozen=True)
class Profile:
    """A static input shape: ``batch`` rows of at most ``seconds`` of 16 kHz audio."""

    batch: int
    seconds: float

    def __post_init__(self):
        ok_b = isinstance(self.batch, (int, np.integer)) and not isinstance(self.batch, bool) and self.batch >= 1
        try:
            ok_s = math.isfinite(float(self.seconds)) and float(self.seconds) > 0
        except (TypeError, ValueError):
            ok_s = False
        if not (ok_b and ok_s):
            raise FlashASRError(f"invalid profile (batch={self.batch!r}, seconds={self.seconds!r}): batch must be an "
                                f"integer >= 1 and seconds a finite number > 0", code="invalid_profiles")

    @property
    def samples(self) -> int:
        return int(round(self.seconds * SAMPLE_RATE))

    def fits(self, n_items: int, max_samples: int) -> bool:
        return n_items <= self.batch and max_samples <= self.samples


def _round_frames(s: float, frame_s: float = 0.08) -> float:
    return round(math.ceil(s / frame_s - 1e-9) * frame_s, 2)


def choose_profiles(durations_s: Iterable[float] | None = None, *, n_profiles: int = 5,
                    max_seconds: float = 30.0, seconds_per_batch: float = DEFAULT_SECONDS_PER_BATCH,
                    max_batch: int = 512, batch_multiple: int = 8,
                    small_batches: Sequence[int] = (1, 8)) -> list[Profile]:
    """Pick profiles for a length distribution.

    Args:
        durations_s: input lengths in seconds (None: :data:`DEFAULT_BOUNDARIES_S`, measured on
            real speech). Lengths above ``max_seconds`` are ignored (callers cut long audio).
        n_profiles: number of length boundaries from the quantiles (``max_seconds`` is always
            one more); duplicates are merged.
        seconds_per_batch: audio seconds per profile launch; ``batch = seconds_per_batch /
            boundary``, rounded down to ``batch_multiple``, clamped to ``[1, max_batch]``.
        small_batches: extra batch sizes per boundary (below the full batch) so that small
            requests (one file, a streaming chunk) do not run in a huge batch.
    Returns:
        profiles sorted by seconds (ascending).
    """
    def bad(msg):
        return FlashASRError(f"choose_profiles: {msg}", code="invalid_profiles")

    if isinstance(n_profiles, bool) or not isinstance(n_profiles, int) or n_profiles < 1:
        raise bad(f"n_profiles must be an integer >= 1, got {n_profiles!r}")
    for name, v in (("max_seconds", max_seconds), ("seconds_per_batch", seconds_per_batch)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise bad(f"{name} must be a finite number > 0, got {v!r}")
    for name, v in (("max_batch", max_batch), ("batch_multiple", batch_multiple)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise bad(f"{name} must be an integer >= 1, got {v!r}")
    if isinstance(durations_s, (str, bytes)):
        raise bad("durations_s must be numbers (seconds), not a string")
    if durations_s is None:
        bounds = list(DEFAULT_BOUNDARIES_S)
    else:
        ds = sorted(float(d) for d in durations_s if 0 < float(d) <= max_seconds)
        if not ds:
            raise FlashASRError("choose_profiles: no durations in (0, max_seconds]", code="invalid_profiles")
        qs = [(i + 1) / n_profiles for i in range(n_profiles)]
        bounds = [ds[min(len(ds) - 1, int(math.ceil(q * len(ds))) - 1)] for q in qs]
    bounds = sorted({_round_frames(min(b, max_seconds)) for b in bounds} | {_round_frames(max_seconds)})
    out = []
    for b in bounds:
        batch = int(seconds_per_batch / b)
        if batch >= batch_multiple:
            batch -= batch % batch_multiple
        full = max(1, min(max_batch, batch))
        for sb in sorted({int(x) for x in small_batches if 0 < int(x) < full} | {full}):
            out.append(Profile(sb, b))
    return out


class _Fp32Norm:
    """Mixin: LayerNorm/BatchNorm with float32 parameters, statistics and arithmetic whatever
    the input dtype. On CUDA the native kernels take a bf16/fp16 input with float32 parameters
    directly (float32 arithmetic inside, output in the input dtype); elsewhere, or if the
    mixed call is refused, the input is upcast and the output cast back."""

    _mixed_ok = True

    def forward(self, x):  # noqa: D401
        if x.dtype != torch.float32 and x.is_cuda and type(self)._mixed_ok:
            try:
                y = super().forward(x)
                if y.dtype == x.dtype:
                    return y
                return y.to(x.dtype)
            except RuntimeError:
                type(self)._mixed_ok = False
        return super().forward(x.float()).to(x.dtype)


class _Fp32LayerNorm(_Fp32Norm, torch.nn.LayerNorm):
    pass


class _Fp32BatchNorm1d(_Fp32Norm, torch.nn.BatchNorm1d):
    pass


def prepare_encoder_precision(encoder: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Cast ``encoder`` in place to ``dtype`` with LayerNorm/BatchNorm kept in float32.

    Idempotent; returns the same module (one copy of the weights).
    """
    encoder.to(dtype)
    if dtype == torch.float32:
        return encoder
    for mod in encoder.modules():
        if type(mod) is torch.nn.LayerNorm:
            mod.__class__ = _Fp32LayerNorm
        elif type(mod) is torch.nn.BatchNorm1d:
            mod.__class__ = _Fp32BatchNorm1d
        if isinstance(mod, (_Fp32LayerNorm, _Fp32BatchNorm1d)):
            mod.float()
    return encoder


class _Runner:
    """Static buffers (+ graph) of one profile."""

    def __init__(self, owner: "EncoderProfiles", p: Profile):
        self.p = p
        dev = owner.device
        self.audio = torch.zeros(p.batch, p.samples, dtype=torch.float32, device=dev)
        self.lengths = torch.zeros(p.batch, dtype=torch.long, device=dev)
        self.out = None
        self.out_len = None
        self.graph = None
        self.fn = owner._forward
        self.memory_bytes = 0
        self.capture_seconds = 0.0


class EncoderProfiles:
    """Front part of a Parakeet model (log-mel -> encoder -> joint encoder projection) on
    static profiles.

    Args:
        model: a :class:`flashasr.models.parakeet.model.ParakeetASR` (uses ``preprocessor``,
            ``encoder`` and ``joint``); its encoder is converted in place by
            :func:`prepare_encoder_precision` when ``dtype`` is given.
        profiles: list of :class:`Profile` (default :func:`choose_profiles()`).
        dtype: encoder dtype (default ``torch.bfloat16`` on CUDA, float32 on CPU).
        project: also apply ``joint.project_encoder`` (output ``[B, T, J]`` in the joint's
            dtype) - what :class:`~flashasr.engine.tdt_graphs.TDTGraphDecoder` takes with
            ``projected=True``; otherwise the encoder output ``[B, T, d]``.
        use_graphs: capture each profile as a CUDA graph (CUDA only).
        cudnn_benchmark: set ``torch.backends.cudnn.benchmark`` (process-wide) so cuDNN times
            its convolution algorithms for each profile shape at capture.
        conv_channels_last: store the subsampling Conv2d weights channels-last (NHWC).
        fast_attention: swap the encoder's full-context attention for
            :mod:`flashasr.engine.fast_attention` (checked equal at install; skipped if not).
        compile: ``torch.compile`` the forward before capturing: False, "dynamic" (one
            compilation with symbolic batch/length shared by all profiles; ``True`` means this)
            or "static" (one compilation per profile shape).
        fuse: apply :func:`flashasr.engine.fuse.fuse_encoder` (exact-math inference fusions:
            BatchNorm folded into the depthwise conv, redundant subsampling masks skipped, ...)
            to the encoder in place before the precision cast; ``False`` keeps it unfused; a
            sequence of transform names picks them (e.g. ``ALL_TRANSFORMS + EXTRA_TRANSFORMS``).
            Counts per transform in ``self.fusions``.
    """

    def __init__(self, model, profiles: Sequence[Profile] | None = None, *, dtype: torch.dtype | None = None,
                 project: bool = True, use_graphs: bool = True, compile: bool | str = False,
                 cudnn_benchmark: bool = False, conv_channels_last: bool = False, fast_attention: bool = True,
                 fuse: bool | Sequence[str] = True):
        self.model = model
        self.device = next(model.encoder.parameters()).device
        cuda = self.device.type == "cuda"
        self.dtype = dtype or (torch.bfloat16 if cuda else torch.float32)
        self.fusions: dict = {}
        if fuse:
            if model.encoder.training:
                log.warning("encoder in training mode: inference fusions skipped")
            else:
                from .fuse import ALL_TRANSFORMS, fuse_encoder

                self.fusions = fuse_encoder(model.encoder, ALL_TRANSFORMS if fuse is True else tuple(fuse))
        prepare_encoder_precision(model.encoder, self.dtype)
        self.fast_attention_modules = 0
        if fast_attention:
            from .fast_attention import install_fast_attention

            self.fast_attention_modules = install_fast_attention(model.encoder)
        if cuda and cudnn_benchmark:
            torch.backends.cudnn.benchmark = True
        if cuda and conv_channels_last:
            for m in model.encoder.modules():
                if isinstance(m, torch.nn.Conv2d):
                    m.to(memory_format=torch.channels_last)
        self.features = NemoLogMel.from_preprocessor(model.preprocessor).to(self.device)
        self.project = project
        self.use_graphs = bool(use_graphs and cuda)
        self.compile = ("dynamic" if compile is True else compile) if (compile and cuda) else False
        self.profiles = sorted(profiles or choose_profiles(), key=lambda p: (p.seconds, p.batch))
        self._runners = {p: _Runner(self, p) for p in self.profiles}
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self._compiled = None
        self.events: list[str] = []

    # ------------------------------------------------------------------ computation
    def _forward(self, audio: torch.Tensor, lengths: torch.Tensor):
        feats, flen = self.features(audio, lengths)
        enc, enc_len = self.model.encoder(feats, flen, channels_last=True)
        if self.project:
            j = self.model.joint
            enc = j.project_encoder(enc.to(next(j.parameters()).dtype))
        return enc, enc_len

    @torch.no_grad()
    def forward_eager(self, audio: torch.Tensor, lengths: torch.Tensor):
        """Unpadded eager run at the given shape: ``audio [B, N]``, ``lengths [B]`` ->
        ``(out [B, T, J or d], enc_lengths [B])``."""
        return self._forward(audio.to(self.device), lengths.to(self.device))

    def select(self, n_items: int, max_samples: int) -> Profile:
        """Cheapest profile (fewest padded samples ``batch x samples``, then shortest) that holds
        ``n_items`` rows of ``max_samples``; raises :class:`AudioTooLongError` if none does."""
        fit = [p for p in self.profiles if p.fits(n_items, max_samples)]
        if fit:
            return min(fit, key=lambda p: (p.batch * p.samples, p.samples))
        biggest = max(self.profiles, key=lambda p: p.samples)
        if max_samples > biggest.samples:
            raise AudioTooLongError(f"input of {max_samples} samples ({max_samples / SAMPLE_RATE:.4f} s) exceeds the "
                                    f"largest encoder profile ({biggest.samples} samples, {biggest.seconds} s); "
                                    f"cut long audio first")
        raise FlashASRError(f"{n_items} rows exceed every profile's batch", code="batch_too_large")

    def _capture(self, r: _Runner):
        fn = self._forward
        if self.compile:
            if self._compiled is None:
                self._compiled = torch.compile(self._forward, dynamic=self.compile == "dynamic")
            fn = self._compiled
        t0 = time.perf_counter()
        r.lengths.fill_(r.p.samples)
        r.audio.normal_(0, 0.1)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.no_grad():
            for _ in range(2):
                fn(r.audio, r.lengths)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        before = torch.cuda.memory_reserved()
        g = torch.cuda.CUDAGraph()
        with torch.no_grad(), graph_capture(g, pool=self._pool, stream=stream):
            r.out, r.out_len = fn(r.audio, r.lengths)
        torch.cuda.synchronize()
        r.memory_bytes = torch.cuda.memory_reserved() - before + r.audio.numel() * 4
        r.graph = g
        r.capture_seconds = time.perf_counter() - t0

    def warmup(self, profiles: Sequence[Profile] | None = None) -> None:
        """Capture the graphs of ``profiles`` (default all), largest first (memory reuse)."""
        if not self.use_graphs:
            return
        for p in sorted(profiles or self.profiles, key=lambda p: -p.batch * p.samples):
            if self._runners[p].graph is None:
                self._capture(self._runners[p])

    @torch.no_grad()
    def run(self, audio: torch.Tensor, lengths: torch.Tensor, profile: Profile | None = None):
        """Run a batch in a profile.

        Args:
            audio: ``[B, N]`` float32 (any device), ``lengths [B]`` samples.
            profile: the profile to use (default :meth:`select`).
        Returns:
            ``(out, enc_lengths)``: ``out [B, T_p, J]`` (or ``[B, T_p, d]``) for the profile's
            frame count ``T_p``; rows valid up to ``enc_lengths``. With graphs, ``out`` is a view
            of the profile's static output: it is overwritten by the next run of any profile.
        """
        B, N = audio.shape
        p = profile or self.select(B, N)
        if not p.fits(B, N):
            raise FlashASRError(f"batch [{B}, {N}] does not fit profile {p}", code="batch_too_large")
        r = self._runners[p]
        r.audio[:B, :N].copy_(audio, non_blocking=True)
        if N < p.samples:
            r.audio[:B, N:].zero_()
        if B < p.batch:
            r.audio[B:].zero_()
        r.lengths.zero_()
        r.lengths[:B].copy_(lengths, non_blocking=True)
        if self.use_graphs:
            if r.graph is None:
                self._capture(r)
                r.audio[:B, :N].copy_(audio)
                r.audio[:B, N:].zero_()
                r.audio[B:].zero_()
                r.lengths.zero_()
                r.lengths[:B].copy_(lengths)
            r.graph.replay()
            return r.out[:B], r.out_len[:B]
        out, out_len = self._forward(r.audio, r.lengths)
        return out[:B], out_len[:B]

    def memory_report(self) -> list[dict]:
        """Per profile: shape, captured or not, extra reserved bytes at capture, capture seconds."""
        return [{"batch": p.batch, "seconds": p.seconds, "captured": r.graph is not None,
                 "memory_mib": round(r.memory_bytes / 2**20, 1), "capture_s": round(r.capture_seconds, 2)}
                for p, r in self._runners.items()]


__all__ = ["Profile", "choose_profiles", "EncoderProfiles", "prepare_encoder_precision",
           "DEFAULT_BOUNDARIES_S"]
