"""Benchmark (c): end-to-end offline Parakeet-TDT (0.6B-v3 shapes, random weights), audio
already decoded in memory -> tokens. Real speech (.devdata/speech16k.npz, from
bench_gpu_prepare_audio.py) repeated to >= --hours of audio. The random joint is calibrated
(blank bias bisection) to ~3.5 tokens per second on this speech. Reports the speed factor
(audio seconds / wall seconds), per-stage split, batches, peak GPU memory.
Writes bench/results/gpu_e2e.json.

Run (device): PYTHONPATH=src:bench python bench/bench_gpu_e2e.py
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import torch

from bench_gpu_common import build_v3_model, calibrate_joint, env_record, load_speech, write_result
from flashasr.engine.offline import OfflineParakeetEngine


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--hours", type=float, default=2.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--decoder-dtypes", default="float32,bfloat16")
    ap.add_argument("--seconds-per-batch", type=float, default=1920.0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--max-inputs", type=int, default=0, help="smoke tests: use only this many pieces")
    a = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = True
    speech = load_speech()
    if a.max_inputs:
        speech = speech[: a.max_inputs]
    cuda = a.device == "cuda"
    distinct = sum(map(len, speech)) / 16000
    reps = math.ceil(a.hours * 3600 / distinct)
    waves = speech * reps
    audio_s = sum(map(len, waves)) / 16000
    print(f"{len(speech)} distinct pieces, {distinct / 60:.1f} min, x{reps} -> {len(waves)} inputs, {audio_s / 3600:.2f} h",
          flush=True)
    results = []
    for ddt in a.decoder_dtypes.split(","):
        dd = getattr(torch, ddt)
        if cuda:
            torch.cuda.empty_cache()
        model = build_v3_model(a.device)
        from flashasr.engine.profiles import choose_profiles

        eng = OfflineParakeetEngine(model, profiles=choose_profiles(seconds_per_batch=a.seconds_per_batch),
                                    decoder_dtype=dd, with_text=False)
        # calibrate the random joint on the projected encoder output of 64 real pieces
        cal = speech[:64]
        audio, alen = eng.uploader.upload(cal)
        f, flen = eng.encoder.forward_eager(audio, alen)
        bias, tps = calibrate_joint(model, f.to(dd), flen)
        del f
        t0 = time.perf_counter()
        eng.warmup([len(w) for w in waves])
        warm_s = time.perf_counter() - t0
        eng.transcribe_arrays(waves[: len(speech)])  # first-use effects outside the timing
        runs = []
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        for _ in range(a.runs):
            out = eng.transcribe_arrays(waves)
            runs.append(out)
            print(f"decoder {ddt}: RTFx {out.speed_factor:9.0f}  total {out.timings['total']:.3f} s  "
                  + "  ".join(f"{k} {v:.3f}" for k, v in out.timings.items() if k != "total"), flush=True)
        best = min(runs, key=lambda o: o.timings["total"])
        med = statistics.median(o.timings["total"] for o in runs)
        ntok = sum(len(it.token_ids) for it in best.items)
        durs = [d for it in best.items for d in it.token_durations]
        results.append({
            "decoder_dtype": ddt, "speed_factor_best": best.speed_factor, "speed_factor_median": audio_s / med,
            "wall_s_best": best.timings["total"], "timings_best_s": best.timings,
            "stage_share": {k: v / best.timings["total"] for k, v in best.timings.items() if k != "total"},
            "batches": len(best.batches), "batch_shapes": sorted({(b, s) for b, s, _ in best.batches}, key=str),
            "decoder_modes": best.decoder_modes,
            "peak_gpu_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "peak_gpu_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else None,
            "warmup_capture_s": warm_s, "calibrated_blank_bias": bias,
            "tokens_per_audio_s": ntok / audio_s, "calibration_tokens_per_s": tps,
            "mean_token_duration_frames": sum(durs) / max(1, len(durs)),
            "profile_memory": eng.encoder.memory_report(),
        })
        del eng, model, runs, out, best
    print("\n decoder  RTFx(best)  RTFx(median)  wall s   host_prep  upload  encoder  decoder  peak GiB  tok/s")
    for r in results:
        t = r["timings_best_s"]
        print(f" {r['decoder_dtype']:8s} {r['speed_factor_best']:10.0f} {r['speed_factor_median']:12.0f} "
              f"{r['wall_s_best']:7.3f} {t['host_prep']:10.3f} {t['upload']:7.3f} {t['encoder']:8.3f} {t['decoder']:8.3f}"
              f" {r['peak_gpu_memory_gib'] or 0:8.1f} {r['tokens_per_audio_s']:6.2f}")
    write_result("e2e" if cuda else "e2e_cpu_smoke", {"benchmark": "end-to-end offline Parakeet-TDT, audio in memory -> tokens", "env": env_record(),
                         "conditions": {"model": "parakeet-tdt-0.6b-v3 shapes, random weights (joint calibrated)",
                                        "audio_hours": audio_s / 3600, "distinct_speech_min": distinct / 60,
                                        "repeats": reps, "inputs": len(waves), "encoder": "bf16 weights, fp32 norms",
                                        "tf32": True, "runs": a.runs, "seconds_per_batch": a.seconds_per_batch,
                                        "excluded": "audio decoding/resampling (done before), text detokenisation"},
                         "results": results})


if __name__ == "__main__":
    sys.exit(main())
