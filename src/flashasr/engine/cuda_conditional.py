"""CUDA-graph WHILE loops inside a PyTorch graph capture, through ``cuda.bindings``.

A conditional node (CUDA >= 12.4 driver; ``cudaGraphConditionalHandleCreate``,
``CU_GRAPH_COND_TYPE_WHILE``) repeats its body graph while a handle is non-zero. The handle
is set on the device by a one-thread kernel, compiled at run time with NVRTC, that calls the
device runtime's ``cudaGraphSetConditional(handle, *flag)`` where ``flag`` is a ``bool`` in
device memory. The kernel runs once in the parent graph (enter the loop or not) and once at
the end of the body (run another iteration or not). This is the technique NVIDIA NeMo uses
for its label-looping decoders (``nemo/core/utils/cuda_python_utils.py``); this file is our
own implementation of it.

Memory: the body is captured on its own stream into the child graph, which has its own
capture id, so PyTorch's graph-pool filter (by capture id) would not see its allocations.
:func:`allocate_to_graph_pool` routes every allocation of this thread into the parent graph's
private pool while the capture runs, so temporaries of the body live as long as the graph.

Everything here raises :class:`CudaGraphUnsupported` (a :class:`FlashASRError`) on failure,
so callers can fall back to graphs without WHILE nodes.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import numpy as np
import torch

from ..errors import FlashASRError

log = logging.getLogger(__name__)


class CudaGraphUnsupported(FlashASRError):
    """CUDA graph conditional nodes are unavailable or failed (old driver, no cuda.bindings...)."""

    code = "cuda_graph_unsupported"


_KERNEL_SRC = r"""
typedef __device_builtin__ unsigned long long cudaGraphConditionalHandle;
extern "C" __device__ __cudart_builtin__ void cudaGraphSetConditional(cudaGraphConditionalHandle handle,
                                                                      unsigned int value);
extern "C" __global__ void flashasr_set_while(cudaGraphConditionalHandle handle, const bool *flag)
{
    cudaGraphSetConditional(handle, *flag ? 1u : 0u);
}
"""

_CACHE: dict = {}


def _bindings():
    try:
        from cuda.bindings import driver, nvrtc, runtime  # noqa: F401
        from cuda.bindings import __version__ as ver
    except Exception as e:  # ImportError, or a broken install
        raise CudaGraphUnsupported(f"cuda.bindings is not importable: {e}") from e
    return driver, runtime, nvrtc, ver


def bindings_major() -> int:
    *_, ver = _bindings()
    try:
        return int(str(ver).split(".")[0])
    except ValueError:
        return 12


def _check(result, what: str):
    """Unpack a cuda.bindings call result ``(err, *values)``; raise on a non-zero error."""
    if isinstance(result, tuple):
        err, *vals = result
    else:
        err, vals = result, []
    if int(err) != 0:
        raise CudaGraphUnsupported(f"{what} failed: {err}")
    if not vals:
        return None
    return vals[0] if len(vals) == 1 else tuple(vals)


def check_support() -> dict:
    """Check that WHILE conditional nodes can be used here.

    Returns a dict with the bindings version and the driver's CUDA version.
    Raises:
        CudaGraphUnsupported: no CUDA, no cuda.bindings, or a driver older than CUDA 12.4.
    """
    if not torch.cuda.is_available():
        raise CudaGraphUnsupported("CUDA is not available")
    driver, runtime, nvrtc, ver = _bindings()
    drv = _check(driver.cuDriverGetVersion(), "cuDriverGetVersion")
    if drv < 12040:
        raise CudaGraphUnsupported(f"driver CUDA version {drv} < 12040 has no conditional nodes")
    return {"cuda_bindings": str(ver), "driver_cuda_version": int(drv)}


def _set_while_kernel():
    """Compile (once per process and device) the kernel that sets a conditional handle."""
    dev = torch.cuda.current_device()
    if dev in _CACHE:
        return _CACHE[dev]
    driver, runtime, nvrtc, _ = _bindings()
    prog = _check(nvrtc.nvrtcCreateProgram(_KERNEL_SRC.encode(), b"flashasr_while.cu", 0, [], []),
                  "nvrtcCreateProgram")
    major, minor = torch.cuda.get_device_capability(dev)
    opts = [f"--gpu-architecture=compute_{major}{minor}".encode()]
    res = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    if int(res[0]) != 0:
        size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        buf = bytearray(size)
        nvrtc.nvrtcGetProgramLog(prog, buf)
        raise CudaGraphUnsupported(f"NVRTC compile failed: {bytes(buf).decode(errors='replace')}")
    size = _check(nvrtc.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
    ptx = bytearray(size)
    _check(nvrtc.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
    ptx_arr = np.frombuffer(bytes(ptx), dtype=np.uint8).copy()
    torch.cuda.init()
    module = _check(driver.cuModuleLoadData(ptx_arr.ctypes.data), "cuModuleLoadData")
    func = _check(driver.cuModuleGetFunction(module, b"flashasr_set_while"), "cuModuleGetFunction")
    _CACHE[dev] = (module, func, ptx_arr)
    return _CACHE[dev]


def _capture_info(stream_ptr: int):
    driver, runtime, nvrtc, _ = _bindings()
    vals = _check(runtime.cudaStreamGetCaptureInfo(stream_ptr), "cudaStreamGetCaptureInfo")
    # 12.x: (status, id, graph, deps, numDeps); 13.x adds edgeData before numDeps
    status, graph, deps = vals[0], vals[2], vals[3]
    if status != runtime.cudaStreamCaptureStatus.cudaStreamCaptureStatusActive:
        raise CudaGraphUnsupported("stream is not capturing")
    return graph, list(deps) if deps is not None else []


class WhileLoopBuilder:
    """Adds WHILE loops to the graph being captured on the current torch stream.

    Keep the builder alive as long as the graph: it owns the argument arrays the captured
    kernel launches point to.

    Usage (inside ``torch.cuda.graph(...)``)::

        b = WhileLoopBuilder()
        with b.loop(flag_tensor):      # flag_tensor: 0-dim/1-element bool CUDA tensor
            body()                     # must recompute flag_tensor
    """

    def __init__(self):
        self._keep: list = []
        self.driver, self.runtime, self.nvrtc, ver = _bindings()
        self.major = int(str(ver).split(".")[0])
        _, self.func, _ = _set_while_kernel()
        stream = torch.cuda.current_stream()
        self.root_graph, _ = _capture_info(stream.cuda_stream)

    def _launch(self, stream_ptr: int, args: np.ndarray):
        _check(self.driver.cuLaunchKernel(self.func, 1, 1, 1, 1, 1, 1, 0, stream_ptr,
                                          args.ctypes.data, 0), "cuLaunchKernel")

    @contextlib.contextmanager
    def loop(self, flag: torch.Tensor, body: torch.cuda.Stream | None = None) -> Iterator[torch.cuda.Stream]:
        if flag.dtype != torch.bool or flag.numel() != 1 or not flag.is_cuda:
            raise CudaGraphUnsupported("loop flag must be a 1-element bool CUDA tensor")
        drv, rt = self.driver, self.runtime
        parent = torch.cuda.current_stream()
        handle = _check(rt.cudaGraphConditionalHandleCreate(self.root_graph, 0, 0),
                        "cudaGraphConditionalHandleCreate")
        flag_ptr = np.array([flag.data_ptr()], dtype=np.uint64)
        args = np.array([handle.getPtr(), flag_ptr.ctypes.data], dtype=np.uint64)
        self._keep += [handle, flag_ptr, args]
        # decide whether to enter the loop at all
        self._launch(parent.cuda_stream, args)
        graph, deps = _capture_info(parent.cuda_stream)
        params = drv.CUgraphNodeParams()
        params.type = drv.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
        params.conditional.handle = handle
        params.conditional.type = drv.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_WHILE
        params.conditional.size = 1
        params.conditional.ctx = _check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
        if self.major >= 13:
            node = _check(drv.cuGraphAddNode(graph, deps, None, len(deps), params), "cuGraphAddNode")
            _check(rt.cudaStreamUpdateCaptureDependencies(
                parent.cuda_stream, [node], None, 1,
                rt.cudaStreamUpdateCaptureDependenciesFlags.cudaStreamSetCaptureDependencies),
                "cudaStreamUpdateCaptureDependencies")
        else:
            node = _check(drv.cuGraphAddNode(graph, deps, len(deps), params), "cuGraphAddNode")
            _check(rt.cudaStreamUpdateCaptureDependencies(
                parent.cuda_stream, [node], 1,
                rt.cudaStreamUpdateCaptureDependenciesFlags.cudaStreamSetCaptureDependencies),
                "cudaStreamUpdateCaptureDependencies")
        body_graph = params.conditional.phGraph_out[0]
        body = body if body is not None else torch.cuda.Stream()
        self._keep.append(body)
        _check(rt.cudaStreamBeginCaptureToGraph(
            body.cuda_stream, body_graph, None, None, 0,
            rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCaptureToGraph")
        active = True
        try:
            torch.cuda.set_stream(body)
            yield body
            # decide whether to run another iteration
            self._launch(body.cuda_stream, args)
            active = False
            _check(rt.cudaStreamEndCapture(body.cuda_stream), "cudaStreamEndCapture")
        finally:
            if active:
                try:
                    rt.cudaStreamEndCapture(body.cuda_stream)
                except Exception:  # pragma: no cover - best effort cleanup
                    pass
            torch.cuda.set_stream(parent)


@contextlib.contextmanager
def allocate_to_graph_pool(pool, strategy: str | None = None) -> Iterator[None]:
    """Route this thread's CUDA allocations into the graph memory pool ``pool`` (during capture).

    Call it inside ``torch.cuda.graph(g, pool=pool)``. PyTorch records allocations into the
    pool only for streams whose capture id is the graph's; WHILE bodies are captured on other
    streams with their own capture ids. Strategy ``"thread"`` (default) swaps PyTorch's
    per-capture filter for a filter on this thread (all of whose allocations belong to the
    capture), and leaves it for ``capture_end`` to remove. ``"none"`` does nothing: body
    temporaries then come from the body streams' ordinary cache (what NeMo does).
    Environment override: ``FLASHASR_WHILE_POOL``.
    """
    import os

    strategy = strategy or os.environ.get("FLASHASR_WHILE_POOL", "thread")
    if strategy == "none":
        yield
        return
    dev = torch.cuda.current_device()
    begin = getattr(torch._C, "_cuda_beginAllocateCurrentThreadToPool", None)
    if begin is None:
        begin = getattr(torch._C, "_cuda_beginAllocateToPool", None)
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if begin is None or end is None:
        raise CudaGraphUnsupported("this torch build cannot route allocations to a graph pool")
    end(dev, pool)      # remove PyTorch's capture-id filter for this pool ...
    begin(dev, pool)    # ... and record every allocation of this thread into it instead
    yield               # capture_end() removes the entry
