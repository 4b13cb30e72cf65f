"""ONNX export of the encoders (Parakeet FastConformer, Whisper) with dynamic batch and time axes.

The exported graphs are traced from OUR PyTorch modules (the same weights; nothing is copied into
a second implementation) with the TorchScript-based exporter (``torch.onnx.export(...,
dynamo=False)``; the torch.export-based one needs ``onnxscript``, which the project does not
depend on), opset 17, float32. They are the input of the optional TensorRT backend
(:mod:`flashasr.engine.trt_backend`) and can run in onnxruntime (what the tests check).

* Parakeet: ``features [B, n_mels, T] float32`` + ``lengths [B] int64`` (feature frames) ->
  ``encoded [B, T', d]`` (channels last; or ``[B, T', J]`` with ``project=True``: the joint's
  encoder projection, what :class:`~flashasr.engine.profiles.EncoderProfiles` returns) +
  ``encoded_lengths [B] int64``; ``T' = ceil-ish(T / 8)`` (3 stride-2 convolutions). Full
  attention context only (the encoder's ``att_context_size`` must be ``[-1, -1]`` at export; a
  local-attention model is exported with full attention refused, see :func:`export_parakeet_encoder`).
  Batches are never split inside the graph (the eager module splits batches whose subsampling
  activation exceeds 2^31 elements; keep ONNX batches below that).
* Whisper: ``mel [B, n_mels, T] float32`` -> ``features [B, T / 2, D]``. The reference model takes
  exactly ``T = 3000`` (30 s); the exported graph also accepts shorter even ``T`` by using the first
  ``T / 2`` rows of the sinusoidal position table (equal to the reference at ``T = 3000``; a
  shorter input is NOT what Whisper was trained on: useful for tests and experiments only).

Errors: :class:`OnnxExportError` (``code = "onnx_export_failed"``) when the exporter fails or the
model is not exportable as configured.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import FlashASRError

__all__ = ["OnnxExportError", "ParakeetEncoderForExport", "WhisperEncoderForExport", "export_parakeet_encoder",
           "export_whisper_encoder", "OPSET"]

OPSET = 17


class OnnxExportError(FlashASRError):
    """The encoder could not be exported to ONNX (exporter error, unsupported configuration)."""

    code = "onnx_export_failed"
    status = 500


class ParakeetEncoderForExport(nn.Module):
    """``(features [B, F, T], lengths [B]) -> (encoded [B, T', d or J], encoded_lengths [B])``:
    the FastConformer encoder in channels-last layout, optionally followed by the joint's encoder
    projection (``project=True``). Holds references to the model's modules (no weight copy)."""

    def __init__(self, model, project: bool = False):
        super().__init__()
        self.encoder = model.encoder
        self.proj = model.joint.enc if project else None

    def forward(self, features: torch.Tensor, lengths: torch.Tensor):
        enc, enc_len = self.encoder(features, lengths, channels_last=True)
        if self.proj is not None:
            enc = self.proj(enc.to(self.proj.weight.dtype))
        return enc, enc_len


class WhisperEncoderForExport(nn.Module):
    """``mel [B, n_mels, T] -> [B, T/2, D]``: :meth:`WhisperModel.encode` with the position table
    sliced to the input length (identical to ``encode`` at ``T = 2 * n_audio_ctx``)."""

    def __init__(self, model):
        super().__init__()
        self.enc = model.encoder

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        e = self.enc
        x = mel.to(e.conv1.weight.dtype)
        x = F.gelu(e.conv1(x))
        x = F.gelu(e.conv2(x)).transpose(1, 2)
        x = x + e.positions[: x.shape[1]].to(x.dtype)
        for layer in e.layers:
            x = layer(x)
        return e.norm(x)


def _export(module: nn.Module, args: tuple, path: Path, input_names, output_names, dynamic_axes) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    module = module.eval()
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # tracer / deprecation chatter
            torch.onnx.export(module, args, str(path), dynamo=False, opset_version=OPSET,
                              input_names=list(input_names), output_names=list(output_names),
                              dynamic_axes=dynamic_axes, do_constant_folding=True)
    except Exception as e:  # noqa: BLE001 - the exporter raises many types
        raise OnnxExportError(f"ONNX export to {path} failed: {type(e).__name__}: {e}") from e
    return path


def export_parakeet_encoder(model, path: str | os.PathLike, *, project: bool = False,
                            example_frames: int = 400, example_batch: int = 2) -> Path:
    """Export a Parakeet model's encoder (float32, CPU trace) to ``path``.

    Args:
        model: :class:`~flashasr.models.parakeet.model.ParakeetASR` (float32 weights).
        project: append the joint's encoder projection (output ``[B, T', J]``).
        example_frames / example_batch: shape of the tracing example (any; axes are dynamic).
    Returns:
        the path written. Inputs ``features`` ``[batch, n_mels, frames]`` float32, ``lengths``
        ``[batch]`` int64; outputs ``encoded`` ``[batch, enc_frames, d]``, ``encoded_lengths``.
    Raises:
        OnnxExportError: non-float32 weights, a local attention context, or an exporter failure.
    """
    enc = model.encoder
    if next(enc.parameters()).dtype != torch.float32:
        raise OnnxExportError("export needs float32 encoder weights (load the model with dtype=float32)",
                              code="onnx_export_unsupported")
    left, right = enc.att_context_size
    if left >= 0 or right >= 0:
        raise OnnxExportError(f"export supports full attention only; att_context_size is {[left, right]} "
                              "(set_attention_context([-1, -1]) first)", code="onnx_export_unsupported")
    wrapper = ParakeetEncoderForExport(model, project=project).cpu()
    n_mels = enc.cfg.feat_in
    feats = torch.randn(example_batch, n_mels, example_frames)
    lengths = torch.full((example_batch,), example_frames, dtype=torch.long)
    lengths[-1] = max(1, example_frames * 3 // 4)
    return _export(wrapper, (feats, lengths), path, ["features", "lengths"], ["encoded", "encoded_lengths"],
                   {"features": {0: "batch", 2: "frames"}, "lengths": {0: "batch"},
                    "encoded": {0: "batch", 1: "enc_frames"}, "encoded_lengths": {0: "batch"}})


def export_whisper_encoder(model, path: str | os.PathLike, *, example_frames: int = 3000,
                           example_batch: int = 1) -> Path:
    """Export a Whisper model's encoder (float32) to ``path``.

    Args:
        model: :class:`~flashasr.models.whisper.model.WhisperModel` (or a ``WhisperASR``; its
            ``.model`` is used), float32 weights.
    Returns:
        the path written. Input ``mel`` ``[batch, n_mels, frames]`` (even ``frames`` <= 3000),
        output ``features`` ``[batch, frames / 2, D]``.
    Raises:
        OnnxExportError: non-float32 weights or an exporter failure.
    """
    m = getattr(model, "model", model)
    if next(m.parameters()).dtype != torch.float32:
        raise OnnxExportError("export needs float32 weights (load the model with dtype=float32)",
                              code="onnx_export_unsupported")
    wrapper = WhisperEncoderForExport(m).cpu()
    mel = torch.randn(example_batch, m.dims.n_mels, example_frames)
    return _export(wrapper, (mel,), path, ["mel"], ["features"],
                   {"mel": {0: "batch", 2: "frames"}, "features": {0: "batch", 1: "enc_frames"}})
