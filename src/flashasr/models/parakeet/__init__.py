"""Parakeet-TDT (NVIDIA NeMo FastConformer + TDT) implemented in PyTorch; see docs/PARAKEET.md.

Entry points: :func:`load_parakeet` (a ``.nemo`` file), :func:`resolve_hub_id`
(``nvidia/parakeet-tdt-0.6b-v3`` -> local ``.nemo``); decoding interface in
:mod:`.decoder`. Random weights of a config for benchmarks: :mod:`flashasr.random_models`.
"""

from __future__ import annotations

__all__ = ["load_parakeet", "ParakeetASR", "resolve_hub_id"]


def __getattr__(name):  # lazy: importing the package does not import torch
    if name in ("load_parakeet", "ParakeetASR"):
        from . import model

        return getattr(model, name)
    if name == "resolve_hub_id":
        from .hub import resolve_hub_id

        return resolve_hub_id
    raise AttributeError(name)
