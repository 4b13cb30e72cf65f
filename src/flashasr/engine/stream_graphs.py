"""Chunked streaming partials on the GPU: one CUDA graph per tick of all streams.

:class:`GraphedStreamer` is a :class:`~flashasr.models.parakeet.streaming.ParakeetStreamer`
whose batched step (log-mel of the windows -> subsampling -> Conformer layers over the slots'
caches -> joint projection -> TDT label looping from the slots' carried decoder state -> state
written back) is captured once per row bucket (``config.row_buckets()``: powers of two up to 64 rows, then a few
sizes per doubling, up to ``config.max_batch``) as ONE
CUDA graph: the decoder's loops are WHILE conditional nodes (:mod:`.cuda_conditional`, as
:class:`~.tdt_graphs.TDTGraphDecoder` does), so a step is one host-to-device copy of the rows'
samples and indices, one graph launch and one device-to-host copy of the new tokens, whatever
the number of streams in the bucket. Shapes are fixed by the bucket ``B``, the chunk ``C`` and
the left context ``L``; the data (which slot, how many new frames, first chunk or not) lives in
the static input tensors.

Fallbacks, each logged once and then kept: the WHILE-node graph cannot be captured -> the
encoder part as a graph and the decoder eager (one host synchronisation per loop test); that
fails too -> everything eager (the parent class). Growing the state pool (more streams than
slots) replaces its tensors: every graph is dropped and re-captured on its next use.

The Conformer blocks use the offline engine's kernels where the engine installed them: each
residual add and the LayerNorm after it as one Triton kernel (:func:`.triton_norm.add_layer_norm`)
and the attention's query, key and value projections as one GEMM with ``pos_bias_u`` in its bias
(:mod:`.fast_attention`'s fused weights); the attention itself runs on PyTorch's memory-efficient
SDPA kernel (:meth:`GraphedStreamer._sdpa`). Same maths as the parent's step; float rounding may differ.

Same maths as the eager step (tests compare them on the H200: ``tests/test_stream_graphs.py``).
"""

from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..models.parakeet.streaming import ParakeetStreamer, StreamingConfig
from .capture import graph_capture
from .fast_attention import _fuse_qkv, _source_key
from .tdt_graphs import TDTGraphDecoder, _Buffers
from .triton_norm import add_layer_norm

log = logging.getLogger(__name__)


class _CarryDecoder(TDTGraphDecoder):
    """Label looping whose start state is the carried one (``s.init_*``) instead of the start symbol."""

    def _before(self, s: _Buffers):
        s.time.copy_(s.init_time)
        s.count.zero_()
        s.n.zero_()
        s.gp.copy_(s.init_gp)
        for x, x0 in zip(s.state, s.init_state):
            x.copy_(x0)
        torch.clamp(s.lengths - 1, min=0, out=s.last_index)
        torch.lt(s.time, s.lengths, out=s.active)
        s.active_any.copy_(s.active.any())

    def buffers(self, B: int, T: int, J: int, device, dtype) -> _Buffers:
        s = _Buffers(self, B, T, J, device, dtype)
        s.init_time = torch.zeros(B, dtype=torch.long, device=device)
        s.init_gp = s.sos_gp.clone()
        s.init_state = [x.clone() for x in s.sos_state]
        return s


class _StepGraph:
    """Static inputs, decoder buffers and the captured graph of one row bucket."""

    def __init__(self, owner: "GraphedStreamer", B: int):
        dev = owner.device
        self.B = B
        self.seg = owner._seg[:B]  # one step runs at a time (the streamer's lock): buckets share them
        self.n_new = torch.zeros(B, dtype=torch.long, device=dev)
        self.first = torch.zeros(B, dtype=torch.bool, device=dev)
        self.feat_valid = torch.zeros(B, dtype=torch.long, device=dev)
        self.slots = torch.full((B,), owner.pool.scratch, dtype=torch.long, device=dev)
        pin = dict(pin_memory=True)
        self.h_seg = owner._h_seg[:B]
        self.h_idx = torch.zeros(4, B, dtype=torch.long, **pin)  # n_new, first, feat_valid, slots
        J = owner.model.joint.enc.out_features
        self.dec = owner.decoder.buffers(B, owner.C, J, dev, torch.float32)
        self.h_out = torch.zeros_like(self.dec.out, device="cpu").pin_memory()
        self.h_n = torch.zeros(B, dtype=torch.long, **pin)
        self.graph = None
        self.mode = None  # "full" (encoder + WHILE-loop decoder) or "encoder" (decoder eager)
        self.keep: list = []
        self.version = owner.pool.version


class GraphedStreamer(ParakeetStreamer):
    """A :class:`ParakeetStreamer` on a CUDA device whose steps replay CUDA graphs.

    Args:
        model: a Parakeet model on CUDA (the GPU engine's: bf16 encoder, fused; or a plain one).
        config: :class:`~flashasr.models.parakeet.streaming.StreamingConfig` (``max_batch``:
            the largest bucket; a step with more rows runs in several launches).
        use_graphs: False keeps everything eager (for comparisons).

    Raises:
        ValueError: the model is not on a CUDA device.
    """

    def __init__(self, model, config: StreamingConfig | None = None, *, use_graphs: bool = True):
        super().__init__(model, config)
        if self.device.type != "cuda":
            raise ValueError(f"GraphedStreamer needs a model on a CUDA device, got {self.device}")
        self.use_graphs = bool(use_graphs)
        self.decoder = _CarryDecoder(model.predictor, model.joint)
        self.buckets = self.cfg.row_buckets()
        top = self.buckets[-1]  # every bucket's window samples: views of one device and one pinned buffer
        self._seg = torch.zeros(top, self.window_samples, dtype=torch.float32, device=self.device)
        self._h_seg = torch.zeros(top, self.window_samples, dtype=torch.float32, pin_memory=True)
        self._graphs: dict[int, _StepGraph] = {}
        self._pool_handle = torch.cuda.graph_pool_handle()
        # every bucket is captured on these same streams: the caching allocator hands a capture the
        # pool's free blocks of its own stream only, so with fresh streams per capture (PyTorch's 32
        # pooled streams, round robin) no bucket reused another's activation memory
        self._streams = [torch.cuda.Stream() for _ in range(3)]
        self._full_ok = True   # WHILE-node capture still believed to work
        self._graph_ok = True  # encoder capture still believed to work
        self.capture_oom = False  # a capture ran out of GPU memory (the server then drops this streamer)
        self.captures = 0  # graphs captured (warm-up, then re-captures after the state pool grew)
        self.events: list[str] = []
        self._add_norm = add_layer_norm  # one kernel per residual add + LayerNorm (falls back by itself)

    def _qkv(self, att, h: torch.Tensor, terms: tuple) -> tuple[torch.Tensor, ...]:
        """The parent's projections from the engine's fused ``[3d, d]`` weight when it has one
        (:func:`~.fast_attention.install_fast_attention`; rebuilt if the weights changed): one
        GEMM whose bias holds ``pos_bias_u``, then ``q + v = (q + u) + (v - u)``."""
        if att._buffers.get("_qkv_weight") is None:
            return super()._qkv(att, h, terms)
        if att._qkv_source != _source_key(att):
            _fuse_qkv(att)
        B, C, _ = h.shape
        qkv = F.linear(h, att._qkv_weight, att._qkv_bias).view(B, C, 3, att.h, att.d_k)
        qu = qkv[:, :, 0]
        return qu, qu + att._vu.to(qu.dtype), qkv[:, :, 1], qkv[:, :, 2]

    def _sdpa(self, q, k, v, mask, scale: float) -> torch.Tensor:
        """The parent's attention on PyTorch's memory-efficient SDPA kernel (the plain one where
        it does not apply). A step has few queries per row (the chunk's ``C`` frames) against a
        short ring of keys; cuDNN, PyTorch's first choice on Hopper, spends a 64-query tile on
        each row's ``C`` queries: one 0.6B layer at 256 rows and 7 queries took 161 µs against
        109 µs on an H200 (scratch micro-benchmark, eighth session); the graph of a whole 256-row
        step 15.10 -> 13.94 ms on an H100 (``profile_stream_step_h100_sdpa{,_before}.json``)."""
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)

    # ------------------------------------------------------------------ host side
    def _bucket(self, B: int) -> int:
        return next(b for b in self.buckets if b >= B)

    def padded_rows(self, B: int) -> int:
        if not self.use_graphs or not self._graph_ok:
            return B
        top = self.buckets[-1]
        return (B // top) * top + (self._bucket(B % top) if B % top else 0)

    def _window_buffer(self, B: int) -> np.ndarray:
        """A step of at most the largest bucket writes its windows straight into that bucket's
        pinned upload buffer (``_replay`` then skips the copy)."""
        if not (self.use_graphs and self._graph_ok) or B > self.buckets[-1]:
            return super()._window_buffer(B)
        g = self._graph(self._bucket(B))
        return super()._window_buffer(B) if g is None else g.h_seg[:B].numpy()

    def warmup(self, steps: int = 4) -> None:
        """Capture every bucket's graph (seconds), then the parent's throwaway stream."""
        if self.use_graphs:
            for b in self.buckets:
                self._graph(b)
        super().warmup(steps)

    def device_step(self, seg: np.ndarray, n_new: np.ndarray, first: np.ndarray, feat_valid: np.ndarray,
                    slots: np.ndarray) -> list[list[int]]:
        if not (self.use_graphs and self._graph_ok):
            return super().device_step(seg, n_new, first, feat_valid, slots)
        out: list[list[int]] = []
        top = self.buckets[-1]
        for a in range(0, len(slots), top):
            out += self._replay(seg[a:a + top], n_new[a:a + top], first[a:a + top], feat_valid[a:a + top],
                                slots[a:a + top])
        return out

    def _replay(self, seg, n_new, first, feat_valid, slots) -> list[list[int]]:
        B = len(slots)
        g = self._graph(self._bucket(B))
        if g is None:  # capture failed just now: eager from here on
            return super().device_step(seg, n_new, first, feat_valid, slots)
        if seg.ctypes.data != g.h_seg.data_ptr():  # not already in place (_window_buffer)
            g.h_seg[:B].copy_(torch.from_numpy(seg))
        g.h_seg[B:].zero_()
        idx = g.h_idx
        idx.zero_()
        idx[3].fill_(self.pool.scratch)
        idx[0, :B] = torch.from_numpy(n_new)
        idx[1, :B] = torch.from_numpy(first.astype(np.int64))
        idx[2, :B] = torch.from_numpy(feat_valid)
        idx[3, :B] = torch.from_numpy(slots)
        g.seg.copy_(g.h_seg, non_blocking=True)
        d_idx = idx.to(self.device, non_blocking=True)
        g.n_new.copy_(d_idx[0])
        g.first.copy_(d_idx[1].bool())
        g.feat_valid.copy_(d_idx[2])
        g.slots.copy_(d_idx[3])
        g.graph.replay()
        if g.mode == "encoder":  # decoder eager on the graph's encoder output
            return self._decode_eager(g, B)
        g.h_n.copy_(g.dec.n, non_blocking=True)
        g.h_out.copy_(g.dec.out, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        n = g.h_n[:B].tolist()
        rows = g.h_out[:B, : max(n, default=0), 0].tolist()  # one conversion for all rows
        return [r[:k] for r, k in zip(rows, n)]

    def _decode_eager(self, g: _StepGraph, B: int) -> list[list[int]]:
        return self.decode_step(g.f_out[:B], g.n_new[:B], g.slots[:B])

    # ------------------------------------------------------------------ capture
    def _graph(self, B: int) -> _StepGraph | None:
        g = self._graphs.get(B)
        if g is not None and g.version != self.pool.version:
            g = None  # the pool grew: its tensors were replaced
            self._graphs.clear()
        if g is None:
            g = _StepGraph(self, B)
            try:
                if self._full_ok:
                    try:
                        self._capture(g, full=True)
                    except Exception as e:  # noqa: BLE001 - WHILE nodes unavailable: encoder graph only
                        self.capture_oom |= isinstance(e, torch.OutOfMemoryError)
                        self._note(f"streaming step: WHILE-node graph failed ({type(e).__name__}: {e}); "
                                   f"encoder graph + eager decoder")
                        self._full_ok = False
                        torch.cuda.synchronize()
                        g = _StepGraph(self, B)
                if g.graph is None:
                    self._capture(g, full=False)
            except Exception as e:  # noqa: BLE001 - no graphs at all: eager
                self.capture_oom |= isinstance(e, torch.OutOfMemoryError)
                self._note(f"streaming step: graph capture failed ({type(e).__name__}: {e}); eager")
                self._graph_ok = False
                self._graphs.clear()
                torch.cuda.synchronize()
                return None
            self._graphs[B] = g
        return g

    def _note(self, msg: str) -> None:
        log.warning(msg)
        self.events.append(msg)

    def _body(self, g: _StepGraph, full: bool, builder=None, streams=None) -> None:
        """The step on the static tensors (what is captured; also the warm-up)."""
        f, n = self.encode_step(g.seg, g.n_new, g.first, g.feat_valid, g.slots)
        g.f_out = f
        if not full:
            return
        pool, s = self.pool, g.dec
        s.f_enc.copy_(f)
        s.lengths.copy_(n)
        s.init_time.copy_(pool.dec_time.index_select(0, g.slots))
        s.init_gp.copy_(pool.dec_gp.index_select(0, g.slots).to(s.init_gp.dtype))
        s.init_state[0].copy_(pool.dec_h.index_select(1, g.slots))
        s.init_state[1].copy_(pool.dec_c.index_select(1, g.slots))
        dec = self.decoder
        dec._before(s)
        if builder is None:  # warm-up: every step function once
            dec._head(s)
            dec._inner(s)
            dec._tail(s)
        else:
            outer, inner = streams
            with builder.loop(s.active_any, outer):
                dec._head(s)
                with builder.loop(s.search_any, inner):
                    dec._inner(s)
                dec._tail(s)
        pool.dec_time.index_copy_(0, g.slots, s.time - s.lengths)
        pool.dec_gp.index_copy_(0, g.slots, s.gp.to(pool.dec_gp.dtype))
        pool.dec_h.index_copy_(1, g.slots, s.state[0].to(pool.dec_h.dtype))
        pool.dec_c.index_copy_(1, g.slots, s.state[1].to(pool.dec_c.dtype))

    @torch.no_grad()
    def _capture(self, g: _StepGraph, full: bool) -> None:
        # warm-up on the capture streams with every row on the scratch slot, one frame each
        g.slots.fill_(self.pool.scratch)
        g.n_new.fill_(1)
        g.feat_valid.fill_(2 * self.sub)
        g.first.fill_(False)
        streams = self._streams[:3 if full else 1]
        for st in streams:
            st.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(st):
                for _ in range(2):
                    self._body(g, full)
            torch.cuda.current_stream().wait_stream(st)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        stream = streams[0]
        if full:
            from .cuda_conditional import WhileLoopBuilder, allocate_to_graph_pool, check_support

            check_support()
            with graph_capture(graph, pool=self._pool_handle, stream=stream, capture_error_mode="thread_local"):
                with allocate_to_graph_pool(self._pool_handle):
                    builder = WhileLoopBuilder()
                    self._body(g, True, builder, streams[1:])
            g.keep += [builder, streams]
        else:
            with graph_capture(graph, pool=self._pool_handle, stream=stream):
                self._body(g, False)
            g.keep.append(streams)
        torch.cuda.synchronize()
        g.n_new.zero_()
        g.graph, g.mode = graph, "full" if full else "encoder"
        self.captures += 1


__all__ = ["GraphedStreamer"]
