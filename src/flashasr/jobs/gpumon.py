"""GPU utilisation sampled through NVML in a light background thread (job reports, benchmarks).

NVML's ``nvmlDeviceGetUtilizationRates(handle).gpu`` is the percentage of the driver's last
sample period (between 1/6 s and 1 s, depending on the GPU) during which one or more kernels
ran on the device -- a coarse "was the GPU doing anything" figure, not SM occupancy. The
sampler reads it every ``interval_s`` seconds, together with the memory in use, and reports
the mean, the maximum and the number of samples. It needs the ``pynvml`` module (PyPI
``nvidia-ml-py``); without it, or without an NVIDIA driver, :meth:`NvmlSampler.result` says
``available: False`` and why, and nothing else changes.

The device is matched to NVML through torch's own CUDA -> NVML index mapping (which follows
``CUDA_VISIBLE_DEVICES``, UUIDs included), else by its UUID, else the numeric
``CUDA_VISIBLE_DEVICES`` entry (or the torch index) is used as the NVML index.
"""

from __future__ import annotations

import os
import threading


def _import_nvml():
    import pynvml  # noqa: PLC0415 (optional dependency)

    return pynvml


def _nvml_index_for(torch_index: int) -> int:
    """NVML index for a torch device index when no UUID is available."""
    vis = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if vis:
        parts = [p.strip() for p in vis.split(",") if p.strip()]
        if torch_index < len(parts) and parts[torch_index].isdigit():
            return int(parts[torch_index])
    return torch_index


def _handle_for(nvml, device: str):
    """NVML handle of a torch CUDA device string (``cuda``, ``cuda:1``)."""
    idx = 0
    if ":" in device:
        try:
            idx = int(device.split(":", 1)[1])
        except ValueError:
            idx = 0
    uuid = None
    try:
        import torch

        if torch.cuda.is_available():
            if ":" not in device:
                idx = torch.cuda.current_device()
            # torch's own CUDA -> NVML index mapping (handles CUDA_VISIBLE_DEVICES with UUIDs)
            mapper = getattr(torch.cuda, "_get_nvml_device_index", None)
            if mapper is not None:
                try:
                    return nvml.nvmlDeviceGetHandleByIndex(int(mapper(idx)))
                except Exception:
                    pass
            u = getattr(torch.cuda.get_device_properties(idx), "uuid", None)
            if u is not None:
                uuid = str(u)
    except Exception:  # torch missing or not initialisable: fall back to the index
        uuid = None
    if uuid:
        full = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
        for cand in (full, full.encode(), uuid):
            try:
                return nvml.nvmlDeviceGetHandleByUUID(cand)
            except Exception:  # the UUID spelling NVML wants differs between versions
                continue
    return nvml.nvmlDeviceGetHandleByIndex(_nvml_index_for(idx))


class NvmlSampler:
    """Sample NVML GPU utilisation (%) and memory used (bytes) in a daemon thread.

    Args:
        device: torch device string of the GPU to watch (``cuda``, ``cuda:0``).
        interval_s: seconds between samples (default 0.1; one NVML call costs ~10-50 us).
        nvml: the ``pynvml`` module (tests pass a fake); None imports it.

    Use as a context manager or call :meth:`start` / :meth:`stop`; :meth:`result` gives
    ``{"available": True, "mean_util_pct", "max_util_pct", "samples", "interval_s",
    "max_memory_used_bytes", "name"}`` or ``{"available": False, "reason": ...}``. Never raises
    because NVML is missing or fails: a monitor must not break the job it watches.
    """

    def __init__(self, device: str = "cuda", interval_s: float = 0.1, nvml=None):
        self.device = str(device)
        self.interval_s = max(0.005, float(interval_s))
        self._nvml = nvml
        self._handle = None
        self._reason: str | None = None
        self._util: list[float] = []
        self._mem_max = 0
        self._name: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._inited = False

    def start(self) -> "NvmlSampler":
        """Initialise NVML and start sampling (no-op, with a reason, when unavailable)."""
        try:
            nvml = self._nvml if self._nvml is not None else _import_nvml()
        except Exception as e:  # ImportError, or a broken install
            self._reason = f"pynvml not importable ({type(e).__name__}: {e}); install nvidia-ml-py"
            return self
        try:
            nvml.nvmlInit()
            self._inited = True
            self._nvml = nvml
            self._handle = _handle_for(nvml, self.device)
            try:
                n = nvml.nvmlDeviceGetName(self._handle)
                self._name = n.decode() if isinstance(n, bytes) else str(n)
            except Exception:
                self._name = None
            self._sample()  # fail here, not silently in the thread
        except Exception as e:  # no driver, no such device, NVML error
            self._reason = f"NVML unavailable ({type(e).__name__}: {e})"
            self._handle = None
            self._shutdown()
            return self
        self._thread = threading.Thread(target=self._loop, name="flashasr-nvml", daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        u = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
        self._util.append(float(u.gpu))
        try:
            m = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
            self._mem_max = max(self._mem_max, int(m.used))
        except Exception:
            pass

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._sample()
            except Exception as e:  # keep what we have; stop sampling
                self._reason = f"NVML sampling stopped ({type(e).__name__}: {e})"
                return

    def _shutdown(self) -> None:
        if self._inited:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
            self._inited = False

    def stop(self) -> dict:
        """Stop sampling (takes one last sample) and return :meth:`result`."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5.0)
            self._thread = None
            if self._handle is not None:
                try:
                    self._sample()
                except Exception:
                    pass
        self._shutdown()
        return self.result()

    def result(self) -> dict:
        """The summary so far (see the class docstring)."""
        if not self._util:
            return {"available": False, "reason": self._reason or "not started"}
        out = {"available": True, "mean_util_pct": round(sum(self._util) / len(self._util), 1),
               "max_util_pct": round(max(self._util), 1), "samples": len(self._util),
               "interval_s": self.interval_s, "max_memory_used_bytes": self._mem_max, "name": self._name}
        if self._reason:
            out["note"] = self._reason
        return out

    def __enter__(self) -> "NvmlSampler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def gpu_monitor_unavailable(reason: str) -> dict:
    """The ``nvml`` entry of a report when no sampler ran."""
    return {"available": False, "reason": reason}


__all__ = ["NvmlSampler", "gpu_monitor_unavailable"]
