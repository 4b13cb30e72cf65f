"""CPU speed factor of flashasr's Whisper vs faster-whisper on the same tiny.en weights.

Speed factor (RTFx) = audio seconds / wall seconds. All systems get the same pre-decoded
16 kHz float32 samples (decoding is not timed), the same thread count (torch intra-op
threads = CTranslate2 ``cpu_threads`` = ``--threads``, default 2) and greedy decoding
(faster-whisper: beam_size=1, best_of=1, temperature 0 without fallback,
condition_on_previous_text False, no VAD filter). One untimed warm-up clip per system.
WER (Whisper English normaliser, corpus level) is reported alongside, as a check that
speed is not bought with accuracy.

Clips: the manifest's real English clips with a reference (categories en_read and
en_conversational; 25 clips, 185 s). Systems:

* ``flashasr`` - ``model.transcribe_waveform`` clip by clip (batch 1);
* ``flashasr-batch8`` - ``flashasr.jobs.run_job`` with cross-file batches of 8 (decode excluded:
  the job is fed ready arrays through ``decode_fn``);
* ``faster-whisper-int8`` / ``faster-whisper-float32`` - ``WhisperModel.transcribe`` clip by clip.

Usage: ``python bench/bench_whisper_cpu.py [--threads 2] [--model tiny.en] [--out PATH]``
writes ``bench/results/whisper_cpu_<host>.json`` and prints a table. The 2-core dev VM is
shared: the JSON records the load average at start and end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("FLASHASR_SHARED", REPO.parent / "shared"))


def machine_info() -> dict:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"host": socket.gethostname(), "platform": platform.platform(), "cpu": cpu,
            "cpu_count": os.cpu_count(), "python": platform.python_version()}


def versions() -> dict:
    v = {}
    try:
        import subprocess

        v["git_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                         cwd=Path(__file__).resolve().parent, timeout=10).stdout.strip() or None
    except Exception:
        pass
    for mod in ("flashasr", "torch", "numpy", "faster_whisper", "ctranslate2", "av", "soxr"):
        try:
            v[mod] = getattr(__import__(mod), "__version__", "?")
        except Exception:
            v[mod] = None
    return v


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="tiny.en")
    ap.add_argument("--systems", default="flashasr,flashasr-batch8,faster-whisper-int8,faster-whisper-float32")
    ap.add_argument("--limit", type=int, default=None, help="first N clips (smoke runs)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    from flashasr.audio import load_audio
    from flashasr.eval import FasterWhisperPeer, WordErrors, load_manifest, normalize, word_errors
    from flashasr.jobs import InputItem, run_job
    from flashasr.pipeline import load_model

    clips = [c for c in load_manifest(SHARED / "audio/manifest.jsonl")
             if c.get("category") in ("en_read", "en_conversational") and c.get("reference")]
    if args.limit:
        clips = clips[: args.limit]
    audio = {c["id"]: load_audio(c["abs_path"], target_rate=16000) for c in clips}
    audio_s = sum(a.duration for a in audio.values())
    load0 = os.getloadavg()
    print(f"{len(clips)} clips, {audio_s:.1f} s of audio, {args.threads} threads, load average {load0}",
          file=sys.stderr)

    results = {}
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    for system in systems:
        texts: dict[str, str] = {}
        if system.startswith("flashasr"):
            model = load_model(args.model, device="cpu")
            warm = audio[clips[0]["id"]].samples
            model.transcribe_waveform(warm)
            if system == "flashasr":
                t0 = time.perf_counter()
                for c in clips:
                    texts[c["id"]] = model.transcribe_waveform(audio[c["id"]].samples, language="en").text
                wall = time.perf_counter() - t0
            else:
                bs = int(system.split("batch")[1])
                items = [InputItem(path=Path(c["abs_path"]), key=c["id"], display=c["id"], language="en")
                         for c in clips]
                by_path = {c["abs_path"]: audio[c["id"]] for c in clips}

                def on_result(r):
                    texts[r.item.key] = r.transcript.text if r.transcript is not None else ""

                t0 = time.perf_counter()
                run_job(items, model, None, "text", batch_size=bs, segmentation="none", workers=1,
                        progress=False, on_result=on_result, decode_fn=lambda p, sr: by_path[p])
                wall = time.perf_counter() - t0
            model_name = getattr(model, "name", args.model)
            del model
        else:
            ctype = system.rsplit("-", 1)[1]
            peer = FasterWhisperPeer(args.model, compute_type=ctype, threads=args.threads)
            peer.transcribe(audio[clips[0]["id"]].samples, "en")
            t0 = time.perf_counter()
            for c in clips:
                texts[c["id"]] = peer.transcribe(audio[c["id"]].samples, "en")[0]
            wall = time.perf_counter() - t0
            model_name = f"{args.model} (CT2 {ctype})"
            del peer
        tot = WordErrors()
        for c in clips:
            tot = tot + word_errors(normalize(c["reference"], "en"), normalize(texts.get(c["id"], ""), "en"))
        results[system] = {"model": model_name, "wall_s": round(wall, 3), "speed_factor": round(audio_s / wall, 2),
                           "wer": round(100 * tot.wer, 2), "errors": tot.errors, "reference_words": tot.ref_words}
        print(f"  {system:24s} {wall:7.2f} s  {audio_s / wall:7.1f}x  WER {100 * tot.wer:5.2f} %", file=sys.stderr)

    out = {
        "benchmark": "whisper_cpu", "machine": machine_info(), "versions": versions(),
        "conditions": {
            "model": args.model, "threads": args.threads, "clips": len(clips),
            "audio_s": round(audio_s, 2), "categories": ["en_read", "en_conversational"],
            "decode_timed": False, "warmup": "1 untimed clip per system", "repeats": 1,
            "language": "en", "decoding": "greedy; faster-whisper beam_size=1 best_of=1 temperature=0 "
                                          "condition_on_previous_text=False vad_filter=False",
            "load_average_start": [round(x, 2) for x in load0],
            "load_average_end": [round(x, 2) for x in os.getloadavg()],
            "note": "shared 2-core VM: other processes may have run during the measurement",
        },
        "results": results,
    }
    path = Path(args.out) if args.out else REPO / "bench/results" / f"whisper_cpu_{socket.gethostname()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print("\n| system | wall s | speed factor | WER % |\n|---|---:|---:|---:|")
    for s, r in results.items():
        print(f"| {s} | {r['wall_s']:.2f} | {r['speed_factor']:.1f}x | {r['wer']:.2f} |")
    print(f"\nwrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
