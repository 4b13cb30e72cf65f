"""Graphs captured with :func:`flashasr.engine.capture.graph_capture`
own their cuBLAS workspace, so graphs captured on one stream may replay at the same time and may be
destroyed one by one (pytorch/pytorch#193402). The GPU tests are skipped without CUDA.

The GEMMs are shaped for a split-K reduction (64 x 64 outputs over a long inner dimension), the
kind of kernel that writes partial sums into the workspace.
"""

from __future__ import annotations

import pytest
import torch

from flashasr.engine.capture import graph_capture

K = 1 << 20
gpu = pytest.mark.gpu


def test_the_workspaces_are_dropped_right_before_and_after_the_capture(monkeypatch):
    """CPU: the capture runs between two drops of the cached workspaces, after a synchronize (the
    warm-up's GEMMs may still use the workspace dropped first), also when the capture fails."""
    import contextlib

    import flashasr.engine.capture as capture

    calls = []

    @contextlib.contextmanager
    def fake_graph(graph, **kw):
        calls.append(("capture", kw["pool"], kw["stream"], kw["capture_error_mode"]))
        yield
        calls.append("end")

    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: calls.append("sync"))
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: calls.append("clear"), raising=False)
    import gc

    monkeypatch.setattr(gc, "collect", lambda: calls.append("gc"))
    with capture.graph_capture("g", pool="p", stream="s", capture_error_mode="thread_local"):
        calls.append(("body", gc.isenabled()))
    assert calls == ["sync", "gc", "clear", ("capture", "p", "s", "thread_local"), ("body", False), "end", "clear"]
    assert gc.isenabled()
    calls.clear()
    with pytest.raises(RuntimeError), capture.graph_capture("g"):
        raise RuntimeError("capture failed")
    assert calls == ["sync", "gc", "clear", ("capture", None, None, "global"), "clear"] and gc.isenabled()


def _gemm_graph(stream, seed: int, pool=None):
    """A graph of ``out = a @ b`` (float32, [64, K] x [K, 64]) captured on ``stream``, its output and
    that output after one replay alone. The inputs live as long as the graph (``graph.inputs``)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(64, K, device="cuda", generator=g)
    b = torch.randn(K, 64, device="cuda", generator=g)
    out = torch.empty(64, 64, device="cuda")
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            torch.matmul(a, b, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph, pool=pool, stream=stream):
        torch.matmul(a, b, out=out)
    graph.inputs = (a, b)  # the graph reads their memory: freed, the next graph's inputs would take it
    graph.replay()
    torch.cuda.synchronize()
    return graph, out, out.clone()


@gpu
def test_graphs_captured_on_one_stream_replay_together_exactly():
    """Two GEMM graphs captured on the same stream, replayed on two streams at the same time, give
    exactly what each gives alone (with a shared workspace one's partial sums overwrote the other's)."""
    capture = torch.cuda.Stream()
    g1, out1, alone1 = _gemm_graph(capture, 1)
    g2, out2, alone2 = _gemm_graph(capture, 2)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    for _ in range(200):
        s1.wait_stream(torch.cuda.current_stream())
        s2.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s1):
            g1.replay()
        with torch.cuda.stream(s2):
            g2.replay()
        torch.cuda.current_stream().wait_stream(s1)
        torch.cuda.current_stream().wait_stream(s2)
        torch.cuda.synchronize()
        assert torch.equal(out1, alone1) and torch.equal(out2, alone2)


@gpu
def test_destroying_one_graph_keeps_the_others_workspace():
    """A graph destroyed after another was captured on its stream (PyTorch then clears that stream's
    workspaces) leaves the other's replay exact, also once its memory has been handed out again."""
    capture = torch.cuda.Stream()
    g1, out1, alone1 = _gemm_graph(capture, 3)
    g2, _, _ = _gemm_graph(capture, 4)
    del g2
    torch.cuda.synchronize()
    filler = [torch.full((1 << 22,), float("nan"), device="cuda") for _ in range(64)]  # reuse freed memory
    for _ in range(20):
        g1.replay()
        torch.cuda.synchronize()
        assert torch.equal(out1, alone1)
    del filler


@gpu
def test_eager_work_after_a_capture_uses_no_workspace_of_the_graph():
    """Eager GEMMs on a capture stream after the capture do not write into the graph's pool: the
    graph's replay stays exact while they run beside it."""
    capture = torch.cuda.Stream()
    g1, out1, alone1 = _gemm_graph(capture, 5)
    a = torch.randn(64, K, device="cuda")
    b = torch.randn(K, 64, device="cuda")
    side = torch.cuda.Stream()
    for _ in range(100):
        capture.wait_stream(torch.cuda.current_stream())
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(capture):
            eager = a @ b
        with torch.cuda.stream(side):
            g1.replay()
        torch.cuda.current_stream().wait_stream(capture)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        assert torch.equal(out1, alone1) and torch.isfinite(eager).all()
