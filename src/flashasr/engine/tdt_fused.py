"""The steps of TDT label looping in a few GPU launches instead of about twenty each.

One head or inner step of :class:`~flashasr.engine.tdt_graphs.TDTGraphDecoder` (the joint at each
row's current frame, the label and duration argmaxes, the blank jump) is, with PyTorch operations,
a chain of about twenty small kernels: a gather of the encoder frame, the add and the activation,
the output layer, two argmaxes, a table lookup, a dozen ``where``/compare/add updates and an
``any()``. Inside the decoder's CUDA graph each costs a few microseconds of launch and dependency
latency whatever the batch, and the decode of an 11 s utterance runs a few hundred such steps:
the decoder, not the encoder, set the cost of a stream's final on the H200
(``bench/results/profile_final_call_h200.json``). Here one step is:

1. ``_joint_in`` (Triton, one program per row): ``h = relu(f_enc[b, min(t, last)] + g[b])``
   (the ``f + g`` add in float32, rounded once to the joint's dtype, as PyTorch's add does; ReLU
   commutes with that rounding), and clears the loop flag;
2. the joint's output layer, the module's own ``nn.Linear`` on ``h`` (the same cuBLAS call as
   the unfused path, so the logits are bit-identical);
3. ``_joint_out`` (Triton, one program per row): the first index of the largest label logit and
   of the largest duration logit (``torch.argmax``'s rule for ties), the duration value, then the
   head or inner update of ``label/dur/frame/time/count/searching`` exactly as
   :meth:`TDTGraphDecoder._head` / ``_inner`` write it; rows still searching set the loop flag
   (plain stores of 1: every writer writes the same value).

The tail of an iteration (:meth:`TDTGraphDecoder._tail`: record the labels, advance the predictor
for the rows that found one, the time advance and the ``max_symbols`` rule, the loop flag) keeps
the predictor's own ``step`` and the joint's ``project_predictor`` (LSTM and linear layers: the same
calls, bit-identical) and does its bookkeeping in two Triton launches (``_tail_in`` before the
predictor, ``_tail_out`` after) plus one masked ``torch.where`` per predictor state tensor, instead
of about twenty small kernels.

The results (labels, frames, durations) are identical to the unfused steps: same logits, same
argmax rule (``tests/test_engine_tdt.py::test_gpu_fused_joint_step_identical``). NaN logits are
the one difference (``torch.argmax`` returns the first NaN, these kernels skip NaN); a NaN in the
joint already means broken weights.

Used when ``triton`` imports, the buffers are on CUDA, the joint is a plain ``out(act(f + g))``
with ReLU and an ``nn.Linear`` output (:class:`~flashasr.models.parakeet.decoder.TDTJoint`, the
Parakeet joint) and the encoder projection and predictor output share the joint's dtype; any
other joint, or a launch error (logged, then the unfused step for the rest of the process), runs
the PyTorch step.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

try:  # pragma: no cover - GPU machines only
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - no triton (CPU installs): the PyTorch step runs
    triton = None

_STATE = {"ok": triton is not None, "error": None}

if triton is not None:  # pragma: no cover - compiled and run on the GPU only

    @triton.jit
    def _joint_in(F, G, TIME, LAST, H, FLAG, T, J, BLOCK_J: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        t = tl.minimum(tl.load(TIME + b), tl.load(LAST + b))
        cols = tl.arange(0, BLOCK_J)
        m = cols < J
        f = tl.load(F + (b * T + t) * J + cols, mask=m, other=0.0).to(tl.float32)
        g = tl.load(G + b * J + cols, mask=m, other=0.0).to(tl.float32)
        x = (f + g).to(H.dtype.element_ty)
        tl.store(H + b * J + cols, tl.maximum(x, 0.0), mask=m)
        if b == 0:
            tl.store(FLAG, tl.full((), 0, tl.uint8))

    @triton.jit
    def _joint_out(LOGITS, DURS, LABEL, DUR, FRAME, TIME, COUNT, LENGTHS, GATE, SEARCHING, FLAG,
                   stride, V1, ND, LIMIT, HEAD: tl.constexpr, QUIRK: tl.constexpr, BLOCK_V: tl.constexpr,
                   BLOCK_D: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        row = LOGITS + b * stride
        best_v = tl.full((), float("-inf"), tl.float32)
        best_i = tl.full((), 0, tl.int64)
        for start in range(0, V1, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            x = tl.load(row + cols, mask=cols < V1, other=float("-inf")).to(tl.float32)
            cmax = tl.max(x, axis=0)
            # first column holding the chunk's maximum (torch.argmax: the first index on ties)
            cidx = tl.min(tl.where(x == cmax, cols, V1 + BLOCK_V), axis=0).to(tl.int64)
            take = cmax > best_v
            best_i = tl.where(take, cidx, best_i)
            best_v = tl.where(take, cmax, best_v)
        dcols = tl.arange(0, BLOCK_D)
        xd = tl.load(row + V1 + dcols, mask=dcols < ND, other=float("-inf")).to(tl.float32)
        dmax = tl.max(xd, axis=0)
        di = tl.min(tl.where(xd == dmax, dcols, BLOCK_D), axis=0)
        dur = tl.load(DURS + di)
        lab = best_i
        blank = lab == V1 - 1
        time = tl.load(TIME + b)
        length = tl.load(LENGTHS + b)
        count = tl.load(COUNT + b)
        gate = tl.load(GATE + b) != 0  # head: active; inner: searching
        adv = tl.maximum(dur, 1)
        if QUIRK:
            adv += ((dur > 0) & (count == LIMIT - 1)).to(tl.int64)
        jump = blank & gate
        if HEAD:
            tl.store(LABEL + b, lab)
            tl.store(DUR + b, dur)
            tl.store(FRAME + b, time)
            tl.store(COUNT + b, tl.where(jump, 0, count))
        else:
            tl.store(LABEL + b, lab, mask=gate)
            tl.store(DUR + b, dur, mask=gate)
            tl.store(FRAME + b, time, mask=gate)
        time = time + tl.where(jump, adv, 0)
        tl.store(TIME + b, time)
        searching = jump & (time < length)
        tl.store(SEARCHING + b, searching.to(tl.uint8))
        tl.store(FLAG, searching.to(tl.uint8), mask=searching)

    @triton.jit
    def _tail_in(LABEL, FRAME, DUR, ACTIVE, N, OUT, TOKENS, FOUND, FLAG, out_stride, CAP, V):
        b = tl.program_id(0).to(tl.int64)
        label = tl.load(LABEL + b)
        found = (tl.load(ACTIVE + b) != 0) & (label != V)
        n = tl.load(N + b)
        slot = OUT + b * out_stride + tl.minimum(n, CAP - 1) * 3
        tl.store(slot, label.to(tl.int32))
        tl.store(slot + 1, tl.load(FRAME + b).to(tl.int32))
        tl.store(slot + 2, tl.load(DUR + b).to(tl.int32))
        tl.store(N + b, n + found.to(tl.int64))
        tl.store(TOKENS + b, tl.where(found, label, V))
        tl.store(FOUND + b, found.to(tl.uint8))
        if b == 0:
            tl.store(FLAG, tl.full((), 0, tl.uint8))

    @triton.jit
    def _tail_out(GP, GP_NEW, FOUND, DUR, TIME, COUNT, LENGTHS, ACTIVE, FLAG, J, LIMIT,
                  QUIRK: tl.constexpr, BLOCK_J: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        found = tl.load(FOUND + b) != 0
        cols = tl.arange(0, BLOCK_J)
        m = (cols < J) & found
        tl.store(GP + b * J + cols, tl.load(GP_NEW + b * J + cols, mask=m).to(GP.dtype.element_ty), mask=m)
        dur = tl.load(DUR + b)
        count = tl.load(COUNT + b)
        d0 = found & (dur == 0)
        cnt = tl.where(d0, count + 1, tl.where(found, 0, count))
        force = d0 & (cnt >= LIMIT)
        adv = tl.where(found, dur, 0) + force.to(tl.int64)
        if QUIRK:
            adv += (found & (dur > 0) & (count == LIMIT - 1)).to(tl.int64)
        time = tl.load(TIME + b) + adv
        tl.store(TIME + b, time)
        tl.store(COUNT + b, tl.where(force, 0, cnt))
        active = time < tl.load(LENGTHS + b)
        tl.store(ACTIVE + b, active.to(tl.uint8))
        tl.store(FLAG, active.to(tl.uint8), mask=active)


def fused_step_usable(dec, s) -> bool:
    """Whether :func:`joint_step` can run for decoder ``dec`` on buffers ``s`` (see the module
    docstring for the conditions)."""
    joint = dec.joint
    out = getattr(joint, "out", None)
    return (_STATE["ok"] and s.f_enc.is_cuda and isinstance(getattr(joint, "act", None), torch.nn.ReLU)
            and isinstance(out, torch.nn.Linear) and out.bias is not None
            and type(joint).joint_after_projection.__qualname__.endswith("TDTJoint.joint_after_projection")
            and s.gp.dtype == s.f_enc.dtype == out.weight.dtype and s.f_enc.is_contiguous()
            and s.gp.is_contiguous() and out.out_features == dec.blank_id + 1 + len(dec.durations))


def joint_step(dec, s, head: bool) -> bool:
    """Run one head (``head=True``) or inner step of label looping on buffers ``s`` in three
    launches; return False (nothing done) when the fused step is unavailable, so the caller runs
    the PyTorch step.

    Args:
        dec: the :class:`~flashasr.engine.tdt_graphs.TDTGraphDecoder` (joint, durations, limits).
        s: its ``_Buffers`` (``f_enc [B, T, J]``, ``gp [B, J]``, the int64 ``[B]`` state vectors,
            bool ``active/searching`` ``[B]``, bool ``search_any`` scalar), all on one CUDA device.
    """
    if not fused_step_usable(dec, s):
        return False
    try:
        B, T, J = s.f_enc.shape
        h = torch.empty(B, J, dtype=s.f_enc.dtype, device=s.f_enc.device)
        flag = s.search_any.view(torch.uint8)  # bool tensors as bytes: Triton stores 0/1 into them
        _joint_in[(B,)](s.f_enc, s.gp, s.time, s.last_index, h, flag, T, J,
                        BLOCK_J=triton.next_power_of_2(J), num_warps=4)
        logits = dec.joint.out(h)
        V1 = dec.blank_id + 1
        limit = dec.max_symbols if dec.max_symbols is not None else (1 << 40)
        _joint_out[(B,)](logits, dec._durs(s.device), s.label, s.dur, s.frame, s.time, s.count, s.lengths,
                         (s.active if head else s.searching).view(torch.uint8), s.searching.view(torch.uint8),
                         flag, logits.stride(0), V1,
                         len(dec.durations), limit, HEAD=head, QUIRK=dec.quirk,
                         BLOCK_V=min(2048, triton.next_power_of_2(V1)),
                         BLOCK_D=triton.next_power_of_2(max(2, len(dec.durations))), num_warps=8)
        return True
    except Exception as e:  # noqa: BLE001 - never break decoding: the PyTorch step from now on
        _STATE["ok"] = False
        _STATE["error"] = f"{type(e).__name__}: {e}"
        log.warning("fused TDT joint step failed (%s); using the PyTorch step from now on", _STATE["error"])
        return False


def tail_step(dec, s) -> bool:
    """Run the tail of one label-looping iteration (record the labels found, the predictor step
    for those rows, the time advance and the ``max_symbols`` rule; :meth:`TDTGraphDecoder._tail`)
    as: one Triton launch, the predictor's own ``step`` and the joint's ``project_predictor``, one
    masked ``torch.where`` per state tensor, one Triton launch. Returns False (nothing done) when
    unavailable, so the caller runs the PyTorch tail."""
    if not (fused_step_usable(dec, s) and s.out.is_contiguous()):
        return False
    try:
        import torch.utils._pytree as pytree

        B, _, J = s.f_enc.shape
        V = dec.blank_id
        flag = s.active_any.view(torch.uint8)
        tokens = torch.empty(B, dtype=torch.long, device=s.f_enc.device)
        found = torch.empty(B, dtype=torch.bool, device=s.f_enc.device)
        _tail_in[(B,)](s.label, s.frame, s.dur, s.active.view(torch.uint8), s.n, s.out, tokens,
                       found.view(torch.uint8), flag, s.out.stride(0), s.cap, V, num_warps=1)
        st = pytree.tree_unflatten(list(s.state), s.state_spec)
        g, new_st = dec.predictor.step(tokens, st)
        gp = dec.joint.project_predictor(g)
        for x, nx, shape in zip(s.state, pytree.tree_leaves(new_st), s.state_masks_shape):
            torch.where(found.view(shape), nx.to(x.dtype), x, out=x)
        limit = dec.max_symbols if dec.max_symbols is not None else (1 << 40)
        _tail_out[(B,)](s.gp, gp.contiguous(), found.view(torch.uint8), s.dur, s.time, s.count, s.lengths,
                        s.active.view(torch.uint8), flag, J, limit, QUIRK=dec.quirk,
                        BLOCK_J=triton.next_power_of_2(J), num_warps=4)
        return True
    except Exception as e:  # noqa: BLE001 - never break decoding: the PyTorch tail from now on
        _STATE["ok"] = False
        _STATE["error"] = f"{type(e).__name__}: {e}"
        log.warning("fused TDT tail step failed (%s); using the PyTorch steps from now on", _STATE["error"])
        return False


def fused_status() -> dict:
    """Whether the fused joint step is available and in use, and the error that disabled it."""
    return {"available": triton is not None, "in_use": _STATE["ok"], "error": _STATE["error"]}


__all__ = ["joint_step", "tail_step", "fused_step_usable", "fused_status"]
