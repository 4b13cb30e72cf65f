"""Chunked streaming encoder for Parakeet-TDT partial transcripts (plain PyTorch, CPU or GPU).

Each streaming partial used to re-encode the whole utterance so far (cost quadratic in its
length). Here every live stream keeps per-layer state and each step encodes only the NEW audio,
as NeMo's cache-aware streaming does (``ConformerEncoder.cache_aware_stream_step``: attention
keys/values of the last frames and the depthwise-conv state per layer), applied to the offline-
trained model for provisional partials. The final of an utterance still re-encodes it offline
(exact); this path never produces finals.

One step for a batch of streams at different positions (per-stream state in slots of a
:class:`StatePool`; shapes fixed by the chunk ``C`` and the left context ``L``)::

    samples (host) --pre-emphasis, window of sub*(C+1) feature frames (sub = 8, the subsampling)-->
    log-mel [B, F, M] --running per-feature mean/std of the stream's frames so far (float64 sums)-->
    dw_striding subsampling of the window (left/right time masks) -> C+1 frames, the first dropped
    --> for each Conformer layer: FF, rel-pos attention of the C new frames over [L cached | C new]
        keys/values, conv module over [k-1)/2 cached | C new] steps, FF, norm; caches shifted
    --> joint encoder projection --> TDT label looping from the carried decoder state

What is exact, and what is not (tests/test_stream_encoder.py checks each exact claim):

* A feature frame is computed once its 512 samples have arrived: equal to the offline log-mel of
  the whole stream at that frame (the STFT is local).
* An encoder frame is produced once its subsampling receptive field (feature frames ``8v-7 ..
  8v+7``) exists: the windowed subsampling (overlap of one encoder frame's 8 feature frames,
  output 0 dropped, first window masked on the left) equals the subsampling of the whole stream.
* The first chunk equals the offline encoder on the same (normalised) features. So a flushed
  step equals the offline encoder on the stream's audio (features, frames and tokens) exactly when
  the utterance is one chunk: the flushed step is the stream's first and ``C`` covers all its
  encoder frames (``C >=`` the encoder's output length for the audio: about ``C x 80 ms`` of
  audio at 8x subsampling of 10 ms feature frames). A step runs at most ``C`` frames per chunk,
  so a flush with more frames left, or after earlier steps, is chunks of the kind below, not the
  offline encoder.
* Later chunks: frames never see the future beyond their chunk (attention and the depthwise
  conv's right half get zeros there), the past only through the last ``L`` frames, and features
  are normalised with the statistics of the stream so far. This is NOT the offline computation:
  partials drift from the final; the drift is measured (``bench/bench_stream_scale.py``,
  ``docs/SERVING.md``). The computation equals a block-masked offline encoder (each chunk's
  frames attend to ``[chunk start - L, chunk end)``, conv inputs beyond the chunk are zero),
  which the tests use as the exact reference.
* The TDT decoder's state is carried across chunks (:class:`~.decoder.DecoderCarry`); decoding
  chunk by chunk gives exactly the tokens of decoding the same encoder frames whole.

Cost per step and row: ``C`` encoder frames through the Conformer layers (attention over at most
``L + C`` keys), ``8 (C + 1)`` feature frames through the subsampling (one frame of overlap), the
decoder over ``C`` frames: constant in the utterance's length. Memory per stream: ``2 x n_layers
x L x d_model`` cached keys/values + ``n_layers x (k-1)/2 x d_model`` conv state, plus a few
hundred samples and the tokens so far.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ...errors import FlashASRError, UnsupportedModelError
from ..base import as_waveform, not_samples
from ...types import StreamResult
from .decoder import DecoderCarry, label_looping_chunk
from .encoder import relative_positions
from .tokenizer import WORD_MARKER

_MASK_VALUE = -10000.0
_NORM_EPS = 1e-5


def _version(t: torch.Tensor) -> int:
    """A tensor's in-place version counter (-1 for inference tensors, which have none: a model
    loaded under ``torch.inference_mode()``)."""
    try:
        return t._version
    except RuntimeError:
        return -1


def add_norm(r: torch.Tensor, y: torch.Tensor | None, alpha: float, norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """A Conformer block's residual step and the LayerNorm after it: ``r2 = r + alpha * y`` (``r``
    when ``y`` is None) and ``norm(r2)``, both ``[..., d]``; the plain PyTorch operations. The GPU
    streamer runs the same step as one kernel (:func:`flashasr.engine.triton_norm.add_layer_norm`)."""
    r2 = r if y is None else torch.add(r, y, alpha=alpha)
    return r2, norm(r2)


class StreamError(FlashASRError):
    """A streaming partial request that cannot be served (closed or evicted stream, no slot)."""

    code = "stream_unavailable"
    status = 409


@dataclass(frozen=True)
class StreamingConfig:
    """Shape of the chunked streaming step.

    Attributes:
        left_frames: ``L``, encoder frames of left context kept per layer (80 ms each; 128 = 10.24 s).
        chunk_frames: ``C``, most new encoder frames of one stream per step (a request with more
            is run as several consecutive steps). Pick the partial cadence in frames: every
            step computes ``C`` frames per row, so a larger ``C`` is padding.
        slots: initial number of stream slots (the pool doubles when full, up to ``max_slots``).
        max_slots: most live streams (a new stream beyond it gets :class:`StreamError`).
        idle_s: a stream not stepped for this long is dropped (its front end went away).
        max_batch: most streams in one device step (the GPU's largest graph bucket; more rows run
            as several launches).
        buckets_per_octave: the GPU's row buckets (one CUDA graph each, a step padded up to the
            next): powers of two up to 64 rows, then this many evenly spaced sizes per doubling
            (1, the default: powers of two only; 4: 80, 96, 112, 128, 160, ...). A graph's device
            time is about a fixed part plus a cost per row, so a step of 135 rows padded to 256
            wastes a third of it (H100, 4 per doubling: 135 rows 22.7 -> 15.5 ms a step,
            ``profile_stream_step_h100_buckets.json``); each graph keeps memory of its own (H100,
            2,000 slots: 6.8 GiB of graph pools for 19 buckets, 2.6 GiB for 10). In the server, 4
            per doubling gave no consistent gain at 2,000 streams (one machine's pair of runs
            better, another's worse: ``docs/SERVING.md``, tenth session), so the default is 1.
    """

    left_frames: int = 128
    chunk_frames: int = 7
    slots: int = 16
    max_slots: int = 4096
    idle_s: float = 300.0
    max_batch: int = 512
    buckets_per_octave: int = 1

    def __post_init__(self):
        for name in ("left_frames", "chunk_frames", "slots", "max_slots", "max_batch", "buckets_per_octave"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "left_frames" else 1):
                raise FlashASRError(f"StreamingConfig.{name} must be an integer >= "
                                    f"{0 if name == 'left_frames' else 1}, got {v!r}", code="invalid_request")
        if self.buckets_per_octave > 64:
            raise FlashASRError(f"StreamingConfig.buckets_per_octave must be at most 64, got {self.buckets_per_octave!r}",
                                code="invalid_request")
        if not (isinstance(self.idle_s, (int, float)) and self.idle_s > 0):
            raise FlashASRError(f"StreamingConfig.idle_s must be > 0, got {self.idle_s!r}", code="invalid_request")

    def row_buckets(self) -> list[int]:
        """The row buckets (ascending, the last ``max_batch``): see ``buckets_per_octave``."""
        top = int(self.max_batch)
        out, b = [], 1
        while b < min(64, top):
            out.append(b)
            b *= 2
        n = self.buckets_per_octave
        while b < top:  # b a power of two: n sizes from it to the next one, evenly spaced (rounded)
            out += sorted({b + (j * b + n // 2) // n for j in range(n)} - {2 * b})
            b *= 2
        return [x for x in out if x < top] + [top]

    @staticmethod
    def for_cadence(partial_interval_ms: float, **kw) -> "StreamingConfig":
        """``chunk_frames`` = the cadence in 80 ms encoder frames, rounded up (500 ms: 7, 1 s: 13)."""
        c = max(1, int(math.ceil(float(partial_interval_ms) / 80.0 - 1e-9)))
        return StreamingConfig(chunk_frames=c, **kw)


class StatePool:
    """Per-stream state on the model's device, one slot per live stream plus one scratch slot
    (index ``capacity``) that padding rows read and write.

    Tensors (``S`` = capacity + 1): ``k``, ``v`` ``[n_layers, S, H, R, d_k]``, a ring of ``R = L + C``
    entries per stream (attention keys/values; encoder frame ``f`` of the stream lives at ring
    position ``f mod R``: a step writes only its new frames there, in place, and reads the ring
    whole: the last ``L`` frames and the chunk's), ``conv`` ``[n_layers, S, K, d]`` (the conv
    module's GLU outputs of the last ``K = left pad`` steps), ``done [S]`` (encoder frames the
    stream has produced: which ring entries are valid), ``stat_sum``/``stat_sq [S, M]`` float64 and
    ``stat_n [S]`` (log-mel statistics of the frames so far), ``dec_time [S]``, ``dec_gp [S, J]``,
    ``dec_state`` (predictor ``(h, c)``, each ``[layers, S, H]``): the decoder carry.
    """

    def __init__(self, model, cfg: StreamingConfig, capacity: int, device, dtype):
        enc = model.encoder
        layer0 = enc.layers[0]
        att = layer0.self_attn
        self.n_layers = len(enc.layers)
        self.H, self.dk = att.h, att.d_k
        self.d = enc.d_model
        self.K = int(layer0.conv.padding[0])
        self.L = int(cfg.left_frames)
        self.R = self.L + int(cfg.chunk_frames)  # ring length: the left context and one chunk
        self.M = int(model.preprocessor.cfg.features)
        self.device, self.dtype = device, dtype
        self.capacity = 0
        self.ceiling = 1 << 62  # lowered when growing ran out of memory
        self._sos = DecoderCarry.start(1, model.predictor, model.joint, model.blank_id, device)
        self.free: list[int] = []
        self._alloc(capacity)

    def _alloc(self, capacity: int) -> None:
        S, old = capacity + 1, self.capacity
        nl, dev = self.n_layers, self.device
        z = lambda *shape, dt=self.dtype: torch.zeros(*shape, dtype=dt, device=dev)  # noqa: E731
        R = self.R
        new = {"k": z(nl, S, self.H, R, self.dk), "v": z(nl, S, self.H, R, self.dk),
               "conv": z(nl, S, self.K, self.d), "done": z(S, dt=torch.long),
               "stat_sum": z(S, self.M, dt=torch.float64), "stat_sq": z(S, self.M, dt=torch.float64),
               "stat_n": z(S, dt=torch.float64), "dec_time": z(S, dt=torch.long),
               "dec_gp": self._sos.gp.expand(S, -1).clone(),
               "dec_h": self._sos.state[0].expand(-1, S, -1).clone(),
               "dec_c": self._sos.state[1].expand(-1, S, -1).clone()}
        if old:  # keep the live slots (the old scratch slot is dropped)
            for name, t in new.items():
                src = getattr(self, name)
                if name in ("k", "v", "conv"):
                    t[:, :old] = src[:, :old]
                elif name in ("dec_h", "dec_c"):
                    t[:, :old] = src[:, :old]
                else:
                    t[:old] = src[:old]
        for name, t in new.items():
            setattr(self, name, t)
        self.free += list(range(capacity - 1, old - 1, -1))
        self.capacity = capacity
        self.version = getattr(self, "version", 0) + 1  # tensors replaced: captured graphs are stale

    @property
    def scratch(self) -> int:
        return self.capacity

    def acquire(self, max_slots: int, reset: bool = True) -> int:
        """A fresh slot (state reset, or left to the caller's :meth:`reset_many` when ``reset`` is
        False); grows the pool by doubling up to ``max_slots``.

        Raises:
            StreamError: ``max_slots`` streams are live.
        """
        if not self.free:
            if self.capacity >= min(max_slots, self.ceiling):
                raise StreamError(f"all {self.capacity} streaming slots are in use")
            try:
                self._alloc(min(max_slots, max(1, self.capacity * 2)))
            except RuntimeError as e:  # out of (device) memory: stay at this size from now on
                self.ceiling = self.capacity
                raise StreamError(f"no memory for more than {self.capacity} streaming slots ({e})") from None
        s = self.free.pop()
        if reset:
            self.reset(s)
        return s

    def release(self, slot: int) -> None:
        self.free.append(slot)

    @torch.no_grad()
    def reset(self, s: int) -> None:
        self.conv[:, s].zero_()
        self.done[s] = 0  # every ring entry now belongs to "before the stream": masked
        self.stat_sum[s].zero_()
        self.stat_sq[s].zero_()
        self.stat_n[s] = 0
        self.dec_time[s] = 0
        self.dec_gp[s] = self._sos.gp[0]
        self.dec_h[:, s] = self._sos.state[0][:, 0]
        self.dec_c[:, s] = self._sos.state[1][:, 0]

    @torch.no_grad()
    def reset_many(self, slots: list[int]) -> None:
        """:meth:`reset` of several slots at once: one operation per state tensor, not per slot
        (a new stream's reset was 9 small launches; at 2,000 streams they cost 0.9 s of the model
        thread in 20 s, ``stream_scale_h200_scale1000_profile.json``)."""
        if not slots:
            return
        idx = torch.tensor(sorted(set(slots)), dtype=torch.long, device=self.device)
        n = idx.numel()
        self.conv.index_fill_(1, idx, 0)
        for t in (self.done, self.stat_sum, self.stat_sq, self.stat_n, self.dec_time):
            t.index_fill_(0, idx, 0)
        self.dec_gp.index_copy_(0, idx, self._sos.gp[:1].expand(n, *self._sos.gp.shape[1:]).contiguous())
        self.dec_h.index_copy_(1, idx, self._sos.state[0][:, :1].expand(-1, n, -1).contiguous())
        self.dec_c.index_copy_(1, idx, self._sos.state[1][:, :1].expand(-1, n, -1).contiguous())

    def bytes_per_stream(self) -> int:
        per = self.k[:, 0].numel() + self.v[:, 0].numel() + self.conv[:, 0].numel()  # ring: (L + C) frames
        return per * self.k.element_size() + 2 * self.M * 8


@dataclass
class _Stream:
    """Host side of one stream: its slot, frames done and the samples not yet behind it."""

    key: str
    slot: int
    frames: int = 0              # encoder frames produced (v)
    received: int = 0            # samples received
    buf: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # kept samples, pre-emphasised
    kept: int = 0                # buf[:kept] holds samples x_start ... received - 1 (_append)
    x_start: int = 0             # absolute index of buf[0]
    last: np.float32 = np.float32(0)  # the last sample received, as it came (pre-emphasis of the next)
    tokens: list = field(default_factory=list)
    word_start: int = 0          # index of the last token that starts a word
    last_used: float = 0.0
    stable: str = ""             # decoded tokens[:stable_upto] (grown word by word, not re-decoded)
    stable_upto: int = 0
    text: str = ""               # decode(tokens[:text_upto]): reused by a step that decoded nothing new
    text_upto: int = 0
    flushed: bool = False        # its audio ended (a flushed step): no more audio


class ParakeetStreamer:
    """Chunked streaming partials for a :class:`~flashasr.models.parakeet.model.ParakeetASR`.

    Args:
        model: the loaded model (any device; its encoder dtype is used for the caches).
        config: :class:`StreamingConfig`.

    Thread-safety: :meth:`step` and :meth:`close` may be called from different threads (a lock
    serialises them); the server calls both on its model thread.

    Counters (``counters``): ``encoder_frames`` (valid new frames through the Conformer layers),
    ``subsampling_frames`` (encoder frames out of the subsampling, one overlap frame per row and
    step included), ``feature_frames`` (log-mel frames computed), ``padded_frames`` (rows x C x
    steps actually computed, padding included), ``steps``, ``rows``, ``audio_s`` (samples received).
    """

    def __init__(self, model, config: StreamingConfig | None = None):
        self.model = model
        self.cfg = config or StreamingConfig()
        pre = model.preprocessor
        pc = pre.cfg
        if pc.normalize not in ("per_feature", None, "none"):
            raise UnsupportedModelError(f"chunked streaming needs per_feature (or no) feature normalisation, "
                                        f"not {pc.normalize!r}")
        enc = model.encoder
        if not enc.layers:
            raise UnsupportedModelError("chunked streaming needs at least one Conformer layer")
        self.hop, self.n_fft, self.win = pre.hop_length, pre.n_fft, pre.win_length
        self.sub = int(enc.cfg.subsampling_factor)
        self.preemph = pc.preemph
        self.normalize = pc.normalize == "per_feature"
        self.C, self.L = int(self.cfg.chunk_frames), int(self.cfg.left_frames)
        self.window_frames = self.sub * (self.C + 1)                     # feature frames per window
        self.window_samples = self.hop * (self.window_frames - 1) + self.n_fft
        self.device = next(enc.parameters()).device
        self.dtype = next(enc.parameters()).dtype
        self.pool = StatePool(model, self.cfg, self.cfg.slots, self.device, self.dtype)
        self._buf_base = 2 * self.window_samples + self.hop * self.sub * self.C  # a stream's sample buffer
        self._shrink_above = 2 * self._buf_base  # a buffer grown past this shrinks as its samples are used
        self.streams: dict[str, _Stream] = {}
        self._closed: dict[str, float] = {}  # recently closed keys (refused if they come back)
        self._next_evict = 0.0  # when _evict_idle scans again
        self._fresh: list[int] = []  # slots acquired since the last step, not reset yet (StatePool.reset_many)
        self._lock = threading.RLock()
        self._pe = relative_positions(0, enc.d_model, self.device, left=self.L + self.C - 1,
                                      right=self.C - 1)
        self._pos_cache: dict[tuple, tuple] = {}  # (layer, dtype) -> step-invariant attention terms (_pos_terms)
        self._add_norm = add_norm  # a block's residual add + LayerNorm (the GPU streamer: one kernel)
        self.counters = {k: 0 for k in ("encoder_frames", "subsampling_frames", "feature_frames",
                                        "padded_frames", "steps", "rows")}
        self.counters["audio_s"] = 0.0
        self.frame_seconds = float(model.frame_seconds)
        self._piece_starts_word: dict[int, bool] = {}  # token id -> its piece begins a word
        self._plain: dict[int, bool] = {}  # token id -> a piece of visible text (see _plain_piece)
        self._surfaces: dict[int, str | None] = {}  # token id -> its text in a transcript (see _surface)

    # ------------------------------------------------------------------ public
    def close(self, key: str) -> None:
        """Drop a stream's state (its utterance was committed or cleared); idempotent."""
        with self._lock:
            st = self.streams.pop(key, None)
            if st is not None:
                self.pool.release(st.slot)
            self._closed[key] = time.monotonic()
            if len(self._closed) > 4 * self.cfg.max_slots:
                for k in list(self._closed)[: len(self._closed) // 2]:
                    del self._closed[k]

    def live(self) -> int:
        return len(self.streams)

    def warmup(self, steps: int = 4) -> None:
        """Run a throwaway stream of low noise through a few steps (first-call costs paid now: the
        server warms up before it says ready). Leaves no state behind."""
        rng = np.random.default_rng(0)
        chunk = self.hop * self.sub * self.C
        key = "__warmup__"
        saved = dict(self.counters)
        for _ in range(steps):
            self.step([(key, (rng.standard_normal(chunk) * 1e-3).astype(np.float32))])
        with self._lock:
            self.close(key)
            self._closed.pop(key, None)
            self.counters.update(saved)  # the counters count the streams' work only

    @torch.no_grad()
    def step(self, requests: Sequence[tuple[str, np.ndarray]], *, flush: bool = False) -> list:
        """Feed new audio to streams and encode/decode what became complete.

        Args:
            requests: ``(key, samples)`` or ``(key, samples, new)``: a stream key and its new
                float32 16 kHz samples (``[n]``, may be empty); an unknown key opens a stream,
                unless ``new`` is False (its state was lost: :class:`StreamError`). A key appears
                at most once per call.
            flush: the requests' audio ends here (zero padding after it, as the offline encoder
                pads): every remaining frame is encoded, in chunks of at most ``C`` (equal to the
                offline encoder only for a stream's first step with at most ``C`` frames: the
                module docstring), and the stream takes no more audio
                (its last frames saw zeros where later audio would go; a request with samples for
                it then gets :class:`StreamError`, an empty one its result again; the next
                utterance is a new key, as the server's are). Used by tests and benchmarks; the
                server's finals re-encode offline instead.
        Returns:
            per request a :class:`StreamResult`, or the exception that request raised
            (:class:`StreamError` for a closed or flushed stream or no slot; ``AudioError`` for
            samples that are not finite floats); the other requests are unaffected.
        """
        with self._lock:
            self._evict_idle()
            out: list = [None] * len(requests)
            todo: list[tuple[int, _Stream]] = []
            seen = set()
            for i, req in enumerate(requests):
                key, samples, new = req if len(req) == 3 else (*req, None)
                try:
                    if key in seen:
                        raise StreamError(f"stream {key!r} appears twice in one step")
                    seen.add(key)
                    a = self._check(key, samples)
                    st = self._open(key, new)
                    if st.flushed and a.size:
                        raise StreamError(f"stream {key!r} was flushed (its audio ended): it takes no more "
                                          f"audio; the next utterance is a new stream")
                    self._append(st, a)
                    todo.append((i, st))
                except FlashASRError as e:
                    out[i] = e
            work = {id(st): self._frames_to_do(st, flush) for _, st in todo}
            before = {id(st): len(st.tokens) for _, st in todo}
            while True:
                rows = [(st, work[id(st)]) for _, st in todo if work[id(st)][0] > 0]
                if not rows:
                    break
                plan = []
                for st, (n, f_end) in rows:
                    k = min(n, self.C)
                    last = k == n
                    plan.append((st, k, f_end if (flush and last) else None))
                    work[id(st)] = (n - k, f_end)
                self._run_rows(plan)
            for i, st in todo:
                st.flushed = st.flushed or flush
                out[i] = self._result(st, len(st.tokens) - before[id(st)])
            return out

    # ------------------------------------------------------------------ host side
    def _open(self, key: str, new: bool | None) -> _Stream:
        st = self.streams.get(key)
        if st is None:
            if key in self._closed:
                raise StreamError(f"stream {key!r} was closed")
            if new is False:
                raise StreamError(f"stream {key!r} is unknown here (its state was lost: evicted, or the engine "
                                  f"restarted)")
            st = _Stream(key, self.pool.acquire(self.cfg.max_slots, reset=False))
            self._fresh.append(st.slot)  # reset with the others of this step (_run_rows)
            self.streams[key] = st
        st.last_used = time.monotonic()
        return st

    def _evict_idle(self) -> None:
        """Drop streams idle longer than ``idle_s``; the scan over all streams runs at most every
        ``idle_s / 10`` (capped at 1 s), not on every step."""
        now = time.monotonic()
        if now < self._next_evict:
            return
        self._next_evict = now + min(1.0, self.cfg.idle_s / 10)
        for key in [k for k, s in self.streams.items() if now - s.last_used > self.cfg.idle_s]:
            self.close(key)

    @staticmethod
    def _check(key: str, samples) -> np.ndarray:
        """:func:`~flashasr.models.base.as_waveform` of a request's samples (an empty array, tensor
        or list of any dtype is no audio; an empty string, bytes or mapping is not samples)."""
        if type(samples) is not np.ndarray and not_samples(samples):
            return as_waveform(samples, f"stream {key}")  # raises, naming what was given
        try:
            empty = len(samples) == 0
        except Exception:  # noqa: BLE001 - a 0-d array, or an object whose __len__ fails: as_waveform says why
            empty = False
        return np.zeros(0, np.float32) if empty else as_waveform(samples, f"stream {key}")

    def _append(self, st: _Stream, a: np.ndarray) -> None:
        """Keep the new samples pre-emphasised (``y[t] = x[t] - preemph * x[t-1]``, ``y[0] = x[0]``,
        as the offline preprocessor), written straight after the kept ones in the stream's buffer;
        a window is then one slice of it (:meth:`_segment`). When they do not fit, the samples
        behind the next window's start are dropped first (:meth:`_compact`), then the buffer grows."""
        m = len(a)
        if not m:
            return
        if st.kept + m > len(st.buf):
            self._compact(st, need=m)
        x = st.buf[st.kept: st.kept + m]
        p = self.preemph
        if p is not None:
            y = x[1:]
            np.multiply(a[:-1], -p, out=y)  # a[t] - p a[t-1], rounded as a[t] - (p a[t-1])
            y += a[1:]
            x[0] = a[0] - p * st.last if st.received else a[0]
        else:
            x[:] = a
        st.last = a[-1]
        st.kept += m
        st.received += m
        self.counters["audio_s"] += m / float(self.model.sample_rate)

    def _frames_to_do(self, st: _Stream, flush: bool) -> tuple[int, int]:
        """``(new encoder frames, valid feature frames of the stream)``."""
        N, half = st.received, self.n_fft // 2
        if flush:
            f_end = int(self.model.preprocessor.output_lengths(torch.tensor([N]))[0])
            v_end = int(self.model.encoder.output_lengths(torch.tensor([f_end]))[0])
        else:
            f_end = (N - half) // self.hop + 1 if N >= half else 0  # frames whose 512 samples arrived
            v_end = f_end // self.sub                                 # their subsampling field complete
        return max(0, v_end - st.frames), f_end

    def _segment(self, st: _Stream, out: np.ndarray) -> None:
        """Pre-emphasised samples of the window ``[sub*(v-1), sub*(v+C))`` feature frames into ``out``
        (all of it written: zeros where the stream has no samples)."""
        p0 = self.hop * self.sub * (st.frames - 1) - self.n_fft // 2
        p1 = p0 + self.window_samples
        lo, hi = max(p0, 0), max(min(p1, st.received), max(p0, 0))
        if lo > p0:
            out[: lo - p0] = 0
        out[lo - p0: hi - p0] = st.buf[lo - st.x_start: hi - st.x_start]
        if hi < p1:
            out[hi - p0:] = 0

    def _window_buffer(self, B: int) -> np.ndarray:
        """Host memory for a step's ``[B, window_samples]`` float32 windows (every row is written by
        :meth:`_segment`); a device subclass hands out its upload buffer instead (no copy)."""
        return np.empty((B, self.window_samples), np.float32)

    def _advance(self, st: _Stream, k: int) -> None:
        st.frames += k
        if len(st.buf) > self._shrink_above:  # a long request grew it: let it go as its audio is used
            self._compact(st, need=0, shrink_only=True)

    def _compact(self, st: _Stream, need: int, shrink_only: bool = False) -> None:
        """Make room for ``need`` more samples: drop the kept ones behind the next window's start
        (moved to the buffer's head), and give the buffer a new size when they still do not fit or
        it is far larger than needed (a long request grew it; :meth:`_advance` calls this with
        ``need=0`` and ``shrink_only``: nothing moves unless the buffer shrinks, so the memory goes
        as the request's audio is encoded, not only when more audio comes, at one copy of the live
        samples per halving). A stream's buffer stays within about two windows plus the audio not
        yet encoded, however its audio is cut (a trial found 100-sample requests keeping the whole
        utterance in an earlier design, and a 60 s request keeping 3.9 MB until more audio came)."""
        keep_from = self.hop * self.sub * (st.frames - 1) - self.n_fft // 2  # the next window's start
        dead = min(max(keep_from - st.x_start, 0), st.kept)
        live = st.kept - dead
        want = max(self._buf_base, live + need + self.window_samples)
        if shrink_only and len(st.buf) <= 2 * want:
            return
        if live + need > len(st.buf) or len(st.buf) > 2 * want:
            buf = np.empty(want, np.float32)
            buf[:live] = st.buf[dead: st.kept]
            st.buf = buf
        elif dead:
            st.buf[:live] = st.buf[dead: st.kept]  # (numpy copies overlapping ranges safely)
        st.x_start += dead
        st.kept = live

    def _run_rows(self, plan: list[tuple[_Stream, int, int | None]]) -> None:
        if self._fresh:  # the slots of streams opened since the last step start from a clean state
            self.pool.reset_many(self._fresh)
            self._fresh.clear()
        B = len(plan)
        seg = self._window_buffer(B)
        sub = self.sub
        for b, (st, _, _) in enumerate(plan):
            self._segment(st, seg[b])
        n_new = np.array([k for _, k, _ in plan], np.int64)
        first = np.array([st.frames == 0 for st, _, _ in plan], bool)
        # valid feature frames of each window (it starts at feature frame sub * (frames - 1), maybe negative)
        feat_valid = np.array([(f_end - sub * (st.frames - 1)) if f_end is not None else sub * (k + 1)
                               for st, k, f_end in plan], np.int64)
        slots = np.array([st.slot for st, _, _ in plan], np.int64)
        hyps = self.device_step(seg, n_new, first, feat_valid, slots)
        c = self.counters
        c["steps"] += 1
        c["rows"] += B
        c["encoder_frames"] += int(n_new.sum())
        c["subsampling_frames"] += int(n_new.sum()) + B
        c["feature_frames"] += B * self.window_frames
        c["padded_frames"] += self.padded_rows(B) * self.C
        for b, (st, k, _) in enumerate(plan):
            ids = hyps[b]
            for t in ids:
                if self._starts_word(t):
                    st.word_start = len(st.tokens)
                st.tokens.append(t)
            self._advance(st, k)

    def _joined(self, head: str, tokens: list, a: int, b: int) -> str:
        """decode(tokens[:b]) from ``head`` = decode(tokens[:a]) where ``tokens[a]`` starts a word:
        SentencePiece turns each word marker into one space, dropped only at the start of the text,
        so the head joins the new pieces' surface forms (:meth:`_surface`) as they are, with no
        decoder call. Where that is not certain (a bare marker piece, a byte or control piece, an
        empty head or part, a part that does not start a word), the whole prefix is decoded."""
        if head and b > a:
            parts = [self._surface(t) for t in tokens[a:b]]
            if None not in parts and parts[0][:1] == " ":
                return head + "".join(parts)
        return self.model.tokenizer.decode(tokens[:b])

    def _surface(self, t: int) -> str | None:
        """A plain piece's text in a decoded transcript (its word markers as spaces); None for the
        others (:meth:`_plain_piece`)."""
        w = self._surfaces.get(t, False)
        if w is False:
            w = self._surfaces[t] = self.model.tokenizer.piece(t).replace(WORD_MARKER, " ") \
                if self._plain_piece(t) else None
        return w

    def _plain_piece(self, t: int) -> bool:
        """A piece of visible text (not the bare word marker, not a byte or control piece)."""
        w = self._plain.get(t)
        if w is None:
            p = self.model.tokenizer.piece(t)
            w = self._plain[t] = p not in ("", WORD_MARKER) and not (p.startswith("<") and p.endswith(">"))
        return w

    def padded_rows(self, B: int) -> int:
        """Rows a step of ``B`` streams computes (the eager path: ``B``; graphs: their bucket)."""
        return B

    def _starts_word(self, t: int) -> bool:
        w = self._piece_starts_word.get(t)
        if w is None:
            w = self._piece_starts_word[t] = self.model.tokenizer.piece(t).startswith(WORD_MARKER)
        return w

    def _result(self, st: _Stream, new_tokens: int) -> StreamResult:
        """The stream's texts: ``stable_text`` = decode(tokens[:word_start]), ``text`` = decode(tokens),
        each step decoding only the words completed since the last (a step used to decode the whole
        hypothesis twice: host time growing with the utterance)."""
        tok = self.model.tokenizer
        if st.word_start > st.stable_upto:
            st.stable = self._joined(st.stable, st.tokens, st.stable_upto, st.word_start)
            st.stable_upto = st.word_start
        if st.text_upto != len(st.tokens):
            st.text = self._joined(st.stable, st.tokens, st.stable_upto, len(st.tokens)) if st.stable_upto \
                else tok.decode(st.tokens)
            st.text_upto = len(st.tokens)
        return StreamResult(text=st.text, stable_text=st.stable, frames=st.frames,
                            audio_s=round(st.frames * self.frame_seconds, 3), new_tokens=new_tokens,
                            tokens=len(st.tokens))

    # ------------------------------------------------------------------ device side
    def device_step(self, seg: np.ndarray, n_new: np.ndarray, first: np.ndarray, feat_valid: np.ndarray,
                    slots: np.ndarray) -> list[list[int]]:
        """One batched step (see the module docstring); returns each row's new token ids.

        Args (host arrays, ``B`` rows): ``seg [B, window_samples]`` float32 pre-emphasised
        samples, ``n_new [B]`` encoder frames to produce (<= C), ``first [B]`` the stream's first
        chunk, ``feat_valid [B]`` valid feature frames of the window, ``slots [B]`` state slots.
        """
        dev = self.device
        t = lambda a: torch.from_numpy(a).to(dev)  # noqa: E731
        f, n = self.encode_step(t(seg), t(n_new), t(first), t(feat_valid), t(slots))
        return self.decode_step(f, n, t(slots))

    def encode_step(self, seg: torch.Tensor, n_new: torch.Tensor, first: torch.Tensor,
                    feat_valid: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Features -> subsampling -> Conformer layers with the slots' caches (updated in place)
        -> joint encoder projection ``[B, C, J]``; returns it and ``n_new``. Static shapes, no
        host synchronisation (CUDA-graph capturable)."""
        feats = self._features(seg, feat_valid, slots)
        x = self._subsample(feats, first, feat_valid)
        x = self._layers(x, n_new, slots)
        m = self.model
        if m.encoder.out_proj is not None:
            x = m.encoder.out_proj(x)
        j = m.joint
        return j.project_encoder(x.to(j.enc.weight.dtype)), n_new

    def _features(self, seg, feat_valid, slots) -> torch.Tensor:
        """Log-mel of the window ``[B, Fw, M]`` normalised with the running statistics (frames
        ``[sub, feat_valid)`` of the window are the stream's new frames and join them first)."""
        pre = self.model.preprocessor
        spec = torch.stft(seg, n_fft=self.n_fft, hop_length=self.hop, win_length=self.win,
                          window=pre.window.float(), center=False, return_complex=True)
        mel = pre.log_mel_from_stft(spec)  # [B, M, Fw]
        Fw = mel.shape[-1]
        idx = torch.arange(Fw, device=mel.device)
        if self.normalize:
            new = (idx[None, :] >= self.sub) & (idx[None, :] < feat_valid[:, None])  # [B, Fw]
            m64 = torch.where(new[:, None, :], mel.double(), 0.0)
            pool = self.pool
            s1 = pool.stat_sum.index_select(0, slots) + m64.sum(-1)
            s2 = pool.stat_sq.index_select(0, slots) + m64.pow(2).sum(-1)
            n = pool.stat_n.index_select(0, slots) + new.sum(-1).double()
            pool.stat_sum.index_copy_(0, slots, s1)
            pool.stat_sq.index_copy_(0, slots, s2)
            pool.stat_n.index_copy_(0, slots, n)
            nn_ = n.clamp(min=1.0)[:, None]
            mean = s1 / nn_
            var = ((s2 - nn_ * mean * mean) / (nn_ - 1.0)).clamp(min=0.0)  # n = 1 -> inf / nan below
            std = torch.sqrt(var)
            std = torch.where(torch.isfinite(std), std, 0.0) + _NORM_EPS
            mel = ((mel.double() - mean[:, :, None]) / std[:, :, None]).float()
        return mel.transpose(1, 2)  # [B, Fw, M]

    def _subsample(self, feats, first, feat_valid) -> torch.Tensor:
        """dw_striding subsampling of the windows with time masks: rows ``< left`` (the first
        chunk's window starts ``sub`` frames before the stream) and ``>= feat_valid`` are zero
        before every conv (NeMo masks the right side the same way); output frame 0 (the overlap)
        is dropped -> ``[B, C, d]``."""
        pe = self.model.encoder.pre_encode
        x = feats.to(self.dtype).unsqueeze(1)  # [B, 1, Fw, M]
        hi = feat_valid.long()
        lo = torch.where(first, self.sub, 0).long()
        for layer in pe.conv:
            if isinstance(layer, nn.Conv2d):
                t = torch.arange(x.shape[2], device=x.device)[None, :]
                keep = (t >= lo[:, None]) & (t < hi[:, None])
                x = x * keep[:, None, :, None].to(x.dtype)
                x = layer(x)
                if layer.stride[0] != 1:
                    s = layer.stride[0]
                    hi = torch.div(hi + 2 * layer.padding[0] - layer.kernel_size[0], s, rounding_mode="floor") + 1
                    lo = torch.div(lo, s, rounding_mode="floor")
            else:
                x = layer(x)
        b, c, t_, f = x.shape
        x = pe.out(x.transpose(1, 2).reshape(b, t_, c * f))[:, 1:]
        enc = self.model.encoder
        if enc.xscale is not None:
            x = x * enc.xscale
        return x

    def _layers(self, x, n_new, slots) -> torch.Tensor:
        pool = self.pool
        B, C, _ = x.shape
        L, R = self.L, pool.R
        dev = x.device
        valid = torch.arange(C, device=dev)[None, :] < n_new[:, None]  # [B, C]
        base = pool.done.index_select(0, slots)  # [B] frames before this chunk
        # where the chunk's frames go: frame base + t at ring position (base + t) mod R; frames past
        # n_new (padding) go to the scratch slot, whose contents nobody reads unmasked
        t = torch.arange(C, device=dev)[None, :]
        put = (torch.where(valid, slots[:, None], pool.scratch), torch.remainder(base[:, None] + t, R))
        # ring position j holds frame base + rel[j], rel in [-L, C) (the newest frame with j = f mod R)
        j = torch.arange(R, device=dev)[None, :]
        rel = (C - 1) - torch.remainder(base[:, None] + (C - 1) - j, R)  # [B, R]
        key_ok = (rel >= -L) & (base[:, None] + rel >= 0) & (rel < n_new[:, None])
        key_bias = torch.zeros(B, 1, 1, R, dtype=x.dtype, device=dev)
        key_bias.masked_fill_(~key_ok[:, None, None, :], _MASK_VALUE)
        # relative-position column of (query a, ring key j): distance a - rel -> column L + C - 1 - a + rel
        col = (L + C - 1) - torch.arange(C, device=dev)[None, :, None] + rel[:, None, :]  # [B, C, R]
        shift_cv = n_new[:, None] + torch.arange(pool.K, device=dev)[None, :]   # [B, K]
        an = self._add_norm
        x = x.contiguous()
        for i, layer in enumerate(self.model.encoder.layers):  # five (residual add +) LayerNorm steps per block
            h = an(x, None, 1.0, layer.norm_feed_forward1)[1]
            r, h = an(x, layer.feed_forward1(h), 0.5, layer.norm_self_att)
            r, h = an(r, self._attention(i, layer.self_attn, h, valid, key_bias, slots, put, col), 1.0, layer.norm_conv)
            r, h = an(r, self._conv(i, layer.conv, h, valid, slots, shift_cv), 1.0, layer.norm_feed_forward2)
            x = an(r, layer.feed_forward2(h), 0.5, layer.norm_out)[1]
        pool.done.index_copy_(0, slots, base + n_new)
        return x

    def _attention(self, i, att, h, valid, key_bias, slots, put, col) -> torch.Tensor:
        """Rel-pos MHSA of the chunk's queries over the stream's ring of keys/values (the last ``L``
        frames and the chunk's: NeMo ``RelPositionMultiHeadAttention`` with ``cache_last_channel``;
        keys in ring order, each with its own relative-position column). The chunk's keys/values are
        written into the ring first (``put``: slot and position per new frame)."""
        pool = self.pool
        B, C, _ = h.shape
        H, dk = att.h, att.d_k
        terms = self._pos_terms(i, att, h.dtype)
        qu, qv, k, v = self._qkv(att, h, terms)
        slot, pos = put  # [B, C] each: ring [S, H, R, dk][slot, :, pos] is [B, C, H, dk]
        pool.k[i][slot, :, pos] = k
        pool.v[i][slot, :, pos] = v
        K = pool.k[i].index_select(0, slots)  # [B, H, R, dk]
        V = pool.v[i].index_select(0, slots)
        # NeMo's matrix_bd: per head one GEMM of every row's queries with the positions
        p = terms[2]
        qv = qv.reshape(B * C, H, dk).transpose(0, 1)  # [H, B*C, dk] (a view)
        bd_raw = torch.matmul(qv, p).view(H, B, C, p.shape[-1]).permute(1, 0, 2, 3)  # [B, H, C, P8] (a view)
        bd = torch.gather(bd_raw, 3, col[:, None].expand(B, H, C, col.shape[-1]))  # [B, H, C, R]
        scale = 1.0 / math.sqrt(dk)
        out = self._sdpa(qu.transpose(1, 2), K, V, bd * scale + key_bias, scale)
        out = out * valid[:, None, :, None].to(out.dtype)
        return att.linear_out(out.transpose(1, 2).reshape(B, C, H * dk))

    def _sdpa(self, q, k, v, mask, scale: float) -> torch.Tensor:
        """Attention of ``q`` ``[B, H, C, dk]`` over ``k``, ``v`` ``[B, H, R, dk]`` with the additive
        ``mask`` ``[B, H, C, R]``: ``softmax(q k^T * scale + mask) v``, ``[B, H, C, dk]``. The GPU
        streamer picks the backend."""
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)

    def _qkv(self, att, h: torch.Tensor, terms: tuple) -> tuple[torch.Tensor, ...]:
        """The chunk's queries plus each position bias (``q + u``, ``q + v``; ``terms`` from
        :meth:`_pos_terms`), keys and values, each ``[B, C, H, dk]`` (views allowed). The GPU
        streamer uses the engine's fused projection."""
        B, C, _ = h.shape
        H, dk = att.h, att.d_k
        u, pv, _ = terms
        q = att.linear_q(h).view(B, C, H, dk)
        return q + u, q + pv, att.linear_k(h).view(B, C, H, dk), att.linear_v(h).view(B, C, H, dk)

    def _pos_terms(self, i: int, att, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer ``i``'s step-invariant attention terms in ``dtype``: ``pos_bias_u``, ``pos_bias_v``
        ``[H, dk]`` and the relative positions through ``linear_pos``, ``[H, dk, P8]`` (``P = L + 2C - 1``
        columns, relative positions ``L + C - 1 ... -(C - 1)``, then zero columns up to a multiple of 8
        so the GEMM's rows are aligned; :meth:`_layers`' columns never reach them).

        Computed at a layer's first step and kept while its source parameters are the same tensors,
        unchanged in place (``linear_pos.weight``, the two biases: identity, storage and version
        counter; an edit through ``.data`` or of inference tensors bypasses the counter, as for the
        engine's fused q/k/v weights: make a new streamer after one).
        (Done per step, the projection ran once per layer and ``matmul`` broadcast its ``[H, dk, P]``
        to every row, a ``[B * H, dk, P]`` copy per layer: 40 MB at 256 rows of the 0.6B model.)"""
        key = (i, dtype)
        src = tuple((id(t), t.data_ptr(), _version(t)) for t in (att.linear_pos.weight, att.pos_bias_u, att.pos_bias_v))
        got = self._pos_cache.get(key)
        if got is not None and got[0] == src:
            return got[1]
        H, dk = att.h, att.d_k
        P = self._pe.shape[0]
        with torch.no_grad():
            pp = att.linear_pos(self._pe.to(dtype)).reshape(P, H, dk).permute(1, 2, 0)  # [H, dk, P]
            p = torch.zeros(H, dk, -(-P // 8) * 8, dtype=dtype, device=pp.device)
            p[..., :P] = pp
            got = (att.pos_bias_u.detach().to(dtype).clone(), att.pos_bias_v.detach().to(dtype).clone(), p)
        self._pos_cache[key] = (src, got)
        return got

    def _conv(self, i, mod, h, valid, slots, shift) -> torch.Tensor:
        """Conv module with the last ``K`` GLU outputs of the stream as the depthwise conv's left
        context and zeros beyond the chunk (NeMo ``cache_last_time``); updates that cache.
        Works on the unfused module and on the engine's fused one (BatchNorm folded or not)."""
        pool = self.pool
        B, C, d = h.shape
        pw1, dw, pw2 = mod.pointwise_conv1, mod.depthwise_conv, mod.pointwise_conv2
        g = F.glu(F.linear(h, pw1.weight.squeeze(-1), pw1.bias), dim=-1)  # [B, C, d]
        g = torch.where(valid[:, :, None], g, 0.0)
        full = torch.cat([pool.conv[i].index_select(0, slots), g], dim=1)  # [B, K + C, d]
        pool.conv[i].index_copy_(0, slots, torch.gather(full, 1, shift[:, :, None].expand(B, pool.K, d)))
        left, right = mod.padding
        y = F.pad(full.transpose(1, 2), (left - pool.K, right))  # [B, d, left + C + right]
        y = F.conv1d(y, dw.weight, dw.bias, groups=d)  # [B, d, C]
        if not getattr(mod, "_fold", False):
            if mod.norm_type == "layer_norm":
                y = mod.batch_norm(y.transpose(1, 2)).transpose(1, 2)
            else:
                y = mod.batch_norm(y)
        y = F.silu(y)
        return F.linear(y.transpose(1, 2), pw2.weight.squeeze(-1), pw2.bias)

    def decode_step(self, f: torch.Tensor, n_new: torch.Tensor, slots: torch.Tensor) -> list[list[int]]:
        """TDT label looping over the step's frames from the slots' carried decoder state
        (updated in place); each row's new token ids."""
        m, pool = self.model, self.pool
        carry = DecoderCarry(pool.dec_time.index_select(0, slots), pool.dec_gp.index_select(0, slots),
                             (pool.dec_h.index_select(1, slots), pool.dec_c.index_select(1, slots)))
        hyps, out = label_looping_chunk(f, n_new, m.predictor, m.joint, m.durations, m.blank_id,
                                        m.max_symbols_per_step, carry=carry)
        pool.dec_time.index_copy_(0, slots, out.time)
        pool.dec_gp.index_copy_(0, slots, out.gp.to(pool.dec_gp.dtype))
        pool.dec_h.index_copy_(1, slots, out.state[0].to(pool.dec_h.dtype))
        pool.dec_c.index_copy_(1, slots, out.state[1].to(pool.dec_c.dtype))
        return [h.token_ids for h in hyps]


__all__ = ["ParakeetStreamer", "StreamingConfig", "StreamResult", "StatePool", "StreamError"]
