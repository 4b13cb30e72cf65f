#!/usr/bin/env bash
# Device machine: environment probe (versions, cuda.bindings, NVRTC, torch pool API).
python3 - <<'PY'
import torch, sys
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
for name in ("_cuda_beginAllocateCurrentThreadToPool", "_cuda_beginAllocateToPool", "_cuda_endAllocateToPool"):
    print(name, hasattr(torch._C, name))
try:
    from cuda.bindings import __version__ as v, driver, nvrtc, runtime
    print("cuda.bindings", v, "driver", driver.cuDriverGetVersion(), "nvrtc", nvrtc.nvrtcVersion())
except Exception as e:
    print("cuda.bindings unavailable", e)
for mod in ("transformers", "triton", "sentencepiece", "av", "soxr", "yaml", "safetensors"):
    try:
        m = __import__(mod); print(mod, getattr(m, "__version__", "?"))
    except Exception as e:
        print(mod, "MISSING", e)
PY
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
