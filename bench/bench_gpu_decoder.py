"""Benchmark (a): batched greedy TDT decoding alone, full_graph vs graphs_no_while vs torch.

0.6B-v3-shaped predictor (LSTM 2 x 640, vocab 8192) and joint (1024/640 -> 8198) with random
weights; the blank bias is first bisected on the GPU so decoding emits ~3.5 tokens per second of
audio (target in --tokens-per-s); realised tokens/s and duration mix are reported. Encoder frames
are unit-variance random (already projected by the joint, so only the decode loop is timed,
result copy to host included). Writes bench/results/gpu_decoder.json.

Run (device): PYTHONPATH=src:bench python bench/bench_gpu_decoder.py
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench_gpu_common import V3, cuda_time, decode_stats, env_record, make_v3_decoder, write_result
from flashasr.engine.tdt_graphs import TDTGraphDecoder

DT = {"bf16": torch.bfloat16, "fp32": torch.float32}


def make_inputs(B, min_s, max_s, seed, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    lo, hi = int(min_s / 0.08), int(max_s / 0.08)
    lengths = torch.randint(lo, hi + 1, (B,), generator=g)
    T = int(lengths.max())
    enc = torch.randn(B, T, V3["enc_hidden"], generator=g)
    return enc.to(device), lengths.to(device)


def calibrate(dtype, target, seed=0):
    enc, lengths = make_inputs(32, 8, 16, 1234)
    lo, hi = 2.0, 6.0
    for _ in range(9):
        mid = (lo + hi) / 2
        pred, joint = make_v3_decoder("cuda", dtype, seed, blank_bias=mid)
        with torch.no_grad():
            f = joint.project_encoder(enc.to(dtype))
        res = TDTGraphDecoder(pred, joint, mode="graphs_no_while").decode(f, lengths, projected=True)
        tps = decode_stats(res, int(lengths.sum()))["tokens_per_audio_s"]
        if tps > target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,16,128")
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--min-s", type=float, default=5.0)
    ap.add_argument("--max-s", type=float, default=20.0)
    ap.add_argument("--tokens-per-s", type=float, default=3.5)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--modes", default="full_graph,graphs_no_while,torch",
                    help="modes to time; MODE/unfused runs MODE with the PyTorch joint step instead of the "
                         "fused one (engine/tdt_fused.py)")
    ap.add_argument("--name", default="decoder", help="results file bench/results/gpu_NAME.json")
    a = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    modes = a.modes.split(",")
    rows = []
    calib = {}
    for dname in a.dtypes.split(","):
        dtype = DT[dname]
        bias = calibrate(dtype, a.tokens_per_s)
        calib[dname] = bias
        pred, joint = make_v3_decoder("cuda", dtype, 0, blank_bias=bias)
        for B in [int(x) for x in a.batches.split(",")]:
            enc, lengths = make_inputs(B, a.min_s, a.max_s, 99 + B)
            with torch.no_grad():
                f = joint.project_encoder(enc.to(dtype))
            audio_s = float(lengths.sum()) * 0.08
            ref = None
            base = None
            for variant in modes:
                m, _, tag = variant.partition("/")
                dec = TDTGraphDecoder(pred, joint, mode=m, fused=tag != "unfused")
                box = {}

                def run():
                    box["r"] = dec.decode(f, lengths, projected=True)

                t = cuda_time(run, warmup=2, reps=a.reps if m != "torch" or B < 128 else max(3, a.reps // 2))
                r = box["r"]
                same = None
                if ref is None:
                    ref = r
                else:
                    same = (r.token_ids == ref.token_ids and r.token_frames == ref.token_frames
                            and r.token_durations == ref.token_durations)
                row = {"dtype": dname, "batch": B, "mode_requested": m, "mode_used": r.mode,
                       "joint_step": "pytorch" if tag == "unfused" else "fused",
                       "fallbacks": r.fallbacks, "median_ms": 1e3 * t["median_s"], "min_ms": 1e3 * t["min_s"],
                       "audio_s": audio_s, "decoder_rtfx": audio_s / t["median_s"],
                       "identical_to_first_mode": same, **decode_stats(r, int(lengths.sum()))}
                rows.append(row)
                if m == "torch" and tag == "unfused":
                    base = row
                print(f"{dname} B={B:4d} {variant:24s} used={r.mode:16s} {row['median_ms']:9.2f} ms  "
                      f"RTFx {row['decoder_rtfx']:10.0f}  tok/s {row['tokens_per_audio_s']:.2f} "
                      f"same={same}", flush=True)
            if base:
                for row in rows:
                    if row["dtype"] == dname and row["batch"] == B:
                        row["speedup_vs_torch"] = base["median_ms"] / row["median_ms"]
    print("\n dtype  batch  mode             joint     ms/batch   x torch   RTFx     tok/s  meanDur")
    for r in rows:
        print(f" {r['dtype']:5s} {r['batch']:5d}  {r['mode_used']:16s} {r['joint_step']:8s} {r['median_ms']:9.2f} "
              f"{r.get('speedup_vs_torch', float('nan')):7.2f}x {r['decoder_rtfx']:9.0f} "
              f"{r['tokens_per_audio_s']:6.2f} {r['mean_token_duration_frames']:6.2f}")
    write_result(a.name, {"benchmark": "TDT greedy decoder alone (label looping)", "env": env_record(),
                             "conditions": {"shapes": V3, "random_weights": True, "blank_bias_calibrated": calib,
                                            "utterance_seconds": [a.min_s, a.max_s], "frame_s": 0.08,
                                            "tf32": False, "x_torch": "against torch/unfused (the eager PyTorch steps) when timed",
                                            "timing": "median wall time per decode incl. "
                                            "result copy to host; encoder projection excluded"},
                             "rows": rows})


if __name__ == "__main__":
    sys.exit(main())
