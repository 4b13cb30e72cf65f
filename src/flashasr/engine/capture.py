"""CUDA graph capture with a cuBLAS workspace of the graph's own.

PyTorch keeps one cuBLAS (and one cuBLASLt) workspace per (cuBLAS handle, stream) and a GEMM
captured in a graph keeps its address. Graphs captured one after another on the same stream
therefore share one workspace whatever their memory pools, and ``torch.cuda.Stream()`` hands out
32 pooled streams round robin, so encoder profiles, decoder buckets and streaming steps captured in
different places can share a capture stream. Two consequences, both from PyTorch's own design
(pytorch/pytorch#193402; `CUDAGraph::reset` clears the workspaces of its capture stream since
pytorch/pytorch#175276):

* two such graphs replayed at the same time (the offline engine runs the next call's encoders
  beside the decoder of the one before) write the same scratch memory;
* destroying one graph frees the workspace the others still use (an illegal address on replay,
  or silent corruption once the memory is handed out again).

:func:`graph_capture` drops every cached workspace right before the capture begins, so the
capture allocates a fresh one from the graph's memory pool (the caching allocator serves a
capturing stream from the capture's pool), and drops it again when the capture ends, so eager work
later on the same stream gets an ordinary workspace instead of one inside the pool. Each graph then
owns its workspace as it owns its activations: graphs of one pool that never replay together
share that memory, graphs of different pools never do. The cost is one workspace per pool (a few
MiB), measured with the engine's load (``docs/ENGINE.md``).

Warm-up before the capture must be finished (synchronized) before entering: dropping a workspace
frees its memory to the allocator. Python's cyclic garbage collector is run before the capture and
held off during it: an engine dropped earlier whose graphs the collector destroyed mid-capture
(``CUDAGraph::reset`` frees memory, not permitted while a stream captures) invalidated the capture.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

import torch


def clear_cublas_workspaces() -> bool:
    """Drop PyTorch's cached cuBLAS and cuBLASLt workspaces of every (handle, stream) (the memory
    goes back to the caching allocator; the next GEMM on a stream allocates a new one). Returns
    False where this PyTorch build has no such call (a CPU build)."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None:
        return False
    clear()
    return True


@contextlib.contextmanager
def graph_capture(graph: "torch.cuda.CUDAGraph", *, pool=None, stream: "torch.cuda.Stream | None" = None,
                  capture_error_mode: str = "global") -> Iterator[None]:
    """``torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode=...)`` whose GEMMs use a
    cuBLAS workspace allocated inside the capture (from ``pool``), not the one cached for the capture
    stream (see the module docstring for why).

    Args:
        graph: the ``torch.cuda.CUDAGraph`` to capture into.
        pool: a graph memory pool handle (``torch.cuda.graph_pool_handle()`` or ``graph.pool()`` of
            another graph) or None for a pool of the graph's own.
        stream: the capture stream (None: PyTorch's default for captures).
        capture_error_mode: as ``torch.cuda.graph`` (``"thread_local"`` for captures with
            conditional nodes, whose bodies are captured on other streams of this thread).
    """
    torch.cuda.synchronize()
    gc.collect()  # graphs waiting to be destroyed go now: destroyed during a capture, they invalidate it
    clear_cublas_workspaces()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode):
            yield
    finally:  # nothing captured has run yet: the workspace it holds is not in use
        if was_enabled:
            gc.enable()
        clear_cublas_workspaces()


__all__ = ["graph_capture", "clear_cublas_workspaces"]
