"""Batched greedy TDT decoding by label looping on static tensors, with CUDA graphs.

The algorithm is greedy label looping for TDT (Bataev et al. 2024, arXiv 2406.06220; NeMo
``GreedyBatchedTDTLabelLoopingComputer``); results (token ids, emission frames, durations) are
identical to :func:`flashasr.models.parakeet.decoder.greedy_tdt_reference`.

Every quantity lives in a pre-allocated tensor of a fixed (batch, frames) capacity; finished
rows are masked, so the same kernels run whatever the data. One decode is::

    before:  t = 0, predictor state/output = start symbol, active = length > 0
    while any(active):                      # outer loop: one label per active row
        head:   joint at t; label, duration; blank rows jump (duration 0 counts as 1)
        while any(searching):               # inner loop: joint only, skips blanks
            inner: joint at t for searching rows; blank rows jump again
        tail:   record labels, predictor step (kept only for rows that found a label),
                t += duration, max_symbols rule, active = t < length

Modes (:class:`DecodeMode`):

* ``full_graph``: the whole decode is ONE CUDA graph; both loops are CUDA-graph WHILE
  conditional nodes (:mod:`flashasr.engine.cuda_conditional`), so a decode is one graph
  launch and one host synchronisation (to read the results).
* ``graphs_no_while``: before/head/inner/tail captured as four graphs, loops driven from
  Python (one ``.item()`` synchronisation per loop test).
* ``torch``: the same step functions run eagerly (also on CPU).

Fallback: a failure while capturing or replaying a fast mode is logged and the batch is
decoded again with the next mode (full_graph -> graphs_no_while -> torch); the failing mode
is disabled for this decoder, the process is not.

Static sizes: graphs are captured per bucket ``(batch capacity, frame capacity)`` = powers of
two >= the request (frames at least ``min_frames``); a request larger than every bucket
captures a new one (least recently used buckets beyond ``max_buckets`` are dropped).
"""

from __future__ import annotations

import enum
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree

from ..errors import FlashASRError
from .capture import graph_capture
from .tdt_fused import joint_step, tail_step

log = logging.getLogger(__name__)


class DecodeMode(str, enum.Enum):
    """How the label-looping decode is executed (fastest first)."""

    FULL_GRAPH = "full_graph"
    GRAPHS_NO_WHILE = "graphs_no_while"
    TORCH = "torch"


_ORDER = [DecodeMode.FULL_GRAPH, DecodeMode.GRAPHS_NO_WHILE, DecodeMode.TORCH]


class DecoderInputError(FlashASRError):
    """Encoder output / lengths given to the TDT decoder have the wrong shape or values."""

    code = "invalid_decoder_input"
    status = 400


@dataclass
class TDTDecodeOutput:
    """Result of one batched decode.

    ``token_ids[b]``, ``token_frames[b]`` (encoder frame of emission) and
    ``token_durations[b]`` (predicted duration, encoder frames) are Python lists per input row;
    ``mode`` is the mode that produced them; ``seconds`` wall time of the decode (host clock,
    synchronised).
    """

    token_ids: list[list[int]]
    token_frames: list[list[int]]
    token_durations: list[list[int]]
    mode: str
    seconds: float = 0.0
    fallbacks: list[str] = field(default_factory=list)

    def hypotheses(self):
        """The rows as :class:`flashasr.models.parakeet.decoder.Hypothesis` objects."""
        from ..models.parakeet.decoder import Hypothesis

        return [Hypothesis(list(a), list(b), list(c))
                for a, b, c in zip(self.token_ids, self.token_frames, self.token_durations)]


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


class _Buffers:
    """Static tensors of one (B, T) capacity + the per-bucket graphs."""

    def __init__(self, dec: "TDTGraphDecoder", B: int, T: int, J: int, device, dtype):
        self.B, self.T, self.J = B, T, J
        self.device = device
        lim = dec.max_symbols if dec.max_symbols is not None else 1
        self.cap = T * max(1, lim) + 1  # max tokens one row can emit (+1 scratch slot)
        i64 = dict(dtype=torch.long, device=device)
        self.f_enc = torch.zeros(B, T, J, dtype=dtype, device=device)
        self.lengths = torch.zeros(B, **i64)
        self.last_index = torch.zeros(B, **i64)
        self.rows = torch.arange(B, **i64)
        self.time = torch.zeros(B, **i64)
        self.frame = torch.zeros(B, **i64)
        self.label = torch.zeros(B, **i64)
        self.dur = torch.zeros(B, **i64)
        self.count = torch.zeros(B, **i64)  # tokens of duration 0 emitted on the current frame
        self.n = torch.zeros(B, **i64)
        self.active = torch.zeros(B, dtype=torch.bool, device=device)
        self.searching = torch.zeros(B, dtype=torch.bool, device=device)
        self.active_any = torch.zeros((), dtype=torch.bool, device=device)
        self.search_any = torch.zeros((), dtype=torch.bool, device=device)
        self.out = torch.zeros(B, self.cap, 3, dtype=torch.int32, device=device)
        # start symbol: predictor output for blank from the zero state
        with torch.no_grad():
            blank = torch.full((B,), dec.blank_id, **i64)
            st0 = dec.predictor.init_state(B, device, dec.pred_dtype)
            g, st = dec.predictor.step(blank, st0)
            self.sos_gp = dec.joint.project_predictor(g).contiguous()
            self.sos_state = [x.contiguous() for x in pytree.tree_leaves(st)]
            self.state_spec = pytree.tree_structure(st)
        self.gp = self.sos_gp.clone()
        self.state = [x.clone() for x in self.sos_state]
        self.state_masks_shape = []
        for x, bd in zip(self.state, dec.state_batch_dims):
            shape = [1] * x.dim()
            shape[bd] = B
            self.state_masks_shape.append(shape)
        # graphs
        self.full_graph = None
        self.part_graphs = None
        self.keep = []  # objects the graphs need alive


def flatten_once(lstm) -> None:
    """Put an RNN's weights in one contiguous chunk for cuDNN, unless they already are.

    ``RNNBase.flatten_parameters`` re-allocates the chunk on every call (CUDA), which frees the
    memory that CUDA graphs captured earlier read their weights from: a second decoder built on
    the same predictor (a streamer after the offline graphs) made every offline replay an illegal
    memory access on the H200. No-op for ``None``, non-RNN modules and CPU weights.
    """
    if not isinstance(lstm, torch.nn.RNNBase):
        return
    ws = [w for w in getattr(lstm, "_flat_weights", []) if isinstance(w, torch.Tensor)]
    if ws and len({w.untyped_storage().data_ptr() for w in ws}) == 1:
        return  # already one chunk: keep the pointers graphs may hold
    lstm.flatten_parameters()


class TDTGraphDecoder:
    """Greedy TDT decoder (label looping) with CUDA-graph execution modes.

    Args:
        predictor: object with ``step(tokens[B] long, state) -> (g[B, H], state)`` and
            ``init_state(batch, device, dtype)`` (state: a tensor or tuple of tensors, each with
            one batch dimension), e.g. :class:`flashasr.models.parakeet.decoder.TDTPredictor`.
        joint: object with ``project_encoder([B, T, D]) -> [B, T, J]``,
            ``project_predictor([B, H]) -> [B, J]``, ``joint_after_projection(f[B, J], g[B, J])
            -> [B, V + 1 + n_durations]`` and attributes ``blank_id`` (= V), ``durations``,
            ``max_symbols_per_step``, e.g. :class:`~flashasr.models.parakeet.decoder.TDTJoint`.
        mode: preferred :class:`DecodeMode` (``full_graph`` default; on CPU always ``torch``).
        max_symbols: tokens per frame limit (default: ``joint.max_symbols_per_step``; None =
            no limit); after this many duration-0 tokens on a frame decoding advances 1 frame.
        nemo_max_symbols_quirk: reproduce NeMo ``GreedyTDTInfer``'s extra +1 frame when the
            ``max_symbols``-th step on a frame has duration > 0 (default off = NeMo batched).
        min_frames: smallest frame capacity of a graph bucket; max_buckets: buckets kept.
        fused: run the head and inner steps as three launches each and the tail's bookkeeping as
            two (:mod:`.tdt_fused`: Triton, CUDA, ReLU joint; identical results) where possible
            (default True).
    """

    def __init__(self, predictor, joint, *, mode: DecodeMode | str = DecodeMode.FULL_GRAPH,
                 max_symbols: int | None | str = "model", nemo_max_symbols_quirk: bool = False,
                 min_frames: int = 256, max_buckets: int = 6, warmup_iters: int = 2, fused: bool = True):
        self.predictor = predictor
        self.joint = joint
        self.mode = DecodeMode(mode)
        self.blank_id = int(joint.blank_id)
        self.durations = [int(d) for d in joint.durations]
        if max_symbols == "model":
            max_symbols = getattr(joint, "max_symbols_per_step", 10)
        self.max_symbols = None if max_symbols is None else int(max_symbols)
        if self.max_symbols is not None and self.max_symbols < 1:
            raise DecoderInputError(f"max_symbols must be >= 1 or None, got {self.max_symbols}")
        self.quirk = bool(nemo_max_symbols_quirk)
        self.min_frames = int(min_frames)
        self.max_buckets = int(max_buckets)
        self.warmup_iters = int(warmup_iters)
        self.fused = bool(fused)
        self.disabled: set[DecodeMode] = set()
        self.events: list[str] = []  # fallback log (also sent to logging)
        self.captures = 0  # graphs captured so far (a bucket evicted and needed again is captured again)
        self._buckets: "OrderedDict[tuple, _Buffers]" = OrderedDict()
        self._dur_values: dict = {}
        p = next(iter(predictor.parameters())) if hasattr(predictor, "parameters") else None
        self.pred_dtype = p.dtype if p is not None else torch.float32
        self.state_batch_dims = self._find_state_batch_dims()
        flatten_once(getattr(predictor, "lstm", None))

    # ------------------------------------------------------------------ helpers
    def _find_state_batch_dims(self) -> list[int]:
        s1 = pytree.tree_leaves(self.predictor.init_state(1, "cpu", torch.float32))
        s2 = pytree.tree_leaves(self.predictor.init_state(2, "cpu", torch.float32))
        dims = []
        for a, b in zip(s1, s2):
            diff = [i for i, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y]
            if len(diff) != 1:
                raise DecoderInputError("predictor state leaves must have exactly one batch dimension")
            dims.append(diff[0])
        return dims

    def _durs(self, device) -> torch.Tensor:
        key = str(device)
        if key not in self._dur_values:
            self._dur_values[key] = torch.tensor(self.durations, dtype=torch.long, device=device)
        return self._dur_values[key]

    # ------------------------------------------------------------------ the step functions
    # All of them only update the static tensors of ``s`` in place (graph-capturable).
    def _before(self, s: _Buffers):
        s.time.zero_()
        s.count.zero_()
        s.n.zero_()
        s.gp.copy_(s.sos_gp)
        for x, x0 in zip(s.state, s.sos_state):
            x.copy_(x0)
        torch.clamp(s.lengths - 1, min=0, out=s.last_index)
        torch.gt(s.lengths, 0, out=s.active)
        s.active_any.copy_(s.active.any())

    def _joint_at_time(self, s: _Buffers):
        V = self.blank_id
        idx = torch.minimum(s.time, s.last_index)
        f = s.f_enc[s.rows, idx]
        logits = self.joint.joint_after_projection(f, s.gp)
        lab = logits[:, : V + 1].argmax(-1)
        dur = self._durs(s.device)[logits[:, V + 1:].argmax(-1)]
        return lab, dur

    def _limit(self) -> int:
        return self.max_symbols if self.max_symbols is not None else (1 << 40)

    def _blank_advance(self, s: _Buffers, lab, dur):
        """Frames a blank step advances (duration 0 counts as 1; optional NeMo quirk)."""
        adv = torch.clamp(dur, min=1)
        if self.quirk:
            adv = adv + ((dur > 0) & (s.count == self._limit() - 1)).long()
        return adv

    def _head(self, s: _Buffers):
        if self.fused and joint_step(self, s, head=True):
            return
        V = self.blank_id
        lab, dur = self._joint_at_time(s)
        blank = lab == V
        s.label.copy_(lab)
        s.dur.copy_(dur)
        s.frame.copy_(s.time)
        jump = blank & s.active
        s.time.add_(torch.where(jump, self._blank_advance(s, lab, dur), 0))
        s.count.masked_fill_(jump, 0)
        torch.logical_and(jump, s.time < s.lengths, out=s.searching)
        s.search_any.copy_(s.searching.any())

    def _inner(self, s: _Buffers):
        if self.fused and joint_step(self, s, head=False):
            return
        V = self.blank_id
        lab, dur = self._joint_at_time(s)
        blank = lab == V
        sr = s.searching
        s.label.copy_(torch.where(sr, lab, s.label))
        s.dur.copy_(torch.where(sr, dur, s.dur))
        s.frame.copy_(torch.where(sr, s.time, s.frame))
        jump = sr & blank
        s.time.add_(torch.where(jump, self._blank_advance(s, lab, dur), 0))
        torch.logical_and(jump, s.time < s.lengths, out=s.searching)
        s.search_any.copy_(s.searching.any())

    def _tail(self, s: _Buffers):
        if self.fused and tail_step(self, s):
            return
        V = self.blank_id
        found = s.active & (s.label != V)
        # record (label, frame, duration) at slot n; rows without a label write a scratch value
        pos = torch.clamp(s.n, max=s.cap - 1)
        rec = torch.stack([s.label, s.frame, s.dur], dim=-1).to(torch.int32)
        s.out[s.rows, pos] = rec
        s.n.add_(found.long())
        # predictor on the whole batch, kept only where a label was found
        tokens = torch.where(found, s.label, V)
        st = pytree.tree_unflatten(list(s.state), s.state_spec)
        g, new_st = self.predictor.step(tokens, st)
        gp = self.joint.project_predictor(g)
        s.gp.copy_(torch.where(found.unsqueeze(-1), gp.to(s.gp.dtype), s.gp))
        for x, nx, shape in zip(s.state, pytree.tree_leaves(new_st), s.state_masks_shape):
            x.copy_(torch.where(found.view(shape), nx.to(x.dtype), x))
        # time advance
        d0 = found & (s.dur == 0)
        cnt = torch.where(d0, s.count + 1, torch.where(found, 0, s.count))
        force = d0 & (cnt >= self._limit())
        adv = torch.where(found, s.dur, 0) + force.long()
        if self.quirk:
            adv = adv + (found & (s.dur > 0) & (s.count == self._limit() - 1)).long()
        s.time.add_(adv)
        s.count.copy_(torch.where(force, 0, cnt))
        torch.lt(s.time, s.lengths, out=s.active)
        s.active_any.copy_(s.active.any())

    # ------------------------------------------------------------------ execution modes
    def _run_torch(self, s: _Buffers):
        self._before(s)
        while bool(s.active_any):
            self._head(s)
            while bool(s.search_any):
                self._inner(s)
            self._tail(s)

    def _warmup(self, s: _Buffers, stream):
        # run every step once on the capture stream (cuBLAS/cuDNN handles, workspaces)
        saved = s.lengths.clone()
        s.lengths.fill_(1)
        with torch.cuda.stream(stream):
            for _ in range(self.warmup_iters):
                self._before(s)
                self._head(s)
                self._inner(s)
                self._tail(s)
        s.lengths.copy_(saved)
        torch.cuda.current_stream().wait_stream(stream)

    def _capture_full(self, s: _Buffers):
        from .cuda_conditional import WhileLoopBuilder, allocate_to_graph_pool, check_support

        check_support()
        self.captures += 1
        streams = [torch.cuda.Stream() for _ in range(3)]
        for st in streams:  # warm up on every stream the capture will use
            st.wait_stream(torch.cuda.current_stream())
            self._warmup(s, st)
        stream, outer_body, inner_body = streams
        graph = torch.cuda.CUDAGraph()
        pool = torch.cuda.graph_pool_handle()
        with graph_capture(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            with allocate_to_graph_pool(pool):
                builder = WhileLoopBuilder()
                self._before(s)
                with builder.loop(s.active_any, outer_body):
                    self._head(s)
                    with builder.loop(s.search_any, inner_body):
                        self._inner(s)
                    self._tail(s)
        s.keep += [builder, streams]
        s.full_graph = graph

    def _capture_parts(self, s: _Buffers):
        self.captures += 1
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        self._warmup(s, stream)
        graphs = []
        pool = None
        for fn in (self._before, self._head, self._inner, self._tail):
            g = torch.cuda.CUDAGraph()
            with graph_capture(g, pool=pool, stream=stream, capture_error_mode="thread_local"):
                fn(s)
            pool = g.pool()
            graphs.append(g)
        s.keep.append(stream)
        s.part_graphs = graphs

    def _run_full(self, s: _Buffers):
        if s.full_graph is None:
            self._capture_full(s)
        s.full_graph.replay()

    def _run_parts(self, s: _Buffers):
        if s.part_graphs is None:
            self._capture_parts(s)
        g_before, g_head, g_inner, g_tail = s.part_graphs
        g_before.replay()
        while bool(s.active_any):
            g_head.replay()
            while bool(s.search_any):
                g_inner.replay()
            g_tail.replay()

    # ------------------------------------------------------------------ public API
    def _bucket(self, B: int, T: int, J: int, device, dtype) -> _Buffers:
        Bc, Tc = _next_pow2(B), max(self.min_frames, _next_pow2(T))
        # reuse any cached bucket that fits and is at most 2x too large in each dimension
        for key, buf in self._buckets.items():
            if key[2:] == (str(device), dtype, J) and Bc <= key[0] <= 2 * Bc and Tc <= key[1] <= 2 * Tc:
                self._buckets.move_to_end(key)
                return buf
        key = (Bc, Tc, str(device), dtype, J)
        buf = _Buffers(self, Bc, Tc, J, device, dtype)
        self._buckets[key] = buf
        while len(self._buckets) > self.max_buckets:
            self._buckets.popitem(last=False)
        return buf

    def _validate(self, x: torch.Tensor, lengths: torch.Tensor, values: bool = True):
        if x.dim() != 3:
            raise DecoderInputError(f"encoder output must be [B, T, D], got shape {tuple(x.shape)}")
        if lengths.dim() != 1 or lengths.shape[0] != x.shape[0]:
            raise DecoderInputError(f"lengths must be [B={x.shape[0]}], got shape {tuple(lengths.shape)}")
        if values and lengths.numel() and (int(lengths.min()) < 0 or int(lengths.max()) > x.shape[1]):
            raise DecoderInputError(f"lengths must lie in [0, {x.shape[1]}], got "
                                    f"[{int(lengths.min())}, {int(lengths.max())}]")

    @torch.no_grad()
    def decode(self, encoder_output: torch.Tensor, lengths: torch.Tensor, *,
               projected: bool = False, mode: DecodeMode | str | None = None,
               lengths_checked: bool = False) -> TDTDecodeOutput:
        """Decode a batch.

        Args:
            encoder_output: ``[B, T, D_enc]`` encoder frames (or, with ``projected=True``, the
                joint's encoder projection ``[B, T, J]``), on the decoder's device.
            lengths: ``[B]`` valid encoder frames per row (int).
            mode: override the preferred mode for this call.
            lengths_checked: the caller guarantees ``0 <= lengths <= T`` (an encoder's own
                lengths): the range check, which reads ``lengths`` back to the host and so waits for
                the GPU work that computes them, is skipped.
        Returns:
            :class:`TDTDecodeOutput` (per-row token ids, frames, durations; the mode used).
        Raises:
            DecoderInputError: bad shapes or lengths.
        """
        self._validate(encoder_output, lengths, values=not lengths_checked)
        t0 = time.perf_counter()
        f = encoder_output if projected else self.joint.project_encoder(encoder_output)
        B, T, J = f.shape
        want = DecodeMode(mode) if mode is not None else self.mode
        if f.device.type != "cuda":
            want = DecodeMode.TORCH
        fallbacks: list[str] = []
        for m in _ORDER[_ORDER.index(want):]:
            if m in self.disabled:
                continue
            try:
                if m is DecodeMode.TORCH:
                    s = _Buffers(self, B, T, J, f.device, f.dtype)
                else:
                    s = self._bucket(B, T, J, f.device, f.dtype)
                s.f_enc[:B, :T].copy_(f)
                s.lengths.zero_()
                s.lengths[:B].copy_(lengths.to(device=f.device, dtype=torch.long))
                if m is DecodeMode.FULL_GRAPH:
                    self._run_full(s)
                elif m is DecodeMode.GRAPHS_NO_WHILE:
                    self._run_parts(s)
                else:
                    self._run_torch(s)
                res = self._collect(s, B)
                res.mode = m.value
                res.fallbacks = fallbacks
                res.seconds = time.perf_counter() - t0
                return res
            except DecoderInputError:
                raise
            except Exception as e:  # degrade to the next mode
                msg = f"TDT decode mode {m.value} failed ({type(e).__name__}: {e}); falling back"
                log.warning(msg)
                self.events.append(msg)
                fallbacks.append(m.value)
                self.disabled.add(m)
                self._buckets.clear()
                if f.is_cuda:
                    try:
                        torch.cuda.synchronize()
                    except Exception:
                        pass
        raise FlashASRError("all TDT decode modes failed: " + "; ".join(self.events[-3:]))

    @torch.no_grad()
    def decode_async(self, encoder_output: torch.Tensor, lengths: torch.Tensor, *,
                     projected: bool = False, lengths_checked: bool = False) -> "PendingDecode":
        """Launch a decode on the current CUDA stream without waiting for it.

        Only the ``full_graph`` mode runs asynchronously (one graph replay); any other mode,
        a CPU input, or a launch failure decodes synchronously (with the usual fallbacks).
        ``PendingDecode.input_consumed`` is a CUDA event recorded once the input has been copied
        into the decoder's static buffer: after it, ``encoder_output`` may be overwritten.
        Call ``result()`` before the next ``decode``/``decode_async`` that may use the same
        bucket (the static output buffers are shared). ``lengths_checked``: as in :meth:`decode`
        (without it the range check waits for the GPU work that computes ``lengths``).
        """
        self._validate(encoder_output, lengths, values=not lengths_checked)
        t0 = time.perf_counter()
        f = encoder_output if projected else self.joint.project_encoder(encoder_output)
        if (f.device.type == "cuda" and self.mode is DecodeMode.FULL_GRAPH
                and DecodeMode.FULL_GRAPH not in self.disabled):
            B, T, J = f.shape
            try:
                s = self._bucket(B, T, J, f.device, f.dtype)
                if s.full_graph is None:
                    self._capture_full(s)
                s.f_enc[:B, :T].copy_(f)
                s.lengths.zero_()
                s.lengths[:B].copy_(lengths.to(device=f.device, dtype=torch.long))
                consumed = torch.cuda.Event()
                consumed.record()
                s.full_graph.replay()
                done = torch.cuda.Event()
                done.record()
                return PendingDecode(self, s, B, consumed, done, t0)
            except Exception as e:  # noqa: BLE001 - degrade like decode()
                msg = f"TDT decode mode full_graph failed ({type(e).__name__}: {e}); falling back"
                log.warning(msg)
                self.events.append(msg)
                self.disabled.add(DecodeMode.FULL_GRAPH)
                self._buckets.clear()
                torch.cuda.synchronize()
        res = self.decode(f, lengths, projected=True, lengths_checked=lengths_checked)
        return PendingDecode(self, None, 0, None, None, t0, res)

    def _collect(self, s: _Buffers, B: int) -> TDTDecodeOutput:
        n = s.n[:B].cpu().numpy()
        maxn = int(n.max()) if B else 0
        out = s.out[:B, :maxn].cpu().numpy()  # numpy rows below: a torch slice per row costs microseconds
        ids, frames, durs = [], [], []
        for b in range(B):
            rows = out[b, : int(n[b])].T.tolist()  # [3][k]: token ids, frames, durations
            ids.append(rows[0])
            frames.append(rows[1])
            durs.append(rows[2])
        return TDTDecodeOutput(ids, frames, durs, mode="")

    def capture(self, batch: int, frames: int, *, device=None, dtype=None, modes=None) -> None:
        """Capture the graphs of the bucket for ``(batch, frames)`` ahead of time.

        ``device``/``dtype`` default to those of the joint's parameters; ``modes`` to the
        preferred mode. A failing capture is logged and disables that mode (as in ``decode``);
        nothing is captured on CPU.
        """
        p = next(self.joint.parameters())
        device = torch.device(device or p.device)
        dtype = dtype or p.dtype
        with torch.no_grad():
            st = self.predictor.init_state(1, device, self.pred_dtype)
            g, _ = self.predictor.step(torch.full((1,), self.blank_id, dtype=torch.long, device=device), st)
            J = self.joint.project_predictor(g).shape[-1]
            s = self._bucket(batch, frames, J, device, dtype)
            for m in modes or [self.mode]:
                m = DecodeMode(m)
                if m in self.disabled or device.type != "cuda":
                    continue
                try:
                    if m is DecodeMode.FULL_GRAPH and s.full_graph is None:
                        self._capture_full(s)
                    elif m is DecodeMode.GRAPHS_NO_WHILE and s.part_graphs is None:
                        self._capture_parts(s)
                except Exception as e:  # same policy as decode(): log, disable, continue
                    msg = f"TDT capture of mode {m.value} failed ({type(e).__name__}: {e}); mode disabled"
                    log.warning(msg)
                    self.events.append(msg)
                    self.disabled.add(m)
                    self._buckets.clear()


class PendingDecode:
    """A decode launched by :meth:`TDTGraphDecoder.decode_async`; ``result()`` waits and
    returns the :class:`TDTDecodeOutput`."""

    def __init__(self, dec, s, B, consumed, done, t0, res: TDTDecodeOutput | None = None):
        self._dec, self._s, self._B, self._done, self._t0, self._res = dec, s, B, done, t0, res
        self.input_consumed = consumed
        # the stream it was launched on: its results are copied back there, so reading them never
        # waits for work queued on other streams since (the next call's encoders)
        self._stream = torch.cuda.current_stream() if done is not None else None

    def result(self) -> TDTDecodeOutput:
        if self._res is None:
            self._done.synchronize()
            with torch.cuda.stream(self._stream):
                self._res = self._dec._collect(self._s, self._B)
            self._res.mode = DecodeMode.FULL_GRAPH.value
            self._res.seconds = time.perf_counter() - self._t0
            self._s = None
        return self._res


__all__ = ["DecodeMode", "TDTGraphDecoder", "TDTDecodeOutput", "DecoderInputError", "PendingDecode"]
