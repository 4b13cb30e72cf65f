"""Random-weight models for benchmarks: the ``random:NAME`` model spec. Not on the production load path.

``random:NAME`` is a Parakeet-TDT with random weights of the architecture in ``NAME`` -- a
NeMo-layout YAML path, or a config name (``parakeet-tdt-0.6b-v3``) looked up in
``$FLASHASR_SHARED/fixtures/parakeet`` or a ``shared/fixtures/parakeet`` folder beside or above the
working directory. Texts are meaningless; what matters is that the model computes exactly what the
real one computes, at its real shapes, and emits tokens at a rate like real speech:

1. :func:`build_random_parakeet`: seeded random weights (PyTorch's default initialisation);
2. :func:`shape_random_joint`: the joint's output layer given realistic output statistics (a raw
   random joint emits a token at almost every step, which makes decoder timings meaningless);
3. the model goes behind its engine (the caller's ``accelerate``, e.g. the GPU engine);
4. :func:`calibrate_random_joint`: the blank bias bisected so that greedy decoding of a few real
   speech clips found beside the config emits about 3.5 tokens per audio second, on this very
   model's numerics (a bias calibrated for bf16 on the GPU gave 0 tokens in float32 on the CPU).

Only :func:`flashasr.pipeline.engines.load_model` imports this module, for ``random:`` specs.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Callable, Mapping

import torch

from .errors import ModelLoadError
from .models.parakeet.config import load_yaml_config

def find_parakeet_config(name: str) -> Path:
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


def calibration_speech(cfg_path: Path, max_clips: int = 6) -> list:
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


def build_random_parakeet(config_path: str | os.PathLike | Mapping, device: str = "cpu",
                          dtype: str | None = None, seed: int = 0):
    """Build a :class:`~flashasr.models.parakeet.model.ParakeetASR` with random weights.

    For benchmarks of the real architecture without its checkpoint (e.g. the
    ``parakeet-tdt-0.6b-v3.yaml`` reconstruction). Weights are drawn under ``seed`` with
    PyTorch's default initialisation; the tokenizer is a stand-in of the right size
    (texts are meaningless). ``dtype``: "float32" (default), "bfloat16" or "float16".
    """
    from .models.parakeet.model import ParakeetASR

    cfg = load_yaml_config(config_path) if not isinstance(config_path, Mapping) else dict(config_path)
    name = Path(str(config_path)).stem if not isinstance(config_path, Mapping) else "parakeet-random"
    return ParakeetASR.from_config(cfg, tokenizer=None, device=device, dtype=dtype, seed=seed, name=name)


# Output statistics for a random TDT joint, calibrated on the H200 (bench/bench_gpu_e2e.py,
# calibrate_joint: blank-bias bisection over 64 real speech pieces through the bf16 engine) so that
# greedy decoding of real speech emits about 3.4 tokens per audio second with a duration mix
# like real speech. Benchmarks that serve a random-weight model use these fixed values and report
# the token rate they realise.
RANDOM_JOINT_OUT_SCALE = 4.0
RANDOM_JOINT_BLANK_BIAS = 4.29
RANDOM_JOINT_DURATION_BIAS = (-1.0, 0.6, 0.6, 0.4, 0.3)


@torch.no_grad()
def shape_random_joint(model, *, blank_bias: float = RANDOM_JOINT_BLANK_BIAS,
                       duration_bias=RANDOM_JOINT_DURATION_BIAS, out_scale: float = RANDOM_JOINT_OUT_SCALE) -> None:
    """Give a random-weight TDT joint (of ``model``, a ParakeetASR) realistic output statistics, in
    place: token and blank rows of the output layer x ``out_scale``, output bias zero except the
    blank logit (``blank_bias``) and the duration logits (``duration_bias``, one per duration).

    Without this a random joint emits a token at almost every step (tens per second), which
    makes decoder timings meaningless.

    Raises:
        ValueError: ``duration_bias`` does not have one value per TDT duration.
    """
    j = model.joint
    V = j.blank_id
    n_dur = j.out.weight.shape[0] - (V + 1)
    if len(duration_bias) != n_dur:
        raise ValueError(f"duration_bias has {len(duration_bias)} values, the joint has {n_dur} durations")
    j.out.weight[: V + 1].mul_(out_scale)
    j.out.bias.zero_()
    j.out.bias[V] = blank_bias
    j.out.bias[V + 1:] = torch.tensor(list(duration_bias), dtype=j.out.bias.dtype, device=j.out.bias.device)


@torch.no_grad()
def calibrate_random_joint(model, waveforms, *, target_tokens_per_s: float = 3.5, iters: int = 10,
                           lo: float = -2.0, hi: float = 10.0) -> tuple[float, float]:
    """Bisect the blank logit bias of a random joint (already :func:`shape_random_joint`-ed) so
    that greedy decoding of ``waveforms`` (real speech, float32 16 kHz ``[N]`` each) emits
    ``target_tokens_per_s`` tokens per audio second on this very model and device (the rate
    depends on the encoder's numerics, e.g. bf16 on the GPU vs float32 on the CPU).

    Uses ``model._decode_pieces`` (the model's own batched path, GPU engine included).
    Returns ``(blank_bias, realised tokens per second)``; the bias is left set.
    """
    j = model.joint
    V = j.blank_id
    audio_s = sum(len(w) for w in waveforms) / model.sample_rate

    def rate(b: float) -> float:
        j.out.bias[V] = b
        return sum(len(h.token_ids) for h in model._decode_pieces(list(waveforms))) / max(1e-9, audio_s)

    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if rate(mid) > target_tokens_per_s else (lo, mid)
    b = (lo + hi) / 2
    return b, rate(b)


def load_random_model(name: str, *, device: str = "cpu", dtype: str | None = None,
                      accelerate: Callable | None = None):
    """The ``random:NAME`` model (see the module docstring), on ``device`` in ``dtype`` (default
    float32), behind ``accelerate(model)`` when given, with its joint calibrated on the result.

    Raises:
        ModelLoadError: no config of that name (``model_not_found``), an unusable device
            (``invalid_device``), a config that is not a NeMo Parakeet YAML.
    """
    cfg = find_parakeet_config(name)
    try:
        asr = build_random_parakeet(cfg, device=device, dtype=dtype or "float32")
    except (RuntimeError, AssertionError) as e:  # e.g. "Torch not compiled with CUDA enabled"
        if "cuda" in str(device) or "device" in str(e).lower() or "cuda" in str(e).lower():
            raise ModelLoadError(f"model 'random:{name}': cannot use device {device!r}: {e}",
                                 code="invalid_device") from e
        raise
    shape_random_joint(asr)
    if accelerate is not None:
        asr = accelerate(asr)
    asr.name = f"random:{cfg.stem if name.endswith(('.yaml', '.yml')) else name}"
    speech = calibration_speech(cfg)
    if speech:  # token rate like real speech, on this model's own numerics
        t0 = time.perf_counter()
        b, tps = calibrate_random_joint(asr, speech)
        logging.getLogger(__name__).info("random joint: blank bias %.3f -> %.2f tokens/s on %d real clips",
                                         b, tps, len(speech))
        asr.calibration = {"blank_bias": b, "tokens_per_s": tps, "clips": len(speech),
                           "seconds": round(time.perf_counter() - t0, 1)}
    return asr


__all__ = ["load_random_model", "find_parakeet_config", "calibration_speech", "build_random_parakeet",
           "shape_random_joint", "calibrate_random_joint", "RANDOM_JOINT_OUT_SCALE", "RANDOM_JOINT_BLANK_BIAS",
           "RANDOM_JOINT_DURATION_BIAS"]
