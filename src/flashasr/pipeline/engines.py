"""The one place that picks the engine for a model on a device, and the model loader of the doors.

==================  ============  ====================================================
family              device        runs on
==================  ============  ====================================================
Parakeet-TDT        CUDA          :class:`~flashasr.engine.parakeet_gpu.ParakeetGPUASR`
                                  (encoder shape profiles as CUDA graphs, full-graph TDT
                                  decoder)
Whisper             CUDA          :class:`~flashasr.engine.whisper_gpu.WhisperGPUASR`
                                  (static KV cache, CUDA-graph decode steps; transcripts
                                  equal the reference decoder's, tested on the H200)
any                 CPU           the model as loaded (plain PyTorch)
==================  ============  ====================================================

``engine="plain"`` (or the environment variable ``FLASHASR_GPU_ENGINE=0``) keeps the plain
PyTorch path on a GPU. :mod:`flashasr.models` loads weights and knows nothing of engines.
"""

from __future__ import annotations

import functools
import os

from ..errors import FlashASRError

ENGINES = ("auto", "plain")


def _check_engine(engine: str) -> str:
    if engine not in ENGINES:
        raise FlashASRError(f"engine must be one of {', '.join(ENGINES)}; got {engine!r}", code="invalid_request")
    return engine


def gpu_engine_enabled(device: str, engine: str = "auto") -> bool:
    """Whether :func:`accelerate` wraps a model on ``device``: ``engine="auto"``, a CUDA device that
    torch can use, and ``FLASHASR_GPU_ENGINE`` not set to ``0``."""
    if _check_engine(engine) == "plain" or not str(device).startswith("cuda"):
        return False
    if os.environ.get("FLASHASR_GPU_ENGINE", "1") == "0":
        return False
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - no usable torch CUDA
        return False


def accelerate(model, engine: str = "auto", **engine_kw):
    """The model behind its GPU engine when :func:`gpu_engine_enabled` (see the table above), else
    the model unchanged. ``engine_kw`` go to the engine wrapper's constructor.

    Raises:
        FlashASRError (``invalid_request``): an unknown ``engine``.
    """
    if not gpu_engine_enabled(getattr(model, "device", "cpu"), engine):
        return model
    family = getattr(model, "family", None)
    if family == "parakeet":
        from ..engine.parakeet_gpu import ParakeetGPUASR

        return model if isinstance(model, ParakeetGPUASR) else ParakeetGPUASR(model, **engine_kw)
    if family == "whisper":
        from ..engine.whisper_gpu import WhisperGPUASR

        return model if isinstance(model, WhisperGPUASR) else WhisperGPUASR(model, **engine_kw)
    return model


def check_device(device: str, *, here: bool = True) -> None:
    """A device torch can use, or ModelLoadError (``invalid_device``) saying why not.

    The one device rule of every door: ``cpu`` (no index: the CPU is one device, ``cpu:1`` names
    nothing), ``cuda`` or ``cuda:N``; anything torch does not parse, or another device type, is
    refused. With ``here`` (default) also whether this machine can use it: a CUDA build, a visible
    GPU, ``N`` below the GPU count; ``here=False`` checks the form only (a Ray job's GPUs are the
    cluster's, checked where its model loads).
    """
    from ..errors import ModelLoadError

    d = str(device)
    try:
        import torch

        dev = torch.device(d)
    except (RuntimeError, TypeError, ValueError):
        raise ModelLoadError(f"device {d!r} is not a torch device; use cpu, cuda or cuda:N",
                             code="invalid_device") from None
    if dev.type == "cpu" and dev.index is not None:
        raise ModelLoadError(f"device {d!r} is not supported: the CPU takes no index; use cpu, cuda or cuda:N",
                             code="invalid_device")
    if dev.type == "cuda" and not here:
        return
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch has no CUDA support" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ModelLoadError(f"device {d!r} is not usable: {why}; use --device cpu", code="invalid_device")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ModelLoadError(f"device {d!r} is not usable: {torch.cuda.device_count()} CUDA GPU(s) visible",
                                 code="invalid_device")
    elif dev.type != "cpu":
        raise ModelLoadError(f"device {d!r} is not supported; use cpu, cuda or cuda:N", code="invalid_device")


_CUDA_INDEX_IN_USE: int | None = None  # the GPU this process's models run on (see use_cuda_device)


def use_cuda_device(device: str) -> None:
    """Make a CUDA model device (``cuda``, ``cuda:N``) the process's current CUDA device.

    The engines queue their copies, events, CUDA-graph captures and synchronisations on the current
    device's streams, as PyTorch does where no device is named; a model on ``cuda:1`` while the
    current device is 0 would have its work waited for on the wrong GPU. One process runs its
    models on one GPU (the server's engine process, a Ray actor, the CLI): a second GPU in the same
    process is refused. Nothing happens for ``cpu``.

    Raises:
        ModelLoadError (``invalid_device``): a device torch cannot use here (:func:`check_device`),
            or a model on another GPU was loaded in this process.
    """
    global _CUDA_INDEX_IN_USE
    import torch

    check_device(device)
    dev = torch.device(str(device))
    if dev.type != "cuda":
        return
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if _CUDA_INDEX_IN_USE is not None and index != _CUDA_INDEX_IN_USE:
        from ..errors import ModelLoadError

        raise ModelLoadError(f"device {device!r}: this process already runs a model on cuda:{_CUDA_INDEX_IN_USE}; "
                             "one process uses one GPU (run one process per GPU, e.g. one `flashasr serve` "
                             "per GPU, or Ray)", code="invalid_device")
    if index != torch.cuda.current_device():
        torch.cuda.set_device(index)
    _CUDA_INDEX_IN_USE = index


def load_model(spec=None, *, device: str = "cpu", dtype: str | None = None, engine: str = "auto"):
    """Load a model (:func:`flashasr.models.registry.load_model` specs, plus ``random:NAME`` for
    benchmarks, :mod:`flashasr.random_models`) and put it behind its engine (:func:`accelerate`).

    Raises:
        ModelLoadError / UnsupportedModelError: as the registry; ``invalid_device`` for a device torch
            cannot use here (``cuda`` without a GPU or CUDA build, ``gpu``, ``cuda:7`` of 1 GPU) or
            a second GPU in this process (:func:`use_cuda_device`); FlashASRError for a bad ``engine``.
    """
    global _CUDA_INDEX_IN_USE
    _check_engine(engine)
    claimed = _CUDA_INDEX_IN_USE
    use_cuda_device(device)  # checks the device first
    s = None if spec is None else str(spec)
    try:
        if s is not None and s.startswith("random:"):
            from ..random_models import load_random_model

            return load_random_model(s[len("random:"):], device=device, dtype=dtype,
                                     accelerate=lambda m: accelerate(m, engine))
        from ..models.registry import load_model as load_weights

        return accelerate(load_weights(s, device=device, dtype=dtype), engine)
    except BaseException:
        _CUDA_INDEX_IN_USE = claimed  # no model of this load runs on that GPU
        raise


@functools.lru_cache(maxsize=4)
def cached_model(spec: str | None = None, device: str = "cpu", dtype: str | None = None, engine: str = "auto"):
    """Like :func:`load_model` but keeps up to 4 loaded models per process (in-process callers of
    ``flashasr.transcribe`` and the CLI reuse a loaded model)."""
    return load_model(spec, device=device, dtype=dtype, engine=engine)


__all__ = ["ENGINES", "accelerate", "gpu_engine_enabled", "load_model", "cached_model", "use_cuda_device"]
