"""Long-form Whisper: VAD segmentation vs fixed 30 s windows vs the model's own long-form loop.

On ``long/long-en-voxpopuli-000.ogg`` (69 s, with reference), for each model (tiny.en,
base) and each segmentation:

* ``vad`` - ``split_for_asr(method="vad")``: pieces <= 30 s cut at the longest pauses,
  stretches without speech left out, pieces batched together (``run_job``);
* ``fixed`` - back-to-back 30 s windows (no overlap), batched the same way: words that
  straddle a window edge are cut;
* ``none`` - the whole file to ``model.transcribe_waveform`` (the model's sequential
  30 s seek loop, as openai-whisper does).

Reports WER (Whisper English normaliser) and speed factor (audio s / wall s; decode and
VAD included, model loading excluded, one untimed warm-up run per model).

Usage: ``python bench/bench_vad_vs_fixed.py [--models tiny.en,base] [--threads 2]``
writes ``bench/results/vad_vs_fixed_<host>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("FLASHASR_SHARED", REPO.parent / "shared"))
sys.path.insert(0, str(REPO / "bench"))

from bench_whisper_cpu import machine_info, versions  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny.en,base")
    ap.add_argument("--methods", default="vad,fixed,none")
    ap.add_argument("--clip", default="long-en-voxpopuli-000")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    from flashasr.eval import load_manifest, normalize, word_errors
    from flashasr.jobs import run_job
    from flashasr.pipeline import load_model

    clip = next(c for c in load_manifest(SHARED / "audio/manifest.jsonl") if c["id"] == args.clip)
    ref = normalize(clip["reference"], "en")
    load0 = os.getloadavg()
    rows = []
    for spec in [m.strip() for m in args.models.split(",") if m.strip()]:
        model = load_model(spec, device="cpu")
        run_job([clip["abs_path"]], model, None, "text", segmentation="vad", progress=False, language="en")  # warm-up
        for method in [m.strip() for m in args.methods.split(",") if m.strip()]:
            t0 = time.perf_counter()
            rep = run_job([clip["abs_path"]], model, None, "verbose_json", segmentation=method, language="en",
                          batch_size=args.batch_size, progress=False)
            wall = time.perf_counter() - t0
            r = rep.results[0]
            hyp = r.transcript.text if r.transcript is not None else ""
            we = word_errors(ref, normalize(hyp, "en"))
            rows.append({"model": spec, "segmentation": method, "pieces": r.n_pieces, "batches": rep.n_batches,
                         "audio_s": round(r.duration or 0, 2), "wall_s": round(wall, 2),
                         "speed_factor": round((r.duration or 0) / wall, 2), "wer": round(100 * we.wer, 2),
                         "substitutions": we.substitutions, "deletions": we.deletions,
                         "insertions": we.insertions, "reference_words": we.ref_words, "text": hyp})
            print(f"  {spec:8s} {method:6s} pieces {r.n_pieces:2d}  {wall:6.2f} s  "
                  f"{rows[-1]['speed_factor']:6.1f}x  WER {rows[-1]['wer']:5.2f} %", file=sys.stderr)
        del model
    out = {
        "benchmark": "vad_vs_fixed", "machine": machine_info(), "versions": versions(),
        "conditions": {"clip": clip["id"], "clip_duration_s": clip.get("duration_s"), "threads": args.threads,
                       "batch_size": args.batch_size, "max_segment_s": 30.0, "language": "en",
                       "timed": "decode + VAD + model (model load excluded; one warm-up run per model)",
                       "load_average_start": [round(x, 2) for x in load0],
                       "load_average_end": [round(x, 2) for x in os.getloadavg()],
                       "note": "shared 2-core VM: other processes may have run during the measurement"},
        "results": rows,
    }
    path = Path(args.out) if args.out else REPO / "bench/results" / f"vad_vs_fixed_{socket.gethostname()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    print("\n| model | segmentation | pieces | WER % | speed factor |\n|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['segmentation']} | {r['pieces']} | {r['wer']:.2f} | {r['speed_factor']:.1f}x |")
    print(f"\nwrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
