"""Parakeet-TDT (NVIDIA NeMo FastConformer + TDT) implemented in PyTorch; see docs/PARAKEET.md.

Entry points: :func:`load_parakeet` (a ``.nemo`` file), :func:`resolve_hub_id`
(``nvidia/parakeet-tdt-0.6b-v3`` -> local ``.nemo``), :func:`build_random_parakeet`
(architecture from a yaml, random weights); decoding interface in :mod:`.decoder`.
"""

from __future__ import annotations

__all__ = ["load_parakeet", "ParakeetASR", "build_random_parakeet", "resolve_hub_id"]


def __getattr__(name):  # lazy: importing the package does not import torch
    if name in ("load_parakeet", "ParakeetASR"):
        from . import model

        return getattr(model, name)
    if name == "build_random_parakeet":
        from .config import build_random_parakeet

        return build_random_parakeet
    if name == "resolve_hub_id":
        from .hub import resolve_hub_id

        return resolve_hub_id
    raise AttributeError(name)
