"""The one segmentation policy: a recording becomes pieces the model can take.

Input: float32 samples ``[N]`` at the model's rate, resolved
:class:`~flashasr.options.TranscribeOptions` and the model's
:class:`~flashasr.options.ModelCapabilities`. Output: sample ranges ``[(start, end), ...]``,
sorted, each ``samples[start:end]`` one model input whose times add ``start / rate`` to become
global. ``W`` below is ``min(options.max_segment_s, caps.window_s)``.

==============  =====================================================================
segmentation    pieces
==============  =====================================================================
``vad``         Silero VAD (:func:`flashasr.audio.vad.split_for_asr`): speech spans padded,
                grouped and cut at the longest pause that keeps a piece <= ``W``; stretches
                without speech are left out, so a recording without speech has no piece
                (an empty transcript, no model call). A recording no longer than ``W`` goes
                in whole: for a model that needs a speech gate (``caps.speech_gate``:
                Whisper, which invents text on non-speech) the VAD only decides whether it
                holds speech; a model without one (Parakeet-TDT, whose decoder emits blanks
                there: NeMo gates nothing) gets it without running the VAD at all.
``fixed``       consecutive windows of ``W`` covering ``[0, N)``.
``none``        ``[(0, N)]``: the model's own long-form procedure (Whisper's 30 s seek). A
                model without one (Parakeet-TDT) gets ``[(0, N)]`` up to ``W`` and ``vad``
                pieces beyond: its window is a hard limit.
==============  =====================================================================

An empty recording has no piece. This runs on CPU workers (the job runner's decode pool, the
server's CPU pool), never on the model's thread. Cost: the VAD, 8.8 CPU-s per audio hour on the
2-core VM (``bench/results/cpu_audio_vm.json``, ``sequence_onnx_512_frames_per_call``).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..options import ModelCapabilities, TranscribeOptions

Splitter = Callable[[np.ndarray, int, float, str], list]


def vad_split(samples: np.ndarray, sample_rate: int, max_segment_s: float, method: str,
              probs: np.ndarray | None = None) -> list[tuple[int, int]]:
    """:func:`flashasr.audio.vad.split_for_asr` (``method`` ``vad`` or ``fixed``; ``probs``: the
    speech probabilities already computed, e.g. on the GPU); without the VAD module (its ONNX
    runtime missing), :func:`quiet_split`."""
    try:
        from ..audio.vad import split_for_asr
    except ImportError:
        return quiet_split(samples, sample_rate, max_segment_s)
    return split_for_asr(samples, sample_rate, max_segment_s=max_segment_s, method=method, probs=probs)


def quiet_split(samples: np.ndarray, sr: int, max_s: float) -> list[tuple[int, int]]:
    """Cut into pieces <= ``max_s`` seconds at the quietest 10 ms frame of each window's last 30 %
    (contiguous, covering every sample; the fallback when the VAD cannot load)."""
    n = len(samples)
    max_n = max(int(max_s * sr), sr)
    hop = sr // 100
    out, start = [], 0
    while n - start > max_n:
        lo, hi = start + int(0.7 * max_n), start + max_n
        seg = samples[lo:hi]
        k = max(len(seg) // hop, 1)
        energy = (seg[: k * hop].astype(np.float64).reshape(k, -1) ** 2).mean(1) if len(seg) >= hop else np.zeros(1)
        cut = lo + int(np.argmin(energy)) * hop + hop // 2
        cut = min(max(cut, start + 1), hi)
        out.append((start, cut))
        start = cut
    out.append((start, n))
    return out


def piece_limit_s(options: TranscribeOptions, caps: ModelCapabilities) -> float:
    """``W``: the longest piece in seconds (the option, at most the model's window)."""
    w = float(caps.window_s)
    return w if options.max_segment_s is None else min(float(options.max_segment_s), w)


def needs_vad(n_samples: int, options: TranscribeOptions, caps: ModelCapabilities) -> bool:
    """Whether :func:`plan_pieces` runs the VAD on a recording of ``n_samples`` (so a caller can
    compute the speech probabilities beforehand, many recordings at once)."""
    if n_samples == 0 or options.segmentation == "fixed":
        return False
    fits = n_samples <= int(piece_limit_s(options, caps) * caps.sample_rate)
    if options.segmentation == "none":
        return not caps.long_form and not fits
    return not fits or caps.speech_gate


def plan_pieces(samples: np.ndarray, options: TranscribeOptions, caps: ModelCapabilities, *,
                split: Splitter | None = None, probs: np.ndarray | None = None) -> list[tuple[int, int]]:
    """Sample ranges for one recording (see the module docstring for the policy).

    Args:
        samples: float32 ``[N]`` at ``caps.sample_rate``.
        options: ``segmentation`` and ``max_segment_s`` are used.
        caps: the model's window and whether it has a long-form procedure.
        split: replaces :func:`vad_split` (``split(samples, rate, max_s, method)``; tests and
            benchmarks with pre-computed cuts).
        probs: the recording's Silero speech probabilities, when already computed (see
            :func:`needs_vad`; :func:`flashasr.audio.silero_torch.speech_probabilities_batch`).
    Returns:
        sorted, non-empty ``(start, end)`` ranges within ``[0, N]``, each at most ``W`` long
        except the single ``none`` range of a long-form model.
    """
    n = int(samples.shape[0])
    if n == 0:
        return []
    sr = int(caps.sample_rate)
    limit = piece_limit_s(options, caps)
    fits = n <= int(limit * sr)
    method = options.segmentation
    if method == "none":
        if caps.long_form or fits:
            return [(0, n)]
        method = "vad"
    if method == "vad" and fits and not caps.speech_gate:
        return [(0, n)]  # no cut needed and no speech gate wanted: the VAD has nothing to decide
    if split is not None:
        got = split(samples, sr, limit, method)
    else:
        got = vad_split(samples, sr, limit, method, probs=probs if method == "vad" else None)
    pieces = [(max(0, int(a)), min(n, int(b))) for a, b in got]
    pieces = [(a, b) for a, b in pieces if b > a]
    if pieces and fits:
        return [(0, n)]
    return pieces


def default_vad_device(model_device: str) -> str:
    """Where the Silero VAD runs for a model on ``model_device``: that CUDA device when it is one
    (and CUDA is usable: one batched PyTorch computation, :func:`plan_many`; a 1-hour recording's
    VAD in a fraction of a second instead of ~8 CPU-seconds), else ``"cpu"`` (ONNX). Every door
    uses this rule, so a recording gets the same pieces from each."""
    device = str(model_device or "cpu")
    if not device.startswith("cuda"):
        return "cpu"
    try:
        import torch

        return device if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001 - no usable torch/CUDA: the ONNX VAD
        return "cpu"


def plan_many(recordings: list[np.ndarray], options: TranscribeOptions, caps: ModelCapabilities, *,
              vad_device: str = "cpu", split: Splitter | None = None) -> list[list[tuple[int, int]]]:
    """:func:`plan_pieces` for several recordings at once.

    With ``vad_device`` other than ``"cpu"`` (e.g. ``"cuda"``), the Silero VAD of every recording
    that needs it runs as ONE batched PyTorch computation on that device
    (:func:`flashasr.audio.silero_torch.speech_probabilities_batch`: the same network; for
    recordings up to 131 s the same probabilities up to float rounding, hence the same pieces);
    the cutting itself stays on the CPU. ``"cpu"``: the ONNX VAD per recording, as
    :func:`plan_pieces`.
    """
    probs: dict[int, np.ndarray] = {}
    if split is None and vad_device != "cpu" and caps.sample_rate == 16000:
        need = [k for k, x in enumerate(recordings) if needs_vad(int(x.shape[0]), options, caps)]
        if need:
            from ..audio.silero_torch import speech_probabilities_batch

            probs = dict(zip(need, speech_probabilities_batch([recordings[k] for k in need], device=vad_device)))
    return [plan_pieces(x, options, caps, split=split, probs=probs.get(k)) for k, x in enumerate(recordings)]


__all__ = ["plan_pieces", "plan_many", "default_vad_device", "needs_vad", "piece_limit_s", "vad_split", "quiet_split", "Splitter"]
