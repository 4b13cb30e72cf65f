"""Voice activity detection with Silero VAD (the ONNX model bundled in the ``silero-vad``
package; no network).

Model: ``silero_vad_16k_sequence.onnx`` run with onnxruntime (1 intra-op thread). It is the
Silero VAD v5/v6 network exported so that one call processes a whole sequence of 32 ms
frames (512 samples at 16 kHz, each prefixed by the previous frame's last 64 samples as
context) while carrying the LSTM state (h, c) between calls. Its per-frame probabilities
are bit-identical to the stock one-frame-per-call ``silero_vad.onnx`` (checked in the
tests); measured on this 2-core machine, one core, a 60 s clip: 8.9 s of CPU per audio
hour with 512 frames per call, 19 s/h with one frame per call, stock ONNX 25 s/h, the
TorchScript JIT model 55 s/h (see docs/AUDIO.md and bench/bench_cpu_audio.py).

Three entry points:

* :func:`speech_probabilities` - per-frame speech probability, float32 [T], frame = 32 ms.
* :func:`speech_segments` - speech spans in seconds (hysteresis on the probabilities:
  speech starts at ``p >= threshold``, ends after ``min_silence_s`` of ``p < threshold -
  0.15``, as Silero's own ``get_speech_timestamps`` does; spans shorter than
  ``min_speech_s`` are dropped, the rest padded by ``pad_s`` and merged when they touch).
* :func:`split_for_asr` - sample ranges <= ``max_segment_s`` for an ASR model, cut at the
  longest pauses (VAD) or as fixed windows; :func:`asr_speech_spans` - the speech spans it cuts
  around (the pipeline hands them to the model with each piece).
* :class:`StreamingVAD` - per-stream incremental detector with OpenAI Realtime
  ``server_vad`` semantics (threshold, prefix_padding_ms, silence_duration_ms).
"""

from __future__ import annotations

import importlib.util
import os
import threading
from dataclasses import dataclass

import numpy as np

from .errors import AudioArgumentError

VAD_RATE = 16000
FRAME = 512  # samples per VAD frame at 16 kHz (32 ms)
CONTEXT = 64  # samples of left context per frame
FRAME_S = FRAME / VAD_RATE
_MAX_FRAMES_PER_CALL = 512  # 16.4 s of audio per ONNX call
# Whole-recording probabilities restart the LSTM from a zero state every STATE_CHUNK_FRAMES frames,
# each chunk warmed up on the STATE_WARMUP_FRAMES before it (run, then dropped): one state carried
# over a long recording drifts, and after a minute of whale song quiet speech (-63 dBFS FLEURS
# clips) stayed below 0.32 for 33 s, lost at every door and by faster-whisper too
# (bench/bench_faithful.py's generated recording); restarted, it reads 0.99, as alone. The state
# forgets a zero start within a few seconds, so on ordinary speech nothing changes (tests/test_vad.py).
STATE_CHUNK_FRAMES = 512  # 16.4 s
STATE_WARMUP_FRAMES = 125  # 4 s (a quarter more frames: ONNX VAD 3.96 -> 4.84 CPU-s per audio hour, 2-core VM)
# The network's input is level-normalised (automatic gain control): each frame (with its context) is
# multiplied by LEVEL_TARGET_DBFS over the RMS of the loudest of the LEVEL_FRAMES frames ending with
# it (frames before the start count as silence), at most LEVEL_MAX_GAIN_DB. Silero's LSTM remembers the
# level it heard: alone, a FLEURS sentence at -63 dBFS reads p >= 0.5 in 86 % of its frames, but 20 s
# of whale song (-9 dBFS) or jazz (-19 dBFS) before it leave 0-27 % (fleurs-003, -004, -007: 0 %), so
# issue #17's interleaved recordings lost those sentences and handed Whisper their quiet ends with the
# loud start of the music (a digit loop). Normalised, they read 59-81 % after the music, and no
# no-speech clip of the shared set gains a speech frame. The loudest frame of the last second, not the
# mean: a pause shorter than that keeps the gain of the speech before it, so the pauses stay (a 0.5 s
# mean raised the room noise of pauses and merged 88 speech spans of the long clips into 56; this
# gives 91). The cost: a sentence right after loud audio is found up to 0.9 s late (0.77 s: 0.6 s,
# but 87 spans and 10 s pieces from tests/test_vad.py's 3 min of speech). Measurements:
# docs/AUDIO.md section 6. The gain is a function of the last second of audio only, so the three
# paths compute it alike. At most +20 dB: the music is brought down and quiet speech raised enough
# (FLEURS after jazz or whale song: 63-81 % of frames, as with +40 dB), while a quiet room before a
# short word keeps its contrast (+40 dB raised a -65 dBFS floor to the word's level: the 1 s "no"
# of hard-short-no read p <= 0.49 and was lost; +20 dB: 0.95).
LEVEL_FRAMES = 32  # 1.024 s
LEVEL_TARGET_DBFS = -26.0
LEVEL_MAX_GAIN_DB = 20.0  # 40 dB raised a -65 dBFS room floor to the level of the word after it: hard-short-no lost

_session = None
_batch_session = None
_session_lock = threading.Lock()


def silero_data_path(name: str) -> str:
    """Path of file ``name`` in the silero-vad package's ``data`` folder.

    The package is located, never imported: importing it runs ``torch.set_num_threads(1)``
    (silero_vad/model.py, 5.x), which would leave every later torch computation in the process --
    Whisper on the CPU included -- on one thread.

    Raises:
        FileNotFoundError: the package or the file is missing.
    """
    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the silero-vad package is not installed (pip install silero-vad)")
    path = os.path.join(list(spec.submodule_search_locations)[0], "data", name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"Silero VAD model {name} not found in the silero-vad package ({path})")
    return path


def _model_path(name: str = "silero_vad_16k_sequence.onnx") -> str:
    return silero_data_path(name)


def _new_session(name: str):
    try:
        import onnxruntime as ort
    except ImportError as e:
        from ..errors import FlashASRError

        raise FlashASRError("the Silero VAD needs onnxruntime, which is not installed "
                            "(pip install onnxruntime)", code="missing_dependency") from e

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(_model_path(name), so, providers=["CPUExecutionProvider"])


def _get_session():
    """The shared onnxruntime session (thread-safe ``run``; created once, 1 thread)."""
    global _session
    if _session is None:
        with _session_lock:
            if _session is None:
                _session = _new_session("silero_vad_16k_sequence.onnx")
    return _session


def _get_batch_session():
    """The stock ``silero_vad.onnx`` (batch of streams, one frame each; state [2, B, 128] =
    stacked (h, c) of the sequence model, so both give identical probabilities)."""
    global _batch_session
    if _batch_session is None:
        with _session_lock:
            if _batch_session is None:
                _batch_session = _new_session("silero_vad.onnx")
    return _batch_session


def _run_frames(frames_with_ctx: np.ndarray, h: np.ndarray, c: np.ndarray):
    """frames_with_ctx: float32 [T, 576] -> (probs float32 [T], h, c)."""
    p, h, c = _get_session().run(None, {"input": frames_with_ctx, "h": h, "c": c})
    return np.asarray(p, np.float32).reshape(-1), h, c


def _as_16k(samples: np.ndarray, sample_rate: int) -> np.ndarray:
    x = np.asarray(samples)
    if x.ndim != 1:
        raise AudioArgumentError(f"VAD expects mono samples of shape [N], got {list(x.shape)}")
    x = x.astype(np.float32, copy=False)
    if sample_rate != VAD_RATE:
        if sample_rate <= 0:
            raise AudioArgumentError(f"sample_rate must be positive, got {sample_rate}")
        import soxr

        x = soxr.resample(x, sample_rate, VAD_RATE, quality="HQ").astype(np.float32, copy=False)
    return x


def frame_energies(frames: np.ndarray) -> np.ndarray:
    """Mean square of each frame's samples: float32 ``[T, 512]`` (the frames without their context)
    -> float64 ``[T]`` (full-scale units, 1.0 = 0 dBFS)."""
    f = np.asarray(frames, np.float32).astype(np.float64)
    return (f * f).mean(axis=1) if f.shape[0] else np.zeros(0, np.float64)


def level_gains(energies: np.ndarray, previous: np.ndarray | None = None) -> np.ndarray:
    """The gain applied to each frame before the network (the VAD's level normalisation).

    Args:
        energies: float64 ``[T]``, :func:`frame_energies` of consecutive frames.
        previous: float64 ``[LEVEL_FRAMES - 1]``, the energies of the frames just before them (None:
            the start of a recording, silence before it).
    Returns:
        float32 ``[T]``: ``10 ** (LEVEL_TARGET_DBFS / 20) / sqrt(largest of the LEVEL_FRAMES energies
        ending with the frame)``, at most ``10 ** (LEVEL_MAX_GAIN_DB / 20)`` (digital silence stays
        silence, a -60 dBFS hum is raised by 20 dB). A function of the last second of audio only, so
        :func:`speech_probabilities`, :class:`StreamingVAD` and
        :func:`flashasr.audio.silero_torch.speech_probabilities_batch` compute it alike (see
        :data:`LEVEL_FRAMES` for why it exists).
    """
    e = np.asarray(energies, np.float64).reshape(-1)
    if e.shape[0] == 0:
        return np.zeros(0, np.float32)
    prev = np.zeros(LEVEL_FRAMES - 1, np.float64) if previous is None else np.asarray(previous, np.float64)
    return _gains_of_levels(np.lib.stride_tricks.sliding_window_view(np.concatenate([prev, e]),
                                                                     LEVEL_FRAMES).max(axis=-1))


def _gains_of_levels(level: np.ndarray) -> np.ndarray:
    """float64 loudest-frame energies (any shape) -> the float32 gains of :func:`level_gains`."""
    target = 10.0 ** (LEVEL_TARGET_DBFS / 20.0)
    floor = (target / 10.0 ** (LEVEL_MAX_GAIN_DB / 20.0)) ** 2
    return (target / np.sqrt(np.maximum(level, floor))).astype(np.float32)


def _level_many(vads, frames: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """:meth:`StreamingVAD._level` of many streams at once, without a Python loop over frames.

    ``frames``: float32 ``[N, 576]``, the completed frames of ``vads`` one stream after another
    (``counts[j]`` >= 1 of stream ``j``). Returns the float32 gains ``[N]`` (equal to each stream's
    :func:`level_gains`) and moves every stream's energy history on, as ``_level`` does."""
    e = frame_energies(frames[:, CONTEXT:])
    m, depth, k = len(vads), int(counts.max()), LEVEL_FRAMES - 1
    rows = np.repeat(np.arange(m), counts)
    cols = np.arange(e.shape[0]) - np.repeat(np.cumsum(counts) - counts, counts)
    cat = np.zeros((m, k + depth), np.float64)
    cat[:, :k] = np.stack([v._energies for v in vads])
    cat[rows, k + cols] = e
    level = np.lib.stride_tricks.sliding_window_view(cat, LEVEL_FRAMES, axis=1).max(axis=-1)  # [m, depth]
    hist = cat[np.arange(m)[:, None], counts[:, None] + np.arange(k)]  # each stream's last k energies
    for j, v in enumerate(vads):
        v._energies = hist[j]
    return _gains_of_levels(level[rows, cols])


def _recording_gains(x: np.ndarray, first: int, stop: int) -> np.ndarray:
    """:func:`level_gains` of frames ``[first, stop)`` of 16 kHz ``x`` (the last frame of ``x``
    zero-padded), float32 ``[stop - first]``: the same values as those frames of the whole
    recording's gains (the energies of the frames before ``first`` are read too)."""
    e0 = max(0, first - (LEVEL_FRAMES - 1))
    e = np.zeros(stop - e0, np.float64)
    whole = min(stop, x.shape[0] // FRAME)
    for t0 in range(e0, whole, _MAX_FRAMES_PER_CALL):  # a block at a time: no float64 copy of x
        t1 = min(whole, t0 + _MAX_FRAMES_PER_CALL)
        e[t0 - e0:t1 - e0] = frame_energies(x[t0 * FRAME:t1 * FRAME].reshape(-1, FRAME))
    if whole < stop and whole * FRAME < x.shape[0]:
        last = np.zeros((1, FRAME), np.float32)
        last[0, :x.shape[0] - whole * FRAME] = x[whole * FRAME:]
        e[whole - e0] = frame_energies(last)[0]
    k = first - e0
    prev = np.concatenate([np.zeros(LEVEL_FRAMES - 1 - k, np.float64), e[:k]])
    return level_gains(e[k:], prev)


def speech_probabilities(samples: np.ndarray, sample_rate: int = 16000,
                         frames: tuple[int, int] | None = None) -> np.ndarray:
    """Silero speech probability per 32 ms frame, on level-normalised input.

    Each frame (512 samples and its 64 of context) is multiplied by :func:`level_gains` of the
    second ending with it before the network sees it (see :data:`LEVEL_FRAMES`: quiet speech after
    loud music is otherwise missed), as :class:`StreamingVAD` and
    :func:`flashasr.audio.silero_torch.speech_probabilities_batch` do.

    The LSTM state restarts from zero every :data:`STATE_CHUNK_FRAMES` frames (16.4 s), each
    chunk warmed up on the :data:`STATE_WARMUP_FRAMES` (4 s) before it, as
    :func:`flashasr.audio.silero_torch.speech_probabilities_batch` does on the GPU (same result
    up to float rounding): see :data:`STATE_CHUNK_FRAMES` for why. (Silero's own
    ``get_speech_timestamps`` carries one state over the whole file.)

    Args:
        samples: float32 [N] mono (other rates are resampled to 16 kHz with soxr first).
        sample_rate: Hz of ``samples``.
        frames: ``(lo, hi)``: only frames ``[lo, hi)`` (``lo`` a multiple of
            :data:`STATE_CHUNK_FRAMES`, ``hi`` clipped to T): the same values as those frames of the
            whole result, so slices computed apart (in parallel, or as separate jobs) join into it.
    Returns:
        float32 [T], T = ceil(N16 / 512) where N16 is the length at 16 kHz; frame t covers
        seconds [t * 0.032, (t + 1) * 0.032). The last frame is zero-padded. With ``frames``:
        float32 [min(hi, T) - lo].
    Raises:
        AudioArgumentError: samples not 1-D, a bad rate, or ``lo`` not on a state chunk's start.
    """
    x = _as_16k(samples, sample_rate)
    t_total = -(-x.shape[0] // FRAME)
    lo, hi = (0, t_total) if frames is None else (int(frames[0]), min(t_total, int(frames[1])))
    if lo < 0 or lo % STATE_CHUNK_FRAMES or (frames is not None and hi < lo):
        raise AudioArgumentError(f"frames {frames}: the start must be a multiple of {STATE_CHUNK_FRAMES} "
                                 "and the end not before it")
    out = np.empty(hi - lo, np.float32)
    g0 = max(0, lo - STATE_WARMUP_FRAMES)
    gains = _recording_gains(x, g0, hi)
    for keep in range(lo, hi, STATE_CHUNK_FRAMES):
        start = max(0, keep - STATE_WARMUP_FRAMES)
        stop = min(hi, keep + STATE_CHUNK_FRAMES)
        out[keep - lo:stop - lo] = _frames_from_zero_state(x, start, stop, gains[start - g0:stop - g0])[keep - start:]
    return out


def _frames_from_zero_state(x: np.ndarray, first: int, stop: int, gains: np.ndarray) -> np.ndarray:
    """Probabilities of frames ``[first, stop)`` of 16 kHz ``x``, the LSTM started from zero at
    ``first`` (its frame context: the 64 samples before it, zeros at the start); frame t's row
    multiplied by ``gains[t - first]``."""
    out = np.empty(stop - first, np.float32)
    h = np.zeros((1, 1, 128), np.float32)
    c = np.zeros((1, 1, 128), np.float32)
    prev_ctx = np.zeros(CONTEXT, np.float32)
    if first:
        prev_ctx[:] = x[first * FRAME - CONTEXT:first * FRAME]
    for t0 in range(first, stop, _MAX_FRAMES_PER_CALL):
        tb = min(_MAX_FRAMES_PER_CALL, stop - t0)
        block = np.zeros((tb, CONTEXT + FRAME), np.float32)
        seg = x[t0 * FRAME:(t0 + tb) * FRAME]
        whole = seg.shape[0] // FRAME
        block[:whole, CONTEXT:] = seg[: whole * FRAME].reshape(whole, FRAME)
        if whole < tb:  # zero-padded last frame
            block[whole, CONTEXT:CONTEXT + seg.shape[0] - whole * FRAME] = seg[whole * FRAME:]
        block[0, :CONTEXT] = prev_ctx
        if tb > 1:
            block[1:, :CONTEXT] = block[:-1, -CONTEXT:]
        prev_ctx = block[-1, -CONTEXT:].copy()
        block *= gains[t0 - first:t0 - first + tb, None]
        out[t0 - first:t0 - first + tb], h, c = _run_frames(block, h, c)
    return out


def _frame_segments(p: np.ndarray, threshold: float, neg_threshold: float,
                    min_silence_frames: int, min_speech_frames: int) -> list[tuple[int, int]]:
    """Hysteresis over frame probabilities -> [(start_frame, end_frame)) speech spans."""
    segs: list[tuple[int, int]] = []
    in_speech = False
    start = 0
    sil_start = -1
    above = p >= threshold
    below = p < neg_threshold
    for t in range(p.shape[0]):
        if not in_speech:
            if above[t]:
                in_speech, start, sil_start = True, t, -1
        elif above[t]:
            sil_start = -1
        elif below[t]:
            if sil_start < 0:
                sil_start = t
            if t + 1 - sil_start >= min_silence_frames:
                segs.append((start, sil_start))
                in_speech, sil_start = False, -1
    if in_speech:
        segs.append((start, sil_start if sil_start >= 0 else p.shape[0]))
    return [(s, e) for s, e in segs if e - s >= min_speech_frames]


def _segments_samples(p: np.ndarray, n: int, *, threshold: float, min_silence_s: float,
                      min_speech_s: float, pad_s: float, neg_threshold: float | None,
                      rate: int) -> list[tuple[int, int]]:
    """Speech spans as sample ranges at ``rate`` (padded, clipped to [0, n), merged)."""
    neg = max(threshold - 0.15, 0.01) if neg_threshold is None else neg_threshold
    fs = _frame_segments(p, threshold, neg, max(1, int(round(min_silence_s / FRAME_S))),
                         int(round(min_speech_s / FRAME_S)))
    spf = FRAME * rate / VAD_RATE
    pad = int(round(pad_s * rate))
    out: list[tuple[int, int]] = []
    for s, e in fs:
        a = max(0, int(round(s * spf)) - pad)
        b = min(n, int(round(e * spf)) + pad)
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def speech_segments(samples: np.ndarray, sample_rate: int = 16000, *, threshold: float = 0.5,
                    min_silence_s: float = 0.1, min_speech_s: float = 0.25, pad_s: float = 0.03,
                    neg_threshold: float | None = None) -> list[tuple[float, float]]:
    """Speech spans in seconds, ``[(start_s, end_s), ...]`` sorted and non-overlapping.

    Args:
        samples: float32 [N] mono at ``sample_rate`` (resampled to 16 kHz for the model).
        threshold: speech probability that starts speech (Silero default 0.5).
        min_silence_s: speech ends only after this much audio below ``neg_threshold``.
        min_speech_s: shorter spans are dropped.
        pad_s: seconds added on both sides (clipped to the signal; touching spans merge).
        neg_threshold: probability below which audio counts as silence
            (default ``threshold - 0.15``, as in Silero's ``get_speech_timestamps``).
    Returns:
        list of (start, end) seconds within [0, N / sample_rate]. Empty if no speech.
    """
    x = np.asarray(samples)
    p = speech_probabilities(x, sample_rate)
    segs = _segments_samples(p, x.shape[0], threshold=threshold, min_silence_s=min_silence_s,
                             min_speech_s=min_speech_s, pad_s=pad_s, neg_threshold=neg_threshold,
                             rate=sample_rate)
    return [(a / sample_rate, b / sample_rate) for a, b in segs]


def _cut_long(seg: tuple[int, int], max_len: int, p: np.ndarray, rate: int) -> list[tuple[int, int]]:
    """Cut one span longer than max_len at the least speech-like frame in the second half
    of each max-length window (no pause long enough for the VAD)."""
    spf = FRAME * rate / VAD_RATE
    out = []
    a, b = seg
    while b - a > max_len:
        lo = int(np.ceil((a + max_len // 2) / spf))
        hi = int((a + max_len) // spf)
        if hi - lo >= 1 and hi <= p.shape[0]:
            win = p[lo:hi]
            if win.shape[0] >= 3:  # smooth over 3 frames (~100 ms)
                win = np.convolve(win, np.ones(3, np.float32) / 3, mode="same")
            cut = int(round((lo + int(np.argmin(win))) * spf))
            cut = min(max(cut, a + 1), a + max_len)
        else:
            cut = a + max_len
        out.append((a, cut))
        a = cut
    out.append((a, b))
    return out


def _group(pieces: list[tuple[int, int]], max_len: int, min_len: int) -> list[tuple[int, int]]:
    """Greedy over pieces: each chunk ends at the longest pause (gap between consecutive
    pieces) among the cut points that keep it <= max_len, preferring cuts that leave it at
    least min_len long."""
    chunks = []
    i = 0
    n = len(pieces)
    while i < n:
        start = pieces[i][0]
        j = i
        while j + 1 < n and pieces[j + 1][1] - start <= max_len:
            j += 1
        if j == n - 1:
            chunks.append((start, pieces[j][1]))
            break
        best, best_gap, best_ok = i, -1, False
        for k in range(i, j + 1):  # cut between k and k+1
            gap = pieces[k + 1][0] - pieces[k][1]
            ok = pieces[k][1] - start >= min_len
            if (ok and not best_ok) or (ok == best_ok and gap > best_gap):
                best, best_gap, best_ok = k, gap, ok
        chunks.append((start, pieces[best][1]))
        i = best + 1
    return chunks


# split_for_asr's VAD settings: a longer silence and padding than speech_segments' defaults, to keep
# ASR context (also the speech spans the pipeline hands to the models with each piece)
ASR_VAD = {"threshold": 0.5, "min_silence_s": 0.3, "min_speech_s": 0.25, "pad_s": 0.2}


def _probs_for(x: np.ndarray, sample_rate: int, probs: np.ndarray | None) -> np.ndarray:
    n = int(x.shape[0])
    p = speech_probabilities(x, sample_rate) if probs is None else np.asarray(probs, np.float32).reshape(-1)
    if probs is not None and sample_rate == VAD_RATE and p.shape[0] != -(-n // FRAME):
        raise AudioArgumentError(f"probs holds {p.shape[0]} frames; {n} samples need {-(-n // FRAME)}")
    return p


def asr_speech_spans(samples: np.ndarray, sample_rate: int = 16000, *, probs: np.ndarray | None = None,
                     threshold: float = ASR_VAD["threshold"], min_silence_s: float = ASR_VAD["min_silence_s"],
                     min_speech_s: float = ASR_VAD["min_speech_s"],
                     pad_s: float = ASR_VAD["pad_s"]) -> list[tuple[int, int]]:
    """The speech spans :func:`split_for_asr` cuts around, as sample ranges.

    Args:
        samples: float32 [N] mono at ``sample_rate``.
        probs: the speech probabilities already computed (see :func:`split_for_asr`); None: here.
        threshold, min_silence_s, min_speech_s, pad_s: as :func:`speech_segments` (defaults
            :data:`ASR_VAD`).
    Returns:
        sorted, non-overlapping ``[(start_sample, end_sample), ...]`` at ``sample_rate`` (padded,
        clipped to [0, N), merged when they touch); empty when no speech is detected.
    """
    x = np.asarray(samples)
    if x.shape[0] == 0:
        return []
    p = _probs_for(x, sample_rate, probs)
    return _segments_samples(p, int(x.shape[0]), threshold=threshold, min_silence_s=min_silence_s,
                             min_speech_s=min_speech_s, pad_s=pad_s, neg_threshold=None, rate=sample_rate)


def split_for_asr(samples: np.ndarray, sample_rate: int = 16000, *, max_segment_s: float = 30.0,
                  min_segment_s: float | None = None, method: str = "vad", overlap_s: float = 0.0,
                  threshold: float = ASR_VAD["threshold"], min_silence_s: float = ASR_VAD["min_silence_s"],
                  min_speech_s: float = ASR_VAD["min_speech_s"], pad_s: float = ASR_VAD["pad_s"],
                  probs: np.ndarray | None = None, with_speech: bool = False):
    """Cut a long mono signal into ranges an ASR model can take (Whisper: 30 s windows).

    Args:
        samples: float32 [N] mono at ``sample_rate``.
        max_segment_s: every range is at most this long (seconds).
        min_segment_s: ``vad``: among the cut points that keep a range <= max, those that
            leave it at least this long are preferred (fewer, fuller windows; the longest
            pause among them wins). Default ``max_segment_s / 2``, so ranges are at least
            half full except the last one or where no pause exists. ``fixed``: unused.
        method: ``"vad"``: ranges cover every detected speech span (padded by ``pad_s``),
            consecutive spans are grouped and cut at the longest pause that keeps the range
            <= max; a span with no usable pause is cut at its least speech-like 32 ms frame
            in the second half of the window; stretches without speech are left out.
            ``"fixed"``: windows of ``max_segment_s`` every ``max_segment_s - overlap_s``
            seconds covering [0, N) (the last one may be shorter).
        overlap_s: ``fixed`` only: seconds shared by consecutive windows.
        threshold, min_silence_s, min_speech_s, pad_s: as :func:`speech_segments`
            (a longer silence and padding than there by default, to keep ASR context).
        probs: ``vad``: the speech probabilities of ``samples`` already computed (float32
            ``[ceil(N16 / 512)]``, e.g. by :func:`flashasr.audio.silero_torch.speech_probabilities_batch`
            for many recordings at once on the GPU); None computes them here (ONNX, CPU).
        with_speech: ``vad`` only: also return the speech spans the ranges were cut around
            (:func:`asr_speech_spans`), computed from the same probabilities.
    Returns:
        ``[(start_sample, end_sample), ...]`` at ``sample_rate``, sorted; ``samples[a:b]``
        is one ASR input whose local times add ``a / sample_rate`` to become global.
        ``vad`` ranges do not overlap; empty list when no speech is detected. With
        ``with_speech``: ``(ranges, speech_spans)``.
    Raises:
        AudioArgumentError: bad method, non-positive max, overlap >= max.
    """
    x = np.asarray(samples)
    n = int(x.shape[0])
    if max_segment_s <= 0:
        raise AudioArgumentError(f"max_segment_s must be positive, got {max_segment_s}")
    max_len = max(1, int(max_segment_s * sample_rate))
    if method == "fixed":
        if not (0 <= overlap_s < max_segment_s):
            raise AudioArgumentError(f"overlap_s must be in [0, max_segment_s), got {overlap_s}")
        step = max(1, max_len - int(round(overlap_s * sample_rate)))
        out = []
        a = 0
        while a < n:
            b = min(n, a + max_len)
            out.append((a, b))
            if b == n:
                break
            a += step
        return out
    if method != "vad":
        raise AudioArgumentError(f"method must be 'vad' or 'fixed', got {method!r}")
    if n == 0:
        return ([], []) if with_speech else []
    p = _probs_for(x, sample_rate, probs)
    segs = _segments_samples(p, n, threshold=threshold, min_silence_s=min_silence_s,
                             min_speech_s=min_speech_s, pad_s=pad_s, neg_threshold=None,
                             rate=sample_rate)
    pieces: list[tuple[int, int]] = []
    for s in segs:
        pieces.extend(_cut_long(s, max_len, p, sample_rate) if s[1] - s[0] > max_len else [s])
    if min_segment_s is None:
        min_segment_s = max_segment_s / 2
    ranges = _group(pieces, max_len, int(min_segment_s * sample_rate))
    return (ranges, segs) if with_speech else ranges


def iter_asr_chunks(source, *, max_segment_s: float = 30.0, method: str = "vad",
                    block_seconds: float = 300.0, overlap_s: float = 0.0,
                    warnings: list[str] | None = None, **kwargs):
    """Stream ASR-sized pieces of an input of any length with bounded memory.

    Decodes ``source`` with :func:`flashasr.audio.iter_audio` (16 kHz) and cuts it like
    :func:`split_for_asr` (same ``method``, ``max_segment_s``, ``overlap_s``; further
    keyword arguments such as ``threshold`` or ``min_segment_s`` go to it, and
    ``sample_rate`` / ``raw_format`` / ``channels`` / ``max_duration`` to the decoder).

    Yields:
        ``(start_sample, samples)``: the global 16 kHz sample index of ``samples[0]`` and a
        float32 [n] copy, n <= ``max_segment_s`` * 16000; in order, non-overlapping for
        ``vad``. Add ``start_sample / 16000`` to local timestamps.

    Memory: one decode block (``block_seconds``) plus at most ``2 * max_segment_s`` of held
    back audio. The last ``max_segment_s`` of each buffer is held back and re-cut with the
    next block, so a range is only emitted once the audio after it is known; VAD restarts
    (fresh LSTM state) at each held-back start, which lies at a speech onset minus padding.
    """
    from .decode import iter_audio

    dec_keys = {"sample_rate", "raw_format", "channels", "max_duration"}
    dec_kw = {k: kwargs.pop(k) for k in list(kwargs) if k in dec_keys}
    rate = VAD_RATE
    max_len = int(max_segment_s * rate)
    if method == "fixed":
        step = max(1, max_len - int(round(overlap_s * rate)))
    buf = np.zeros(0, np.float32)
    start = 0  # global index of buf[0]
    blocks = iter_audio(source, target_rate=rate, block_seconds=block_seconds, warnings=warnings, **dec_kw)
    final = False
    while not final:
        nxt = next(blocks, None)
        if nxt is None:
            final = True
        else:
            buf = np.concatenate([buf, nxt]) if buf.shape[0] else nxt
            if buf.shape[0] < 3 * max_len:
                continue
        if buf.shape[0] == 0:
            break
        if method == "fixed":
            a = 0
            while a < buf.shape[0] and (final or a + max_len <= buf.shape[0]):
                b = min(buf.shape[0], a + max_len)
                yield start + a, buf[a:b].copy()
                if b == buf.shape[0] and final:
                    break
                a += step
            buf, start = buf[a:], start + a
            continue
        ranges = split_for_asr(buf, rate, max_segment_s=max_segment_s, method=method, **kwargs)
        guard = buf.shape[0] - max_len
        cut = None
        for a, b in ranges:
            if not final and b >= guard:
                break
            yield start + a, buf[a:b].copy()
            cut = b
        if final:
            break
        if cut is None:
            held = [a for a, b in ranges if b >= guard]
            cut = min(held[0], guard) if held else guard
        buf, start = buf[cut:].copy(), start + cut


@dataclass
class VADEvent:
    """A StreamingVAD event.

    ``type``: ``"speech_started"`` or ``"speech_stopped"``; ``time``: seconds from the start
    of the stream where speech starts (onset minus ``prefix_padding_ms``, clipped) or stops
    (end of the last speech frame); ``emitted_at``: seconds of audio fed when the decision
    was made (``emitted_at - time`` is the detection latency).
    """

    type: str
    time: float
    emitted_at: float


class StreamingVAD:
    """Incremental Silero VAD for one audio stream (OpenAI Realtime ``server_vad`` semantics).

    Feed 16 kHz mono float32 chunks of any size with :meth:`feed`; it returns the
    :class:`VADEvent` s decided by that chunk. Speech starts at the first 32 ms frame with
    probability >= ``threshold`` (reported ``prefix_padding_ms`` earlier, never before the
    previous stop); it stops once ``silence_duration_ms`` of frames lie below
    ``threshold - 0.15`` (reported at the end of the last speech frame). ``min_speech_ms``
    (default 0) delays ``speech_started`` until that much speech was seen.

    The LSTM state restarts every :data:`STATE_CHUNK_FRAMES` frames (16.4 s) from a state warmed
    up on the 4 s before, as :func:`speech_probabilities` does: a stream's probabilities equal the
    offline ones on the same audio (float rounding), and hours of stream cannot drift the state
    (after a minute of whale song one carried state missed quiet speech; a quarter more frames run).

    State per stream is bounded: < 576 samples of pending audio, the LSTM state and the warming
    one (2 x 2 x 128 floats) and a few counters (about 3 KB); the ONNX session is shared by all streams
    (onnxruntime ``run`` is thread-safe). Cost, measured on a loaded 2-core Xeon VM: about
    6-7 ms of one CPU core per second of audio fed in 20 ms chunks (one ONNX call per 32 ms
    frame), about 3-4 ms/s fed in 0.5 s chunks (bench/bench_cpu_audio.py, docs/AUDIO.md).
    A server with many live streams should call :meth:`feed_many` once per tick: it batches
    the frames of all streams into one ONNX call per frame position (1.6-3x cheaper per
    stream for 32 streams fed 20 ms chunks, same events).
    """

    def __init__(self, *, threshold: float = 0.5, prefix_padding_ms: int = 300,
                 silence_duration_ms: int = 500, min_speech_ms: int = 0,
                 sample_rate: int = 16000):
        if sample_rate != VAD_RATE:
            raise AudioArgumentError(f"StreamingVAD takes 16 kHz audio, got sample_rate={sample_rate}")
        if not 0.0 < threshold < 1.0:
            raise AudioArgumentError(f"threshold must be in (0, 1), got {threshold}")
        self.threshold = float(threshold)
        self.neg_threshold = max(self.threshold - 0.15, 0.01)
        self.prefix_padding_s = max(0, prefix_padding_ms) / 1000.0
        self.silence_frames = max(1, int(round(silence_duration_ms / 1000.0 / FRAME_S)))
        self.min_speech_frames = max(1, int(round(min_speech_ms / 1000.0 / FRAME_S)))
        _get_session()
        self.reset()

    def reset(self) -> None:
        """Forget everything (new stream; times restart at 0)."""
        self._h = np.zeros((1, 1, 128), np.float32)
        self._c = np.zeros((1, 1, 128), np.float32)
        self._shadow: tuple[np.ndarray, np.ndarray] | None = None  # the next chunk's state, warming up
        self._buf = np.zeros(CONTEXT + FRAME, np.float32)  # [context | pending frame]
        self._energies = np.zeros(LEVEL_FRAMES - 1, np.float64)  # the last frames' (level_gains)
        self._fill = 0  # samples pending in the frame part
        self._pad = 0  # zero samples added by flush()
        self.frames = 0  # frames processed
        self.speaking = False
        self._onset = -1  # frame where the current (candidate) speech started
        self._speech_run = 0
        self._sil_start = -1
        self._last_stop = 0.0
        self.last_probability = 0.0

    @property
    def time(self) -> float:
        """Seconds of audio fed so far (including pending samples)."""
        return (self.frames * FRAME + self._fill - self._pad) / VAD_RATE

    def _take_frames(self, chunk: np.ndarray) -> np.ndarray:
        """Append a chunk; return the completed frames with their context, float32 [T, 576]."""
        x = np.asarray(chunk, np.float32).reshape(-1)
        n = x.shape[0]
        k = min(FRAME - self._fill, n)
        whole = (n - k) // FRAME if self._fill + k == FRAME else 0
        t = (1 if self._fill + k == FRAME else 0) + whole
        out = np.empty((t, CONTEXT + FRAME), np.float32)
        self._buf[CONTEXT + self._fill:CONTEXT + self._fill + k] = x[:k]
        self._fill += k
        if self._fill < FRAME:
            return out  # T = 0
        out[0] = self._buf
        pos = k
        if whole:
            out[1:, CONTEXT:] = x[pos:pos + whole * FRAME].reshape(whole, FRAME)
            out[1:, :CONTEXT] = out[:-1, -CONTEXT:]
            pos += whole * FRAME
        self._buf[:CONTEXT] = out[-1, -CONTEXT:]
        rest = n - pos
        self._buf[CONTEXT:CONTEXT + rest] = x[pos:]
        self._fill = rest
        return out

    def _level(self, frames: np.ndarray) -> np.ndarray:
        """Completed frames ``[T, 576]`` -> the same multiplied by :func:`level_gains` (the offline
        VAD's level normalisation; the last frames' energies carried from call to call)."""
        if frames.shape[0] == 0:
            return frames
        e = frame_energies(frames[:, CONTEXT:])
        gains = level_gains(e, self._energies)
        self._energies = np.concatenate([self._energies, e])[-(LEVEL_FRAMES - 1):]
        return frames * gains[:, None]

    def feed(self, chunk: np.ndarray) -> list[VADEvent]:
        """Process a float32 [n] 16 kHz chunk (any n >= 0); returns the events it decided."""
        events: list[VADEvent] = []
        frames = self._take_frames(chunk)
        for t0 in range(0, frames.shape[0], _MAX_FRAMES_PER_CALL):
            self._process(frames[t0:t0 + _MAX_FRAMES_PER_CALL], events)
        return events

    @staticmethod
    def feed_many(items) -> list[list[VADEvent]]:
        """Feed many streams at once: ``items`` = [(StreamingVAD, chunk), ...] (distinct
        streams). Returns each stream's events, in order.

        The completed frames of all streams are batched into one ONNX call per frame
        position (the stock Silero model with a batch of states), which costs about a third
        of per-stream calls when many live streams each deliver a frame or two per tick.
        Identical probabilities and events as calling :meth:`feed` on each stream. The level
        normalisation, the states and the probabilities of all streams are gathered and scattered
        with numpy, not per frame in Python: 333 streams fed 20 ms packets cost 14.9 ms per tick on
        the 2-core VM (11.4 of it in onnxruntime, outside the GIL), 29.3 ms with the per-stream
        loops before (17.1 ms holding the GIL).
        """
        vads = [v for v, _ in items]
        if len({id(v) for v in vads}) != len(vads):
            raise AudioArgumentError("feed_many: each stream may appear only once per call")
        frames = [v._take_frames(c) for v, c in items]
        counts = np.array([f.shape[0] for f in frames], np.int64)
        live = np.flatnonzero(counts)
        out: list[list[VADEvent]] = [[] for _ in items]
        if not live.size:
            return out
        x = np.concatenate([frames[i] for i in live])  # [N, 576]: stream after stream
        x *= _level_many([vads[i] for i in live], x, counts[live])[:, None]
        first = np.zeros(len(items), np.int64)
        first[live] = np.cumsum(counts[live]) - counts[live]  # each stream's first row in x
        probs = np.empty(x.shape[0], np.float32)
        sr = np.array(VAD_RATE, np.int64)
        for r in range(int(counts.max())):  # one ONNX call per frame position, all streams in it
            idx = live[counts[live] > r]
            for i in idx:
                vads[i]._restart_state(vads[i].frames + r)
            shadows = [i for i in idx if vads[i]._shadow is not None]  # their rows follow the main ones
            h = [vads[i]._h for i in idx] + [vads[i]._shadow[0] for i in shadows]
            c = [vads[i]._c for i in idx] + [vads[i]._shadow[1] for i in shadows]
            state = np.concatenate([np.concatenate(h, axis=1), np.concatenate(c, axis=1)])  # [2, n, 128]
            rows = first[idx] + r
            batch = x[np.concatenate([rows, first[shadows] + r]) if shadows else rows]
            p, state = _get_batch_session().run(None, {"input": batch, "state": state, "sr": sr})
            probs[rows] = np.asarray(p, np.float32).reshape(-1)[:len(idx)]
            for j, i in enumerate(idx):
                vads[i]._h, vads[i]._c = state[0:1, j:j + 1], state[1:2, j:j + 1]
            for j, i in enumerate(shadows, start=len(idx)):
                vads[i]._shadow = (state[0:1, j:j + 1], state[1:2, j:j + 1])
        for i in live:
            vads[i]._apply(probs[first[i]:first[i] + counts[i]], out[i])
        return out

    def _restart_state(self, pos: int) -> int:
        """Before frame ``pos``: the state restarts as :func:`speech_probabilities` restarts it
        (every :data:`STATE_CHUNK_FRAMES` frames, from a shadow state that has run the
        :data:`STATE_WARMUP_FRAMES` frames before), so a long stream's probabilities equal the
        offline ones on the same audio and its state cannot drift for hours. Returns the frames
        from ``pos`` to the next restart point (a shadow's start or its taking over)."""
        r = pos % STATE_CHUNK_FRAMES
        warm = STATE_CHUNK_FRAMES - STATE_WARMUP_FRAMES
        if r == 0 and self._shadow is not None:
            (self._h, self._c), self._shadow = self._shadow, None
        elif r == warm:
            self._shadow = (np.zeros((1, 1, 128), np.float32), np.zeros((1, 1, 128), np.float32))
        return warm - r if r < warm else STATE_CHUNK_FRAMES - r

    def _process(self, block: np.ndarray, events: list[VADEvent]) -> None:
        if block.shape[0] == 0:
            return
        block = self._level(block)
        probs = np.empty(block.shape[0], np.float32)
        i = 0
        while i < block.shape[0]:  # runs of frames between the state's restart points
            run = block[i:i + self._restart_state(self.frames + i)]
            probs[i:i + run.shape[0]], self._h, self._c = _run_frames(run, self._h, self._c)
            if self._shadow is not None:
                self._shadow = _run_frames(run, *self._shadow)[1:]
            i += run.shape[0]
        self._apply(probs, events)

    def _apply(self, probs: np.ndarray, events: list[VADEvent]) -> None:
        """The server_vad state machine over per-frame probabilities."""
        for p in probs:
            t = self.frames
            self.frames += 1
            if not self.speaking:
                if p >= self.threshold:
                    if self._speech_run == 0:
                        self._onset = t
                    self._speech_run += 1
                    if self._speech_run >= self.min_speech_frames:
                        self.speaking = True
                        self._sil_start = -1
                        start = max(self._last_stop, self._onset * FRAME_S - self.prefix_padding_s, 0.0)
                        events.append(VADEvent("speech_started", start, self.frames * FRAME_S))
                elif p < self.neg_threshold:
                    self._speech_run = 0
            else:
                if p >= self.threshold:
                    self._sil_start = -1
                elif p < self.neg_threshold:
                    if self._sil_start < 0:
                        self._sil_start = t
                    if self.frames - self._sil_start >= self.silence_frames:
                        self.speaking = False
                        self._speech_run = 0
                        self._last_stop = self._sil_start * FRAME_S
                        events.append(VADEvent("speech_stopped", self._last_stop, self.frames * FRAME_S))
                        self._sil_start = -1
        if probs.shape[0]:
            self.last_probability = float(probs[-1])

    def flush(self) -> list[VADEvent]:
        """End of stream: process the pending partial frame (zero-padded) and close an open
        speech span with a ``speech_stopped`` at the end of the audio fed."""
        events: list[VADEvent] = []
        end = self.time
        if self._fill:
            self._pad += FRAME - self._fill
            self._buf[CONTEXT + self._fill:] = 0.0
            self._process(self._buf[None, :].copy(), events)
            self._fill = 0
        if self.speaking:
            stop = self._sil_start * FRAME_S if self._sil_start >= 0 else end
            self.speaking = False
            self._last_stop = min(stop, end)
            events.append(VADEvent("speech_stopped", self._last_stop, end))
        return events


__all__ = ["STATE_CHUNK_FRAMES", "STATE_WARMUP_FRAMES", "LEVEL_FRAMES", "LEVEL_TARGET_DBFS", "LEVEL_MAX_GAIN_DB",
           "frame_energies", "level_gains", "speech_probabilities", "speech_segments", "split_for_asr", "asr_speech_spans", "ASR_VAD", "iter_asr_chunks",
           "StreamingVAD",
           "VADEvent",
           "FRAME_S", "VAD_RATE"]
