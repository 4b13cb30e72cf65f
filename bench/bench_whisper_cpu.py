"""CPU speed factor of flashasr's Whisper vs faster-whisper on the same tiny.en weights.

Speed factor (RTFx) = audio seconds / wall seconds. All systems get the same pre-decoded
16 kHz float32 samples (decoding is not timed), the same thread count (torch intra-op threads =
CTranslate2 ``cpu_threads`` = ``--threads``, default 2) and greedy decoding (faster-whisper:
beam_size=1, best_of=1, temperature 0 without fallback, condition_on_previous_text False, no
VAD filter). One untimed warm-up clip per model. WER (Whisper English normaliser, corpus level)
is reported alongside, as a check that speed is not bought with accuracy.

Sets (``--set``):

* ``short`` - the manifest's real English clips with a reference (categories en_read and
  en_conversational; 25 clips, 185 s);
* ``long`` - the manifest's long English recordings (``long/long-en-*``; 129 s), where the
  pipeline cuts several pieces per file (WER over the ones with a reference).

Systems (``--systems``, comma separated; ``+words`` after a name adds word timestamps):

* ``flashasr-clip`` - ``model.transcribe_waveform`` clip by clip (no pipeline; Whisper's own
  30 s seek);
* ``flashasr-bN`` - ``flashasr.jobs.run_job``, the ``flashasr transcribe`` path (VAD pieces,
  cross-file batches of N, decode excluded: ready arrays through ``decode_fn``);
* ``faster-whisper-int8`` / ``faster-whisper-float32`` - ``WhisperModel.transcribe`` clip by clip.

Every system runs ``--repeats`` times (default 3), interleaved (system order rotated each pass)
so that load on the shared machine spreads over all of them; the table gives the median and the
best wall time. Usage: ``python bench/bench_whisper_cpu.py [--set short|long] [--repeats 3]
[--threads 2] [--model tiny.en] [--out PATH]`` writes ``bench/results/whisper_cpu_<set>_<host>.json``.
The JSON records the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
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
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "src"], capture_output=True,
                                 text=True, cwd=REPO, timeout=10).stdout.split("\n")
        v["git_src_changed"] = [ln[3:] for ln in changed if ln.strip()]  # uncommitted changes under src/ at run time
    except Exception:
        pass
    for mod in ("flashasr", "torch", "numpy", "faster_whisper", "ctranslate2", "av", "soxr"):
        try:
            v[mod] = getattr(__import__(mod), "__version__", "?")
        except Exception:
            v[mod] = None
    return v


DEFAULT_SYSTEMS = ("flashasr-clip,flashasr-b1,flashasr-b4,flashasr-b8,flashasr-b16,faster-whisper-int8,"
                   "faster-whisper-float32,flashasr-b1+words,flashasr-b8+words,faster-whisper-int8+words")


def select_clips(manifest: list[dict], which: str) -> list[dict]:
    """The clips of set ``which`` (``short`` or ``long``), in manifest order."""
    if which == "short":
        return [c for c in manifest if c.get("category") in ("en_read", "en_conversational") and c.get("reference")]
    return [c for c in manifest if str(c.get("path", "")).startswith("long/long-en-")]


class Systems:
    """Runs one named system over the clips; models are loaded once and kept."""

    def __init__(self, model_spec: str, threads: int, clips: list[dict], audio: dict):
        self.model_spec, self.threads, self.clips, self.audio = model_spec, threads, clips, audio
        self._flash = None
        self._peers: dict = {}

    def flash(self):
        if self._flash is None:
            from flashasr.pipeline import load_model

            self._flash = load_model(self.model_spec, device="cpu")
            self._flash.transcribe_waveform(self.audio[self.clips[0]["id"]].samples)  # warm-up
        return self._flash

    def peer(self, ctype: str):
        if ctype not in self._peers:
            from flashasr.eval import FasterWhisperPeer

            p = FasterWhisperPeer(self.model_spec, compute_type=ctype, threads=self.threads)
            p.model.transcribe(self.audio[self.clips[0]["id"]].samples, language="en", beam_size=1)  # warm-up
            self._peers[ctype] = p
        return self._peers[ctype]

    def run(self, system: str) -> tuple[float, dict[str, str]]:
        """(wall seconds, {clip id: text}) of one pass of ``system``."""
        name, words = system.split("+")[0], system.endswith("+words")
        if name == "flashasr-clip":
            m = self.flash()
            t0 = time.perf_counter()
            texts = {c["id"]: m.transcribe_waveform(self.audio[c["id"]].samples, language="en",
                                                    word_timestamps=words).text for c in self.clips}
            return time.perf_counter() - t0, texts
        if name.startswith("flashasr-b"):
            return self._job(int(name[len("flashasr-b"):]), words)
        if name.startswith("faster-whisper-"):
            model = self.peer(name.rsplit("-", 1)[1]).model
            t0 = time.perf_counter()
            texts = {}
            for c in self.clips:
                segs, _ = model.transcribe(self.audio[c["id"]].samples, language="en", beam_size=1, best_of=1,
                                           temperature=0.0, condition_on_previous_text=False, vad_filter=False,
                                           word_timestamps=words)
                texts[c["id"]] = "".join(s.text for s in segs).strip()
            return time.perf_counter() - t0, texts
        raise SystemExit(f"unknown system {system!r}")

    def _job(self, batch: int, words: bool) -> tuple[float, dict[str, str]]:
        from flashasr.jobs import InputItem, run_job

        m = self.flash()
        items = [InputItem(path=Path(c["abs_path"]), key=c["id"], display=c["id"], language="en")
                 for c in self.clips]
        by_path = {c["abs_path"]: self.audio[c["id"]] for c in self.clips}
        texts: dict[str, str] = {}

        def on_result(r):
            texts[r.item.key] = r.transcript.text if r.transcript is not None else ""

        t0 = time.perf_counter()
        run_job(items, m, None, "text", batch_size=batch, workers=1, progress=False, on_result=on_result,
                word_timestamps=words, decode_fn=lambda p, sr: by_path[p])
        return time.perf_counter() - t0, texts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--set", choices=("short", "long"), default="short")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="tiny.en")
    ap.add_argument("--systems", default=DEFAULT_SYSTEMS)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--limit", type=int, default=None, help="first N clips (smoke runs)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    from flashasr.audio import load_audio
    from flashasr.eval import WordErrors, load_manifest, normalize, word_errors

    clips = select_clips(load_manifest(SHARED / "audio/manifest.jsonl"), args.set)[: args.limit]
    audio = {c["id"]: load_audio(c["abs_path"], target_rate=16000) for c in clips}
    audio_s = sum(a.duration for a in audio.values())
    load0 = os.getloadavg()
    print(f"{args.set}: {len(clips)} clips, {audio_s:.1f} s of audio, {args.threads} threads, load average {load0}",
          file=sys.stderr)

    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    runner = Systems(args.model, args.threads, clips, audio)
    walls: dict[str, list[float]] = {s: [] for s in systems}
    texts: dict[str, dict[str, str]] = {}
    for rep in range(args.repeats):
        order = systems[rep % len(systems):] + systems[: rep % len(systems)]
        for system in order:
            wall, got = runner.run(system)
            walls[system].append(wall)
            texts.setdefault(system, got)
            print(f"  pass {rep + 1}: {system:28s} {wall:7.2f} s  {audio_s / wall:6.1f}x", file=sys.stderr)

    results = {}
    for system in systems:
        tot = WordErrors()
        for c in clips:
            if c.get("reference"):
                tot = tot + word_errors(normalize(c["reference"], "en"), normalize(texts[system].get(c["id"], ""), "en"))
        med = statistics.median(walls[system])
        results[system] = {"wall_s_median": round(med, 3), "wall_s_best": round(min(walls[system]), 3),
                           "wall_s_all": [round(w, 3) for w in walls[system]],
                           "speed_factor_median": round(audio_s / med, 2),
                           "wer": round(100 * tot.wer, 2) if tot.ref_words else None,
                           "same_text_as_first": texts[system] == texts[systems[0]]}

    out = {
        "benchmark": "whisper_cpu", "machine": machine_info(), "versions": versions(),
        "conditions": {
            "set": args.set, "model": args.model, "threads": args.threads, "clips": len(clips),
            "audio_s": round(audio_s, 2), "decode_timed": False, "warmup": "1 untimed clip per model",
            "repeats": args.repeats, "order": "rotated each pass", "language": "en",
            "decoding": "greedy; faster-whisper beam_size=1 best_of=1 temperature=0 "
                        "condition_on_previous_text=False vad_filter=False",
            "load_average_start": [round(x, 2) for x in load0],
            "load_average_end": [round(x, 2) for x in os.getloadavg()],
            "note": "shared 2-core VM: other processes may have run during the measurement",
        },
        "results": results,
    }
    path = Path(args.out) if args.out else REPO / "bench/results" / f"whisper_cpu_{args.set}_{socket.gethostname()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"\n| system | median wall s | best wall s | speed factor (median) | WER % | text = {systems[0]} |")
    print("|---|---:|---:|---:|---:|---|")
    for s, r in results.items():
        wer = "-" if r["wer"] is None else f"{r['wer']:.2f}"
        print(f"| {s} | {r['wall_s_median']:.2f} | {r['wall_s_best']:.2f} | {r['speed_factor_median']:.1f}x | {wer} | "
              f"{'yes' if r['same_text_as_first'] else 'no'} |")
    print(f"\nwrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
