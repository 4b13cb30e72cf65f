"""Kernel census of one encoder forward (0.6B-v3 shapes, random weights, bf16, the engine's fused
encoder with fast attention): how many CUDA kernels a batch-1 short input launches, grouped by
kernel name, and their GPU time. At batch 1 a CUDA-graph replay costs about the kernel count
times the per-kernel launch gap, so this is the census to shrink. Writes
bench/results/gpu_kernels.json. Device only.

Run (device): PYTHONPATH=src:bench python bench/bench_gpu_kernels.py [--batch 1 --seconds 0.24]
"""

from __future__ import annotations

import argparse
import collections
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from bench_gpu_common import TUNE, build_v3_model, env_record, write_result
from flashasr.engine.profiles import EncoderProfiles, Profile


def census(ep, B, S):
    audio = torch.randn(B, int(S * 16000), device="cuda") * 0.1
    lens = torch.full((B,), int(S * 16000), device="cuda")
    for _ in range(2):
        ep.forward_eager(audio, lens)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        ep.forward_eager(audio, lens)
        torch.cuda.synchronize()
    count, gpu_us = collections.Counter(), collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            name = e.name[:90]
            count[name] += 1
            gpu_us[name] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    total = sum(count.values())
    rows = [{"kernel": k, "count": c, "gpu_us": round(gpu_us[k], 1)} for k, c in count.most_common()]
    return {"batch": B, "seconds": S, "kernels": total, "gpu_us": round(sum(gpu_us.values()), 1), "by_kernel": rows}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1x0.24,1x30")
    ap.add_argument("--name", default="kernels")
    a = ap.parse_args(argv)
    model = build_v3_model("cuda")
    shapes = [(int(b), float(s)) for b, s in (x.split("x") for x in a.shapes.split(","))]
    ep = EncoderProfiles(model, [Profile(b, s) for b, s in shapes], dtype=torch.bfloat16, project=False, **TUNE)
    out = []
    for B, S in shapes:
        r = census(ep, B, S)
        out.append(r)
        print(f"B={B} {S}s: {r['kernels']} kernels, {r['gpu_us'] / 1e3:.2f} ms GPU time")
        for row in r["by_kernel"][:25]:
            print(f"  {row['count']:5d} {row['gpu_us']:9.1f} us  {row['kernel']}")
    write_result(a.name, {"benchmark": "encoder kernel census", "env": env_record(), "engine_settings": TUNE,
                          "fusions": ep.fusions, "shapes": out})


if __name__ == "__main__":
    sys.exit(main())
