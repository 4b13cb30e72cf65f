"""EXPERIMENTAL -- never built or run: an optional TensorRT backend for the Parakeet encoder, behind the interface of
:class:`~flashasr.engine.profiles.EncoderProfiles` (``select``, ``run``, ``warmup``,
``memory_report``, ``profiles``).

Status: NOT built or run anywhere yet. TensorRT is not installed on the CPU machines nor on the
device image (no ``tensorrt`` package; nothing can be fetched there), so only the pure-Python
translation below is tested. :class:`TRTEncoderProfiles` raises
:class:`TensorRTUnavailableError` (``code = "tensorrt_unavailable"``) when ``tensorrt`` cannot be
imported; callers keep the PyTorch :class:`EncoderProfiles`.

Design: the ONNX encoder from :func:`flashasr.engine.onnx_export.export_parakeet_encoder`
(``features [B, n_mels, T]`` + ``lengths [B]`` -> ``encoded [B, T', d|J]`` + ``encoded_lengths``)
is built into ONE TensorRT engine with ONE optimisation profile per shape profile
(:func:`optimization_profiles`): for a :class:`Profile` ``(batch, seconds)`` the feature frames are
``samples // hop + 1`` (NeMo's centred STFT), ``max = opt = (batch, n_mels, frames)`` (profile
batches are padded to exactly that shape, as in :class:`EncoderProfiles`) and
``min = (1, n_mels, min_frames)`` so an unpadded smaller batch is also valid. At run time the log-mel
runs in PyTorch on the GPU (:class:`~flashasr.engine.features_gpu.NemoLogMel`), the execution
context switches to the profile's index and the engine writes into preallocated torch tensors.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

EXPERIMENTAL = True  # no engine choice, door or benchmark uses this module; only its pure-Python parts are tested

from ..errors import FlashASRError
from .profiles import Profile

__all__ = ["TRTShapes", "optimization_profiles", "select_profile", "tensorrt_available",
           "TensorRTUnavailableError", "TRTEncoderProfiles"]

Shape = tuple[int, ...]


class TensorRTUnavailableError(FlashASRError):
    """The ``tensorrt`` Python package (or CUDA) is not available on this machine."""

    code = "tensorrt_unavailable"
    status = 501


class TRTProfileError(FlashASRError):
    """Bad shape profiles for a TensorRT engine, or no profile fits a batch."""

    code = "invalid_profiles"
    status = 400


def tensorrt_available() -> bool:
    """True when ``import tensorrt`` can work and CUDA is present."""
    return importlib.util.find_spec("tensorrt") is not None and torch.cuda.is_available()


@dataclass(frozen=True)
class TRTShapes:
    """One TensorRT optimisation profile: ``inputs[name] = (min, opt, max)`` shapes."""

    profile: Profile
    inputs: dict = field(hash=False)

    @property
    def max_batch(self) -> int:
        return self.inputs["features"][2][0]

    @property
    def max_frames(self) -> int:
        return self.inputs["features"][2][2]


def optimization_profiles(profiles: Sequence[Profile], *, n_mels: int, hop_length: int = 160,
                          min_frames: int = 1) -> list[TRTShapes]:
    """Translate encoder shape profiles into TensorRT optimisation-profile shapes.

    Args:
        profiles: :class:`Profile` list (batch rows x seconds of 16 kHz audio).
        n_mels: feature bins of the model's preprocessor.
        hop_length: STFT hop in samples (160 = 10 ms at 16 kHz); frames = ``samples // hop + 1``.
        min_frames: smallest frame count each profile accepts.
    Returns:
        one :class:`TRTShapes` per profile, in the given order; inputs ``features``
        ``(1, n_mels, min_frames) / (B, n_mels, F) / (B, n_mels, F)`` and ``lengths`` ``(1,) / (B,) / (B,)``.
    Raises:
        TRTProfileError: no profiles, or a profile with batch < 1 or no samples.
    """
    if not profiles:
        raise TRTProfileError("a TensorRT engine needs at least one shape profile")
    out = []
    for p in profiles:
        if p.batch < 1 or p.samples < 1:
            raise TRTProfileError(f"invalid profile {p}: batch and seconds must be positive")
        frames = p.samples // int(hop_length) + 1
        lo = max(1, min(int(min_frames), frames))
        out.append(TRTShapes(p, {"features": ((1, n_mels, lo), (p.batch, n_mels, frames), (p.batch, n_mels, frames)),
                                 "lengths": ((1,), (p.batch,), (p.batch,))}))
    return out


def select_profile(shapes: Sequence[TRTShapes], *, batch: int, frames: int) -> int:
    """Index of the cheapest optimisation profile (fewest ``max_batch x max_frames``, then fewest
    frames) holding ``batch`` rows of ``frames`` feature frames (the rule of
    :meth:`EncoderProfiles.select`). Raises :class:`TRTProfileError` when none does."""
    fit = [i for i, s in enumerate(shapes) if batch <= s.max_batch and frames <= s.max_frames]
    if not fit:
        raise TRTProfileError(f"no TensorRT profile holds {batch} rows of {frames} frames", code="batch_too_large")
    return min(fit, key=lambda i: (shapes[i].max_batch * shapes[i].max_frames, shapes[i].max_frames))


class TRTEncoderProfiles:  # pragma: no cover - needs TensorRT + CUDA (neither is available to CI or the device)
    """TensorRT counterpart of :class:`~flashasr.engine.profiles.EncoderProfiles`.

    Build with :meth:`from_onnx`. ``run(audio [B, N] float32, lengths [B]) -> (out [B, T_p, J|d],
    enc_lengths [B])`` for the selected profile (outputs are views of per-profile buffers,
    overwritten by the next run of that profile, as with CUDA graphs).
    """

    def __init__(self, engine, shapes: list[TRTShapes], features: torch.nn.Module | None, trt_module):
        self._trt = trt_module
        self.engine = engine
        self.shapes = shapes
        self.profiles = [s.profile for s in shapes]
        self.features = features
        self.context = engine.create_execution_context()
        self.stream = torch.cuda.Stream()
        self._outs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def from_onnx(cls, onnx_path: str | os.PathLike, profiles: Sequence[Profile], *, n_mels: int,
                  model=None, hop_length: int = 160, precision: str = "bf16", workspace_gib: float = 8.0,
                  cache_path: str | os.PathLike | None = None) -> "TRTEncoderProfiles":
        """Build (or load from ``cache_path``) an engine with one optimisation profile per profile.

        Args:
            onnx_path: from :func:`~flashasr.engine.onnx_export.export_parakeet_encoder`.
            model: the Parakeet model whose preprocessor gives the GPU log-mel (None: :meth:`run`
                then takes features instead of audio).
            precision: ``"bf16"``, ``"fp16"`` or ``"fp32"`` builder flags.
        Raises:
            TensorRTUnavailableError: ``tensorrt`` cannot be imported or no CUDA device.
            TRTProfileError: bad profiles. FlashASRError(``trt_build_failed``): parse/build errors.
        """
        if not tensorrt_available():
            raise TensorRTUnavailableError("TensorRT backend unavailable: the 'tensorrt' package is not installed "
                                           "or no CUDA device is present; use EncoderProfiles (PyTorch) instead")
        import tensorrt as trt

        shapes = optimization_profiles(profiles, n_mels=n_mels, hop_length=hop_length)
        logger = trt.Logger(trt.Logger.WARNING)
        runtime = trt.Runtime(logger)
        blob = Path(cache_path).read_bytes() if cache_path and Path(cache_path).is_file() else None
        if blob is None:
            builder = trt.Builder(logger)
            network = builder.create_network(0)
            parser = trt.OnnxParser(network, logger)
            if not parser.parse(Path(onnx_path).read_bytes()):
                errs = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
                raise FlashASRError(f"TensorRT could not parse {onnx_path}: {errs}", code="trt_build_failed")
            config = builder.create_builder_config()
            config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * 2**30))
            if precision == "bf16":
                config.set_flag(trt.BuilderFlag.BF16)
            elif precision == "fp16":
                config.set_flag(trt.BuilderFlag.FP16)
            for s in shapes:
                op = builder.create_optimization_profile()
                for name, (lo, opt, hi) in s.inputs.items():
                    op.set_shape(name, lo, opt, hi)
                config.add_optimization_profile(op)
            blob = builder.build_serialized_network(network, config)
            if blob is None:
                raise FlashASRError("TensorRT engine build failed", code="trt_build_failed")
            blob = bytes(blob)
            if cache_path:
                Path(cache_path).write_bytes(blob)
        engine = runtime.deserialize_cuda_engine(blob)
        feats = None
        if model is not None:
            from .features_gpu import NemoLogMel

            feats = NemoLogMel.from_preprocessor(model.preprocessor).cuda()
        return cls(engine, shapes, feats, trt)

    def select(self, n_items: int, max_samples: int) -> Profile:
        """Cheapest profile holding ``n_items`` rows of ``max_samples`` samples."""
        frames = max_samples // 160 + 1
        return self.shapes[select_profile(self.shapes, batch=n_items, frames=frames)].profile

    def warmup(self, profiles=None) -> None:
        """Nothing to capture: engines are built ahead (kept for interface parity)."""

    @torch.no_grad()
    def run(self, audio: torch.Tensor, lengths: torch.Tensor, profile: Profile | None = None):
        """Audio ``[B, N]`` (or features ``[B, n_mels, T]`` when built without a model) -> outputs."""
        if self.features is not None:
            feats, flen = self.features(audio.cuda().float(), lengths.cuda())
        else:
            feats, flen = audio.cuda().float(), lengths.cuda()
        B, _, T = feats.shape
        idx = select_profile(self.shapes, batch=B, frames=T) if profile is None else self.profiles.index(profile)
        ctx = self.context
        ctx.set_optimization_profile_async(idx, self.stream.cuda_stream)
        feats = feats.contiguous()
        flen = flen.long().contiguous()
        ctx.set_input_shape("features", tuple(feats.shape))
        ctx.set_input_shape("lengths", tuple(flen.shape))
        out = torch.empty(tuple(ctx.get_tensor_shape("encoded")), device="cuda",
                          dtype=torch.float32)
        out_len = torch.empty(tuple(ctx.get_tensor_shape("encoded_lengths")), device="cuda", dtype=torch.long)
        for name, t in (("features", feats), ("lengths", flen), ("encoded", out), ("encoded_lengths", out_len)):
            ctx.set_tensor_address(name, t.data_ptr())
        self.stream.wait_stream(torch.cuda.current_stream())
        if not ctx.execute_async_v3(self.stream.cuda_stream):
            raise FlashASRError("TensorRT execution failed", code="trt_run_failed")
        torch.cuda.current_stream().wait_stream(self.stream)
        self._outs[idx] = (out, out_len)
        return out, out_len

    def memory_report(self) -> list[dict]:
        return [{"batch": p.batch, "seconds": p.seconds, "backend": "tensorrt",
                 "device_memory_mib": round(self.engine.device_memory_size / 2**20, 1)} for p in self.profiles]



