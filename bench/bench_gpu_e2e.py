"""Benchmark (c): end-to-end offline Parakeet-TDT (0.6B-v3 shapes, random weights), audio
already decoded in memory -> tokens. Real speech (.devdata/speech16k.npz, from
bench_gpu_prepare_audio.py) repeated to >= --hours of audio. The random joint is calibrated
(blank bias bisection) to ~3.5 tokens per second on this speech. Reports the speed factor
(audio seconds / wall seconds), per-stage split, batches, peak GPU memory, per variant:

* ``sequential``: stages one after the other (gives the per-stage split of the wall time)
* ``pipelined``: decoder of batch k on a side stream overlapping the encoder of batch k+1
* ``pipelined_fit``: as above, profiles chosen from this workload's length distribution
  (10 quantile boundaries) instead of the default real-speech boundaries
* ``pipelined_fit_compiled``: as above with torch.compile (dynamic shapes) before capture

Writes bench/results/gpu_<name>.json. Run (device): PYTHONPATH=src:bench python bench/bench_gpu_e2e.py
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import time

import torch

from bench_gpu_common import TUNE,  build_v3_model, calibrate_joint, env_record, load_speech, write_result
from flashasr.engine.offline import OfflineParakeetEngine
from flashasr.engine.profiles import choose_profiles

VARIANTS = {
    "sequential": dict(pipelined=False, fit=False, compile=False),
    "pipelined": dict(pipelined=True, fit=False, compile=False),
    "pipelined_fit": dict(pipelined=True, fit=True, compile=False),
    "pipelined_prio": dict(pipelined=True, fit=False, compile=False, decoder_priority=-1),
    "pipelined_fit_compiled": dict(pipelined=True, fit=True, compile="dynamic"),
}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--hours", type=float, default=2.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--variants", default="sequential,pipelined,pipelined_fit")
    ap.add_argument("--decoder-dtype", default="float32")
    ap.add_argument("--seconds-per-batch", type=float, default=1920.0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--name", default="e2e")
    ap.add_argument("--max-inputs", type=int, default=0, help="smoke tests: use only this many pieces")
    a = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = True
    cuda = a.device == "cuda"
    speech = load_speech()
    if a.max_inputs:
        speech = speech[: a.max_inputs]
    distinct = sum(map(len, speech)) / 16000
    reps = math.ceil(a.hours * 3600 / distinct)
    waves = speech * reps
    lens = [len(w) for w in waves]
    audio_s = sum(lens) / 16000
    print(f"{len(speech)} distinct pieces, {distinct / 60:.1f} min, x{reps} -> {len(waves)} inputs, "
          f"{audio_s / 3600:.2f} h", flush=True)
    dd = getattr(torch, a.decoder_dtype)
    model = build_v3_model(a.device)
    results, calib = [], None
    for name in a.variants.split(","):
        v = VARIANTS[name]
        profiles = (choose_profiles([n / 16000 for n in lens], n_profiles=10, seconds_per_batch=a.seconds_per_batch)
                    if v["fit"] else choose_profiles(seconds_per_batch=a.seconds_per_batch))
        t0 = time.perf_counter()
        eng = OfflineParakeetEngine(model, profiles=profiles, decoder_dtype=dd, with_text=False,
                                    compile=v["compile"], decoder_priority=v.get("decoder_priority", 0), **TUNE)
        if calib is None:  # calibrate the random joint once, on 64 real pieces
            audio, alen = eng.uploader.upload(speech[:64])
            f, flen = eng.encoder.forward_eager(audio, alen)
            calib = calibrate_joint(model, f.to(dd), flen)
            del f
        eng.warmup(lens)
        warm_s = time.perf_counter() - t0
        eng.transcribe_arrays(waves[: len(speech)], pipelined=v["pipelined"])  # first-use effects
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        runs = []
        for _ in range(a.runs):
            out = eng.transcribe_arrays(waves, pipelined=v["pipelined"])
            runs.append(out)
            print(f"{name:24s} RTFx {out.speed_factor:8.0f}  total {out.timings['total']:.3f} s  "
                  + "  ".join(f"{k} {x:.3f}" for k, x in out.timings.items() if k != "total"), flush=True)
        best = min(runs, key=lambda o: o.timings["total"])
        med = statistics.median(o.timings["total"] for o in runs)
        ntok = sum(len(it.token_ids) for it in best.items)
        durs = [d for it in best.items for d in it.token_durations]
        results.append({
            "variant": name, **v, "decoder_dtype": a.decoder_dtype,
            "speed_factor_best": best.speed_factor, "speed_factor_median": audio_s / med,
            "wall_s_best": best.timings["total"], "timings_best_s": best.timings,
            "batches": len(best.batches), "batch_shapes": sorted({(b, s) for b, s, _ in best.batches}, key=str),
            "profiles": [(p.batch, p.seconds) for p in profiles],
            "decoder_modes": best.decoder_modes,
            "peak_gpu_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "peak_gpu_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else None,
            "warmup_capture_s": warm_s, "tokens_per_audio_s": ntok / audio_s,
            "mean_token_duration_frames": sum(durs) / max(1, len(durs)),
            "token_ids_hash": hash(tuple(tuple(it.token_ids) for it in best.items)),
            "profile_memory": [m for m in eng.encoder.memory_report() if m["captured"]],
        })
        del eng, runs, out, best
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    print("\n variant                   RTFx(best)  RTFx(med)  wall s  peak GiB  tok/s  timings")
    for r in results:
        print(f" {r['variant']:24s} {r['speed_factor_best']:10.0f} {r['speed_factor_median']:10.0f} {r['wall_s_best']:7.3f}"
              f" {r['peak_gpu_memory_gib'] or 0:8.1f} {r['tokens_per_audio_s']:6.2f}  "
              + " ".join(f"{k}={x:.3f}" for k, x in r["timings_best_s"].items()))
    write_result(a.name if cuda else a.name + "_cpu_smoke", {
        "benchmark": "end-to-end offline Parakeet-TDT, audio in memory -> tokens", "env": env_record(),
        "conditions": {"model": "parakeet-tdt-0.6b-v3 shapes, random weights (joint calibrated)",
                       "audio_hours": audio_s / 3600, "distinct_speech_min": distinct / 60, "repeats": reps,
                       "inputs": len(waves), "encoder": "bf16 weights, fp32 norms and log-mel", "engine_settings": TUNE,
                       "decoder_dtype": a.decoder_dtype, "tf32": True, "runs": a.runs,
                       "seconds_per_batch": a.seconds_per_batch,
                       "calibrated_blank_bias": calib[0] if calib else None,
                       "calibration_tokens_per_s": calib[1] if calib else None,
                       "excluded": "audio decoding/resampling (done before), text detokenisation"},
        "results": results})


if __name__ == "__main__":
    sys.exit(main())
