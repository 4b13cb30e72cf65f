"""Benchmark (b): encoder (log-mel + FastConformer, 0.6B-v3 shapes, random weights, bf16 with
fp32 norms) on its own shape profile (CUDA graph) vs eager at the exact shape vs padded to one
30 s profile (CUDA graph), for 0.2 / 1 / 5 / 20 s inputs at batch 1 and a large batch.
Writes bench/results/gpu_encoder.json. Optional: --compile adds torch.compile'd profile graphs.

Run (device): PYTHONPATH=src:bench python bench/bench_gpu_encoder.py
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from bench_gpu_common import TUNE,  build_v3_model, cuda_time, env_record, write_result
from flashasr.engine.profiles import EncoderProfiles, Profile, _round_frames


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", default="0.2,1,5,20")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--name", default="encoder")
    a = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = True
    model = build_v3_model("cuda")
    n_params = sum(p.numel() for p in model.encoder.parameters())
    secs = [float(x) for x in a.seconds.split(",")]
    batches = [int(x) for x in a.batches.split(",")]
    profs = []
    for B in batches:
        for s in secs:
            profs.append(Profile(B, _round_frames(s)))
        profs.append(Profile(B, 30.0))
    ep = EncoderProfiles(model, sorted(set(profs), key=lambda p: (p.seconds, p.batch)), dtype=torch.bfloat16,
                         project=False, compile=a.compile, **TUNE)
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for B in batches:
        for s in secs:
            N = int(s * 16000)
            audio = torch.randn(B, N, device="cuda", generator=g) * 0.1
            lens = torch.full((B,), N, device="cuda")
            own = Profile(B, _round_frames(s))
            res = {}
            t0 = time.perf_counter()
            ep.run(audio, lens, own)
            torch.cuda.synchronize()
            cap = time.perf_counter() - t0
            res["own_profile_graph"] = cuda_time(lambda: ep.run(audio, lens, own), reps=a.reps)
            res["eager_exact_shape"] = cuda_time(lambda: ep.forward_eager(audio, lens), reps=a.reps)
            p30 = Profile(B, 30.0)
            ep.run(audio, lens, p30)
            res["padded_30s_graph"] = cuda_time(lambda: ep.run(audio, lens, p30), reps=a.reps)
            audio_s = B * s
            row = {"batch": B, "seconds": s, "own_profile": [own.batch, own.seconds], "first_run_capture_s": cap}
            for k, v in res.items():
                row[k + "_ms"] = 1e3 * v["median_s"]
                row[k + "_rtfx"] = audio_s / v["median_s"]
            row["own_vs_padded30_speedup"] = res["padded_30s_graph"]["median_s"] / res["own_profile_graph"]["median_s"]
            row["graph_vs_eager_speedup"] = res["eager_exact_shape"]["median_s"] / res["own_profile_graph"]["median_s"]
            rows.append(row)
            print(f"B={B:3d} {s:5.1f}s  own {row['own_profile_graph_ms']:8.2f} ms  eager {row['eager_exact_shape_ms']:8.2f} ms"
                  f"  pad30 {row['padded_30s_graph_ms']:8.2f} ms  own/pad30 x{row['own_vs_padded30_speedup']:.1f}"
                  f"  RTFx(own) {row['own_profile_graph_rtfx']:9.0f}", flush=True)
    mem = ep.memory_report()
    print("\n batch  sec   own-graph ms   eager ms   padded-30s ms   own vs pad30   graph vs eager   RTFx own")
    for r in rows:
        print(f" {r['batch']:5d} {r['seconds']:5.1f} {r['own_profile_graph_ms']:12.2f} {r['eager_exact_shape_ms']:10.2f}"
              f" {r['padded_30s_graph_ms']:14.2f} {r['own_vs_padded30_speedup']:12.1f}x {r['graph_vs_eager_speedup']:14.2f}x"
              f" {r['own_profile_graph_rtfx']:10.0f}")
    print("profile memory (MiB, shared pool: extra reserved at capture):",
          [(m["batch"], m["seconds"], m["memory_mib"]) for m in mem if m["captured"]])
    write_result(a.name, {"benchmark": "encoder profiles vs eager vs padded-to-30s", "env": env_record(),
                          "conditions": {"model": "parakeet-tdt-0.6b-v3 shapes, random weights",
                                         "encoder_params": n_params, "dtype": "bf16 weights, fp32 norms and log-mel",
                                         "tf32": True, "compile": a.compile, "engine_settings": TUNE, "input": "random noise, full-length rows",
                                         "timing": "median wall time of 10 runs, synchronised"},
                          "rows": rows, "profile_memory": mem,
                          "max_memory_allocated_gib": torch.cuda.max_memory_allocated() / 2**30})


if __name__ == "__main__":
    sys.exit(main())
