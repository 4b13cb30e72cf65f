"""GPU engine: static shapes, CUDA graphs, batched TDT decoding (see docs/ENGINE.md).

Parakeet-TDT fast path (engine engineer):

* :mod:`.tdt_graphs` - ``TDTGraphDecoder`` (label looping; ``full_graph`` / ``graphs_no_while`` /
  ``torch`` modes with fallback; its steps fused by :mod:`.tdt_fused`), :mod:`.cuda_conditional`
  (CUDA-graph WHILE nodes)
* :mod:`.profiles` - ``choose_profiles``, ``EncoderProfiles`` (one CUDA graph per shape profile)
* :mod:`.features_gpu` - ``NemoLogMel``, ``WhisperLogMel``, ``PinnedUploader``
* :mod:`.fast_attention` - faster full-context rel-pos attention for the FastConformer
* :mod:`.offline` - ``OfflineParakeetEngine`` (many waveforms -> tokens, pipelined)
* :mod:`.parakeet_gpu` - ``ParakeetGPUASR``, :mod:`.whisper_gpu` - ``WhisperGPUASR``: the engines
  behind the model interface (:func:`flashasr.pipeline.engines.accelerate` picks them)
* :mod:`.onnx_export` - ONNX export; :mod:`.trt_backend` - EXPERIMENTAL, never built or run

Names are imported lazily (``from flashasr.engine import OfflineParakeetEngine``) so importing
the package does not load torch.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "TDTGraphDecoder": ".tdt_graphs", "DecodeMode": ".tdt_graphs", "TDTDecodeOutput": ".tdt_graphs",
    "Profile": ".profiles", "EncoderProfiles": ".profiles", "choose_profiles": ".profiles",
    "NemoLogMel": ".features_gpu", "WhisperLogMel": ".features_gpu", "PinnedUploader": ".features_gpu",
    "OfflineParakeetEngine": ".offline", "install_fast_attention": ".fast_attention",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_LAZY)
