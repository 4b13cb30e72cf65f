"""The one segmentation policy: a recording becomes pieces the model can take.

Input: float32 samples ``[N]`` at the model's rate, resolved
:class:`~flashasr.options.TranscribeOptions` and the model's
:class:`~flashasr.options.ModelCapabilities`. Output: :class:`Piece` s -- sample ranges
``(start, end)``, sorted, each ``samples[start:end]`` one model input whose times add
``start / rate`` to become global -- each carrying ``speech``: the Silero VAD's speech spans inside
it (sample ranges from the piece's start). ``W`` below is ``min(options.max_segment_s, caps.window_s)``.

For a model with a speech gate (``caps.speech_gate``: Whisper, which invents text on non-speech)
every mode runs the VAD (:func:`flashasr.audio.vad.asr_speech_spans`) and leaves out what holds no
speech: a recording without speech has no piece (an empty transcript, no model call), whatever the
segmentation. A model without one (Parakeet-TDT: its decoder emits blanks on non-speech, NeMo
gates nothing) gets no VAD pass unless a recording longer than ``W`` must be cut at pauses: a
recording that fits goes in whole and ``fixed`` windows cover ``[0, N)``, their pieces without
speech spans (``speech`` None); the VAD costs ~8 CPU-s per audio hour (below). The modes differ in
how speech is cut (for a gated model):

==============  =====================================================================
segmentation    pieces
==============  =====================================================================
``vad``         speech spans padded, grouped and cut at the longest pause that keeps a piece
                <= ``W`` (:func:`flashasr.audio.vad.split_for_asr`); stretches without speech
                are left out. A recording no longer than ``W`` goes in whole.
``fixed``       consecutive windows of ``W``; windows without speech are left out.
``none``        ``[(0, N)]``: the model's own long-form procedure (Whisper's 30 s seek, which
                skips the stretches without speech the piece's ``speech`` shows). A model
                without one (Parakeet-TDT) gets ``[(0, N)]`` up to ``W`` and ``vad`` pieces
                beyond: its window is a hard limit.
==============  =====================================================================

The speech spans travel with each piece to the model (``transcribe_batch(..., speech=...)``): a
model that uses them (Whisper) decodes only where there is speech and goes on decoding where it
stopped early while speech remains (see :mod:`flashasr.models.whisper.asr`). A custom splitter
(``split=``) gives pieces without spans (``speech`` None: the model decodes all of each piece).

An empty recording has no piece. This runs on CPU workers (the job runner's decode pool, the
server's CPU pool), never on the model's thread. Cost: the VAD, 8.8 CPU-s per audio hour on the
2-core VM (``bench/results/cpu_audio_vm.json``, ``sequence_onnx_512_frames_per_call``).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..options import ModelCapabilities, TranscribeOptions

Splitter = Callable[[np.ndarray, int, float, str], list]


class Piece(tuple):
    """One model input of a recording: the sample range ``(start, end)`` -- a 2-tuple, so
    ``a, b = piece`` works -- and ``speech``: the VAD's speech spans inside it, a tuple of
    ``(a, b)`` sample ranges counted from ``start`` (sorted, within ``[0, end - start]``), or None
    when not known (a custom splitter, no VAD)."""

    def __new__(cls, start: int, end: int, speech=None):
        self = super().__new__(cls, (int(start), int(end)))
        self.speech = None if speech is None else tuple((int(a), int(b)) for a, b in speech)
        return self

    def __reduce__(self):  # pickled with its spans (worker processes hand pieces back)
        return (Piece, (self[0], self[1], self.speech))

    def __repr__(self) -> str:
        return f"Piece({self[0]}, {self[1]}, speech={self.speech!r})"


def spans_inside(spans, start: int, end: int) -> tuple[tuple[int, int], ...]:
    """``spans`` (sample ranges of the recording) clipped to ``[start, end)``, counted from ``start``."""
    out = []
    for a, b in spans:
        a, b = max(int(a), start), min(int(b), end)
        if b > a:
            out.append((a - start, b - start))
    return tuple(out)


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
    compute the speech probabilities beforehand, many recordings at once). A model with a speech
    gate (``caps.speech_gate``: Whisper) needs it for every recording that is not empty, in every
    segmentation (the pieces carry the speech spans); one without (Parakeet-TDT) only where a
    recording longer than ``W`` is cut at pauses (``vad``, or ``none`` without a long-form
    procedure)."""
    if n_samples == 0:
        return False
    if caps.speech_gate:
        return True
    fits = n_samples <= int(piece_limit_s(options, caps) * caps.sample_rate)
    method = options.segmentation
    return not fits and (method == "vad" or (method == "none" and not caps.long_form))


def _split_pieces(split: Splitter, samples: np.ndarray, sr: int, limit: float, method: str) -> list[Piece]:
    """A custom splitter's ranges clipped to the recording, empty ones dropped (no speech spans)."""
    n = int(samples.shape[0])
    got = [(max(0, int(a)), min(n, int(b))) for a, b in split(samples, sr, limit, method)]
    return [Piece(a, b) for a, b in got if b > a]


def plan_pieces(samples: np.ndarray, options: TranscribeOptions, caps: ModelCapabilities, *,
                split: Splitter | None = None, probs: np.ndarray | None = None) -> list[Piece]:
    """The pieces of one recording (see the module docstring for the policy).

    Args:
        samples: float32 ``[N]`` at ``caps.sample_rate``.
        options: ``segmentation`` and ``max_segment_s`` are used.
        caps: the model's window and whether it has a long-form procedure.
        split: replaces the VAD's cutting (``split(samples, rate, max_s, method)`` -> ranges;
            tests and benchmarks with pre-computed cuts); its pieces carry no speech spans.
        probs: the recording's Silero speech probabilities, when already computed (see
            :func:`needs_vad`; :func:`flashasr.audio.silero_torch.speech_probabilities_batch`).
    Returns:
        sorted, non-empty :class:`Piece` s within ``[0, N]``, each at most ``W`` long except the
        single ``none`` piece of a long-form model; none when the VAD finds no speech.
    """
    n = int(samples.shape[0])
    if n == 0:
        return []
    sr = int(caps.sample_rate)
    limit = piece_limit_s(options, caps)
    fits = n <= int(limit * sr)
    method = options.segmentation
    if method == "none" and not (caps.long_form or fits):
        method = "vad"
    if not needs_vad(n, options, caps):  # no speech gate, no cut at pauses: the VAD has nothing to decide
        if fits or method == "none":
            return [Piece(0, n)]
        if split is not None:
            return _split_pieces(split, samples, sr, limit, method)
        step = max(1, int(limit * sr))
        return [Piece(a, min(n, a + step)) for a in range(0, n, step)]  # fixed: windows covering [0, N)
    try:
        from ..audio.vad import asr_speech_spans, split_for_asr
    except ImportError:  # no VAD here: cut at quiet frames, no speech spans
        split = split or (lambda x, rate, max_s, how: quiet_split(x, rate, max_s))
    if split is not None:
        if method == "none":
            return [Piece(0, n)]
        got = _split_pieces(split, samples, sr, limit, method)
        return [Piece(0, n)] if got and fits else got
    if method == "vad":
        ranges, spans = split_for_asr(samples, sr, max_segment_s=limit, method="vad", probs=probs, with_speech=True)
        if fits:
            ranges = [(0, n)]
    else:
        spans = asr_speech_spans(samples, sr, probs=probs)
        ranges = [(0, n)] if method == "none" else split_for_asr(samples, sr, max_segment_s=limit, method="fixed")
    pieces = [Piece(a, b, spans_inside(spans, a, b)) for a, b in ranges]
    return [p for p in pieces if p.speech]


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
    (:func:`flashasr.audio.silero_torch.speech_probabilities_batch`: the same network and state
    restarts, the same probabilities up to float rounding, hence the same pieces);
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


__all__ = ["Piece", "spans_inside", "plan_pieces", "plan_many", "default_vad_device", "needs_vad", "piece_limit_s", "quiet_split", "Splitter"]
