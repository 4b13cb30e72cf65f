"""End to end offline benchmark: compressed files on disk -> transcripts on disk, through the job runner.

What it measures (``run``), with a Parakeet-shaped model (``random:parakeet-tdt-0.6b-v3`` on
CUDA becomes :class:`~flashasr.engine.parakeet_gpu.ParakeetGPUASR`, the GPU engine behind
``transcribe_batch``):

* **(a) from disk** -- :func:`flashasr.jobs.run_job` over >= ``--hours`` of input files (each
  corpus file listed many times under ``repNNN/`` folders of symlinks, so every copy is opened
  and decoded again and outputs do not collide), default workers, JSON outputs to a temporary
  folder: wall time, speed factor (audio s / wall s), CPU seconds per audio hour of each stage
  the runner records (decode = container decode + downmix + resample, VAD, model + the rest),
  the model-stage ("GPU busy") fraction, NVML GPU utilisation, which stage bounds throughput.
* **(b) in memory** -- the same audio decoded and VAD-cut beforehand: (b1) the same
  ``run_job`` fed pre-decoded arrays (no CPU audio stages; outputs still written), (b2) the
  model's ``transcribe_batch`` on the same pieces in batches of the same size (length-sorted),
  (b3) the model's own packing: all pieces of one corpus copy per call, token counts
  (tokens per audio second realised vs the random joint's calibration).
* single-thread CPU cost per format of container decode alone, resampling and VAD on the
  distinct corpus files.

Each part is time-boxed (``--max-wall-s`` overall, split between the parts; a part that runs
out of time is interrupted and reported as partial), progress is printed with flush, and the
JSON is rewritten after every part (``bench/results/offline_e2e_<gpu|cpu>.json`` and, when
``$OUT`` is set, ``$OUT/offline_e2e_<...>.json``), so a killed run still leaves its results.

Subcommands::

    python bench/bench_offline_e2e.py prepare --out .devjobs/corpus --seconds 1050
    python bench/bench_offline_e2e.py shared --out .devjobs/shared        # calibration clips + yamls
    python bench/bench_offline_e2e.py run --corpus .devjobs/corpus --hours 4 \\
        --model random:parakeet-tdt-0.6b-v3 --device cuda --max-wall-s 250
    python bench/bench_offline_e2e.py run --smoke                          # CPU, tiny NeMo fixture, < 60 s

``prepare`` re-encodes real speech from ``../shared/audio`` (distinct recordings with speech,
several languages) with PyAV into a mix of formats and rates (mp3, ogg/opus, m4a/aac, flac,
wav; 8 / 16 / 44.1 / 48 kHz), about ``--seconds`` of audio in at most ``--max-mb`` MB.
"""

from __future__ import annotations

import _thread
import argparse
import concurrent.futures as cf
import json
import math
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import wave
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
# the checkout's src, unless a flashasr is on PYTHONPATH (another tree, for an A/B: it then wins)
if not any((Path(d) / "flashasr" / "__init__.py").is_file()
           for d in os.environ.get("PYTHONPATH", "").split(os.pathsep) if d):
    sys.path.insert(0, str(REPO / "src"))

from flashasr.models.base import ASRModel  # noqa: E402 - after the src path (NullModel's base)

SHARED = Path(os.environ.get("FLASHASR_SHARED", REPO.parent / "shared"))
AUDIO = SHARED / "audio"
TINY_NEMO = SHARED / "fixtures" / "parakeet" / "tiny-tdt" / "model.nemo"
T0 = time.perf_counter()

# name: (muxer, encoder, extension, rate Hz, bit rate b/s or None for lossless)
FORMATS = {
    "mp3-16k": ("mp3", "libmp3lame", "mp3", 16000, 24000),
    "opus-48k": ("ogg", "libopus", "opus", 48000, 20000),
    "aac-44k": ("ipod", "aac", "m4a", 44100, 32000),
    "mp3-44k": ("mp3", "libmp3lame", "mp3", 44100, 32000),
    "opus-16k": ("ogg", "libopus", "ogg", 16000, 16000),
    "flac-16k": ("flac", "flac", "flac", 16000, None),
    "mp3-8k": ("mp3", "libmp3lame", "mp3", 8000, 16000),
    "aac-16k": ("ipod", "aac", "m4a", 16000, 24000),
    "wav-8k": ("wav", "pcm_s16le", "wav", 8000, None),
    "opus-8k": ("ogg", "libopus", "opus", 8000, 12000),
    "mp3-48k": ("mp3", "libmp3lame", "mp3", 48000, 32000),
    "flac-44k": ("flac", "flac", "flac", 44100, None),
    "wav-16k": ("wav", "pcm_s16le", "wav", 16000, None),
}
# lossless formats: longest clip (s) and total seconds allowed, to keep the corpus small
LOSSLESS_LIMITS = {"flac-16k": (15.0, 90.0), "flac-44k": (6.0, 20.0), "wav-8k": (15.0, 45.0), "wav-16k": (8.0, 25.0)}
AUDIO_EXT = (".mp3", ".opus", ".ogg", ".m4a", ".flac", ".wav")


def log(msg: str) -> None:
    """Progress line on stdout with the seconds since start, flushed (the run is unattended)."""
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


# ----------------------------------------------------------------------------- prepare


def speech_clips() -> list[dict]:
    """Manifest clips with speech (a language, a non-empty or unknown reference), one per
    recording (clips noted as "... version of <id>" are left out)."""
    clips = [json.loads(line) for line in (AUDIO / "manifest.jsonl").read_text(encoding="utf-8").splitlines()
             if line.strip()]
    return [c for c in clips if c.get("language") and c.get("reference") != ""
            and "version of" not in (c.get("notes") or "")]


def cmd_prepare(args) -> int:
    """Write the corpus: ``<out>/audio/*.{mp3,opus,ogg,m4a,flac,wav}`` and ``<out>/corpus.json``."""
    import soxr

    from flashasr.audio import load_audio
    from flashasr.audio.encode import encode_audio

    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        if not args.force:
            log(f"{out} is not empty (use --force to replace it)")
            return 2
        shutil.rmtree(out)
    (out / "audio").mkdir(parents=True)
    clips = speech_clips()
    random.Random(args.seed).shuffle(clips)
    cycle = list(FORMATS)
    used_lossless = {k: 0.0 for k in LOSSLESS_LIMITS}
    budget = args.max_mb * 1e6
    files, total_s, total_b, k = [], 0.0, 0, 0
    for c in clips:
        if total_s >= args.seconds:
            break
        d = float(c["duration_s"])
        if total_s + d > args.seconds * 1.05 and d > 20:
            continue  # keep the total near the target
        src = load_audio(AUDIO / c["path"], target_rate=None)
        # pick the next format in the cycle that this clip may use
        for _ in range(len(cycle)):
            name = cycle[k % len(cycle)]
            k += 1
            lim = LOSSLESS_LIMITS.get(name)
            if lim is None or (d <= lim[0] and used_lossless[name] + d <= lim[1]):
                break
        muxer, codec, ext, rate, br = FORMATS[name]
        x = src.samples if src.sample_rate == rate else soxr.resample(src.samples, src.sample_rate, rate,
                                                                        quality="HQ").astype(np.float32)
        p = out / "audio" / f"{len(files):03d}-{c['id']}.{name}.{ext}"
        encode_audio(x, rate, p, format=muxer, codec=codec, bit_rate=br)
        size = p.stat().st_size
        if total_b + size > budget:
            p.unlink()
            log(f"skip {c['id']} as {name}: the corpus would pass {args.max_mb} MB")
            continue
        if name in used_lossless:
            used_lossless[name] += d
        check = load_audio(p)  # it decodes, to about the same length
        if abs(check.duration - len(x) / rate) > 0.1:
            raise SystemExit(f"{p}: decodes to {check.duration:.2f} s, wrote {len(x) / rate:.2f} s")
        files.append({"path": f"audio/{p.name}", "source": c["path"], "id": c["id"], "language": c["language"],
                      "format": name, "codec": codec, "sample_rate": rate, "bit_rate": br,
                      "duration_s": round(len(x) / rate, 3), "bytes": size})
        total_s += len(x) / rate
        total_b += size
    by_fmt: dict[str, dict] = {}
    for f in files:
        e = by_fmt.setdefault(f["format"], {"files": 0, "seconds": 0.0, "bytes": 0})
        e["files"] += 1
        e["seconds"] = round(e["seconds"] + f["duration_s"], 2)
        e["bytes"] += f["bytes"]
    langs: dict[str, float] = {}
    for f in files:
        langs[f["language"]] = round(langs.get(f["language"], 0.0) + f["duration_s"], 1)
    meta = {"what": "real speech from shared/audio (distinct recordings with speech) re-encoded with PyAV "
                    "for bench/bench_offline_e2e.py", "seed": args.seed, "seconds": round(total_s, 2),
            "bytes": total_b, "files": files, "by_format": by_fmt, "by_language_s": langs,
            "av": __import__("av").__version__}
    (out / "corpus.json").write_text(json.dumps(meta, indent=1) + "\n")
    log(f"wrote {len(files)} files, {total_s:.0f} s ({total_s / 60:.1f} min) of audio, "
        f"{total_b / 1e6:.2f} MB to {out}")
    for name, e in sorted(by_fmt.items()):
        log(f"  {name:9} {e['files']:3d} files {e['seconds']:7.1f} s {e['bytes'] / 1e3:8.0f} kB")
    return 0


def cmd_shared(args) -> int:
    """Copy what ``random:NAME`` needs from the shared folder into ``--out``: the Parakeet YAML
    configs and the English 16 kHz WAV clips its joint calibration picks (the same rule as
    :func:`flashasr.random_models.calibration_speech`: sorted ``audio/en/*.wav``, mono
    16-bit 16 kHz, 2-30 s, the first six)."""
    out = Path(args.out)
    (out / "fixtures" / "parakeet").mkdir(parents=True, exist_ok=True)
    (out / "audio" / "en").mkdir(parents=True, exist_ok=True)
    for y in sorted((SHARED / "fixtures" / "parakeet").glob("*.yaml")):
        shutil.copyfile(y, out / "fixtures" / "parakeet" / y.name)
    n = 0
    for f in sorted((AUDIO / "en").glob("*.wav"))[:24]:
        with wave.open(str(f)) as w:
            ok = w.getframerate() == 16000 and w.getnchannels() == 1 and w.getsampwidth() == 2
            d = w.getnframes() / max(1, w.getframerate())
        if ok and 2.0 <= d <= 30.0:
            shutil.copyfile(f, out / "audio" / "en" / f.name)
            n += 1
        if n == 6:
            break
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    log(f"wrote {n} calibration clips and the yamls to {out} ({size / 1e6:.2f} MB)")
    return 0


# ----------------------------------------------------------------------------- run helpers


class Results:
    """The JSON being built; written after every part (and by the watchdog on a hang)."""

    def __init__(self, paths: list[Path]):
        self.paths = paths
        self.data: dict = {"benchmark": "offline_e2e", "status": "running", "errors": []}
        self.lock = threading.Lock()

    def save(self) -> None:
        with self.lock:
            self.data["elapsed_s"] = round(time.perf_counter() - T0, 2)
            for _ in range(3):
                try:
                    text = json.dumps(self.data, indent=1, default=str) + "\n"
                    break
                except RuntimeError:  # a dict changed size while dumping (watchdog thread)
                    time.sleep(0.01)
            else:
                return
            for p in self.paths:
                try:
                    p.parent.mkdir(parents=True, exist_ok=True)
                    tmp = p.with_name(p.name + ".tmp")
                    tmp.write_text(text)
                    os.replace(tmp, p)
                except OSError as e:
                    print(f"cannot write {p}: {e}", file=sys.stderr, flush=True)

    def error(self, part: str, e: BaseException) -> None:
        self.data["errors"].append({"part": part, "error": f"{type(e).__name__}: {e}",
                                    "traceback": traceback.format_exc(limit=8)})
        log(f"{part}: FAILED {type(e).__name__}: {e}")


class TimeBox:
    """Interrupt the main thread (KeyboardInterrupt) after ``seconds``; swallows that interrupt."""

    def __init__(self, seconds: float):
        self.seconds = max(0.5, float(seconds))
        self.fired = False
        self._t: threading.Timer | None = None

    def _fire(self) -> None:
        self.fired = True
        _thread.interrupt_main()

    def __enter__(self) -> "TimeBox":
        self._t = threading.Timer(self.seconds, self._fire)
        self._t.daemon = True
        self._t.start()
        return self

    def __exit__(self, et, ev, tb) -> bool:
        self._t.cancel()
        if self.fired and et is None:
            try:  # a late interrupt must land here, not in the next part
                time.sleep(0.05)
            except KeyboardInterrupt:
                pass
        return bool(self.fired and et is KeyboardInterrupt)


def environment(device: str) -> dict:
    """Machine, versions and conditions for the JSON."""
    env = {"time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "python": platform.python_version(),
           "platform": platform.platform(), "cpu_count": os.cpu_count(), "load_average": list(os.getloadavg()),
           "hostname": platform.node()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                env["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        env["affinity_cpus"] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        pass
    for mod in ("torch", "numpy", "av", "soxr", "onnxruntime"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception as e:
            env[mod] = f"unavailable: {e}"
    from flashasr.audio import opus

    env["opus_decoder"] = f"libopus at the output rate ({opus.version()})" if opus.enabled() else \
        "FFmpeg at 48 kHz + soxr"
    try:
        import pynvml

        env["pynvml"] = getattr(pynvml, "__version__", "importable")
    except Exception:
        env["pynvml"] = "not importable"
    try:
        import torch

        env["torch_threads"] = torch.get_num_threads()
        if device.startswith("cuda") and torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            env.update({"gpu": p.name, "gpu_memory_gib": round(p.total_memory / 2**30, 1),
                        "sm_count": p.multi_processor_count, "cuda_runtime": torch.version.cuda,
                        "cudnn": torch.backends.cudnn.version()})
    except Exception as e:
        env["torch_error"] = str(e)
    try:
        env["git_commit"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                           capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        env["git_commit"] = None
    env["git_commit"] = env["git_commit"] or os.environ.get("FLASHASR_COMMIT")
    env["env_vars"] = {k: v for k, v in os.environ.items() if k.startswith("FLASHASR_") or k in
                       ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")}
    return env


def filesystem_of(path: Path) -> dict:
    """Mount point and filesystem type holding ``path`` (from /proc/mounts; fsync cost depends on it)."""
    best = ("", "?", "?")
    try:
        p = os.path.realpath(path)
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and (p == parts[1] or p.startswith(parts[1].rstrip("/") + "/")) \
                    and len(parts[1]) >= len(best[0]):
                best = (parts[1], parts[2], parts[0])
    except OSError:
        pass
    return {"path": str(path), "mount": best[0], "fstype": best[1], "device": best[2]}


def write_cost(d: Path, n: int = 40) -> dict:
    """Milliseconds per output write (``atomic_write_text``: write, fsync, rename) and per
    ``summary.jsonl`` line (append, fsync) in folder ``d``: the runner's per-file I/O."""
    from flashasr.jobs.outputs import Summary, atomic_write_text

    d.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"text": "x" * 400, "segments": [{"id": i, "text": "y" * 40} for i in range(10)]})
    t = time.perf_counter()
    for i in range(n):
        atomic_write_text(d / f"w{i}.json", text)
    t1 = time.perf_counter()
    s = Summary(d)
    for i in range(n):
        s.append({"path": f"/in/{i}.mp3", "status": "ok", "output": f"w{i}.json"})
    t2 = time.perf_counter()
    shutil.rmtree(d, ignore_errors=True)
    return {"atomic_write_ms": round(1000 * (t1 - t) / n, 3), "summary_append_ms": round(1000 * (t2 - t1) / n, 3),
            "writes": n, "bytes_per_output": len(text)}


def gpu_peak_reset(cuda: bool) -> None:
    if cuda:
        import torch

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def gpu_peak(cuda: bool) -> dict:
    if not cuda:
        return {}
    import torch

    torch.cuda.synchronize()
    return {"peak_gpu_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3),
            "peak_gpu_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 3)}


def read_corpus(corpus: Path) -> list[dict]:
    """Corpus files (``corpus.json`` entries, or every audio file below ``corpus``)."""
    meta = corpus / "corpus.json"
    if meta.is_file():
        files = json.loads(meta.read_text())["files"]
        return [dict(f, abspath=str((corpus / f["path"]).resolve())) for f in files]
    return [{"path": str(p.relative_to(corpus)), "abspath": str(p.resolve()), "format": p.suffix[1:]}
            for p in sorted(corpus.rglob("*")) if p.suffix.lower() in AUDIO_EXT]


def build_inputs(files: list[dict], root: Path, reps: int) -> list[Path]:
    """``root/repNNN/<name>`` symlinks (copies where symlinks fail) to every corpus file."""
    out = []
    for r in range(reps):
        d = root / f"rep{r:03d}"
        d.mkdir(parents=True, exist_ok=True)
        for f in files:
            dst = d / Path(f["path"]).name
            try:
                os.symlink(f["abspath"], dst)
            except OSError:
                shutil.copyfile(f["abspath"], dst)
            out.append(dst)
    return out


def runner_pieces(samples: np.ndarray, sr: int, seg_max: float, split=None, method: str = "vad",
                  caps=None) -> list[tuple[int, int]]:
    """The pieces :func:`run_job` cuts: :func:`flashasr.pipeline.plan_pieces` with ``segmentation=
    method`` and ``max_segment_s=seg_max`` (``split``: its VAD splitter hook, None: the VAD) for a
    model of ``caps`` (default: a model whose window is ``seg_max`` at ``sr`` Hz)."""
    from flashasr.options import ModelCapabilities, TranscribeOptions
    from flashasr.pipeline import plan_pieces

    caps = caps or ModelCapabilities(sample_rate=sr, window_s=seg_max)
    return plan_pieces(samples, TranscribeOptions(segmentation=method, max_segment_s=seg_max), caps, split=split)


def predecode(files: list[dict], sr: int, seg_max: float, workers: int, method: str = "vad",
              caps=None) -> tuple[dict, dict]:
    """Decode every distinct corpus file once (thread pool), timing per file with per-thread CPU
    clocks: container decode at the source rate alone, the full ``load_audio`` to ``sr`` Hz
    (decode + downmix + resample), and VAD. Returns ({abspath: (samples, pieces)}, cost table)."""
    from flashasr.audio import load_audio

    def one(f):
        dec, full = float("inf"), float("inf")
        for _ in range(2):  # best of two: the first open of a file costs more
            c0 = time.thread_time()
            native = load_audio(f["abspath"], target_rate=None)
            c1 = time.thread_time()
            a = load_audio(f["abspath"], target_rate=sr)
            c2 = time.thread_time()
            dec, full = min(dec, c1 - c0), min(full, c2 - c1)
        x = np.ascontiguousarray(a.samples, dtype=np.float32)
        c2 = time.thread_time()
        pieces = runner_pieces(x, sr, seg_max, None, method, caps)
        c3 = time.thread_time()
        return f, x, pieces, native.sample_rate, dec, full, c3 - c2

    arrays, cost = {}, {}
    t = time.perf_counter()
    with cf.ThreadPoolExecutor(max(1, workers)) as ex:
        for f, x, pieces, src_rate, dec, full, vad in ex.map(one, files):
            arrays[f["abspath"]] = (x, pieces)
            e = cost.setdefault(f.get("format", "?"), {"files": 0, "audio_s": 0.0, "decode_native_cpu_s": 0.0,
                                                      "load_audio_cpu_s": 0.0, "vad_cpu_s": 0.0})
            e["files"] += 1
            e["audio_s"] += x.size / sr
            e["decode_native_cpu_s"] += dec
            e["load_audio_cpu_s"] += full
            e["vad_cpu_s"] += vad
    wall = time.perf_counter() - t
    tot = {"audio_s": 0.0, "decode_native_cpu_s": 0.0, "load_audio_cpu_s": 0.0, "vad_cpu_s": 0.0}
    table = {}
    for name, e in sorted(cost.items()):
        h = e["audio_s"] / 3600
        for k in tot:
            tot[k] += e[k]
        table[name] = {"files": e["files"], "audio_s": round(e["audio_s"], 1),
                       "decode_cpu_s_per_audio_h": round(e["decode_native_cpu_s"] / h, 2),
                       "load_audio_cpu_s_per_audio_h": round(e["load_audio_cpu_s"] / h, 2),
                       "resample_downmix_cpu_s_per_audio_h": round((e["load_audio_cpu_s"] -
                                                                    e["decode_native_cpu_s"]) / h, 2),
                       "vad_cpu_s_per_audio_h": round(e["vad_cpu_s"] / h, 2)}
    h = tot["audio_s"] / 3600
    table["all"] = {"files": len(files), "audio_s": round(tot["audio_s"], 1),
                    "decode_cpu_s_per_audio_h": round(tot["decode_native_cpu_s"] / h, 2),
                    "load_audio_cpu_s_per_audio_h": round(tot["load_audio_cpu_s"] / h, 2),
                    "resample_downmix_cpu_s_per_audio_h": round((tot["load_audio_cpu_s"] -
                                                                 tot["decode_native_cpu_s"]) / h, 2),
                    "vad_cpu_s_per_audio_h": round(tot["vad_cpu_s"] / h, 2),
                    "wall_s": round(wall, 3), "threads": workers}
    return arrays, table


class _Decoded:
    def __init__(self, samples):
        self.samples = samples


class NullModel(ASRModel):
    """A model that costs (almost) nothing: the CPU path's own ceiling (decode, resample, VAD,
    merging, rendering, writing) when run through ``run_job``. Same sample rate and piece
    length as the real model; each piece gets one segment with 2.5 words per second of audio
    (about the real text volume), so rendering and writing do realistic work.
    """

    family = "parakeet"
    name = "null"
    device = "cpu"
    speech_gate = False  # as Parakeet: the VAD runs only where a file must be cut

    def __init__(self, sample_rate: int, max_segment_seconds: float):
        self.sample_rate = sample_rate
        self.max_segment_seconds = max_segment_seconds

    def _transcribe(self, waveforms, options):
        from flashasr.types import Segment, Transcript

        out = []
        for w in waveforms:
            dur = len(w) / self.sample_rate
            text = " word" * max(1, int(2.5 * dur))
            out.append(Transcript(text=text, language=options.language, duration=dur,
                                  segments=[Segment(0, 0.0, dur, text)], model=self.name))
        return out


def job_row(name: str, rep, extra: dict | None = None) -> dict:
    d = rep.to_dict()
    d["phase"] = name
    d["audio_h"] = round(rep.audio_s / 3600, 4)
    d["batch_pieces_mean"] = round(float(np.mean(rep.batch_pieces)), 2) if rep.batch_pieces else 0.0
    d["failures"] = [f"{r.item.display}: [{r.error_code}] {r.error_message}" for r in rep.failed][:5]
    if extra:
        d.update(extra)
    return d


def print_table(rows: list[dict]) -> None:
    print(f"\n{'phase':40} {'audio h':>8} {'wall s':>8} {'speed':>9} {'model busy':>10} {'NVML':>6} "
          f"{'peak GiB':>8}", flush=True)
    for r in rows:
        nv = r.get("nvml") or {}
        nvs = f"{nv['mean_util_pct']:.0f}%" if nv.get("available") else "-"
        mb = r.get("model_busy_fraction")
        print(f"{r['phase'][:40]:40} {r.get('audio_h', 0):8.3f} {r.get('wall_s', 0):8.2f} "
              f"{r.get('speed_factor', 0):8.0f}x {'' if mb is None else f'{100 * mb:.0f}%':>10} {nvs:>6} "
              f"{r.get('peak_gpu_allocated_gib', ''):>8}" + ("  (partial)" if r.get("interrupted") else ""),
              flush=True)


# ----------------------------------------------------------------------------- run


def cmd_run(args) -> int:
    tag = args.tag or ("cpu_smoke" if args.smoke else None)
    outs = []
    res = Results(outs)
    if args.max_wall_s is None:
        args.max_wall_s = 55.0 if args.smoke else 250.0
    tmp_root = Path(os.path.abspath(tempfile.mkdtemp(prefix="flashasr-e2e-", dir=args.work_dir)))
    try:
        return _run(args, res, outs, tag, tmp_root)
    except BaseException as e:  # keep whatever was measured
        res.error("run", e)
        res.data["status"] = "failed"
        res.save()
        return 1
    finally:
        if not args.keep:
            shutil.rmtree(tmp_root, ignore_errors=True)


def _run(args, res: Results, outs: list, tag: str | None, tmp_root: Path) -> int:
    deadline = T0 + args.max_wall_s
    reserve = 5.0

    def left() -> float:
        return deadline - time.perf_counter() - reserve

    import torch

    from flashasr.jobs import run_job
    from flashasr.jobs.gpumon import NvmlSampler
    from flashasr.jobs.runner import default_batch_size, default_cpu_pool, default_workers
    from flashasr.pipeline.engines import load_model

    if args.smoke:
        args.device = "cpu"
        args.model = args.model or str(TINY_NEMO)
        args.hours = args.hours or 0.03
        args.batch_sizes = args.batch_sizes or "4"
        args.workers = args.workers or 2
    args.model = args.model or "random:parakeet-tdt-0.6b-v3"
    args.hours = args.hours or 4.0
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch.cuda.is_available() is False")
    if tag is None:
        if cuda:
            name = torch.cuda.get_device_name(0).lower()
            tag = next((t for t in ("h200", "h100", "a100", "l40s", "l4", "a10") if t in name), "gpu")
        else:
            tag = "cpu"
    outs.append(Path(args.json_out) if args.json_out else REPO / "bench" / "results" / f"offline_e2e_{tag}.json")
    if os.environ.get("OUT"):
        outs.append(Path(os.environ["OUT"]) / f"offline_e2e_{tag}.json")
    d = res.data
    d["env"] = environment(args.device)
    d["env"]["work_dir_filesystem"] = filesystem_of(tmp_root)
    d["env"]["corpus_filesystem"] = filesystem_of(Path(args.corpus or tmp_root))
    try:
        d["env"]["work_dir_write_cost"] = write_cost(tmp_root / "write_cost")
    except OSError as e:
        d["env"]["work_dir_write_cost"] = f"not measured: {e}"
    d["args"] = vars(args).copy()
    res.save()
    log(f"env: {d['env'].get('gpu', 'no GPU')}, torch {d['env'].get('torch')}, {os.cpu_count()} CPUs; "
        f"budget {args.max_wall_s:.0f} s; JSON -> {', '.join(map(str, outs))}")

    # watchdog: a hang (e.g. inside a CUDA call) still leaves the JSON
    def watchdog():
        time.sleep(max(1.0, deadline - time.perf_counter() + 20.0))
        d["status"] = "killed_by_watchdog"
        res.save()
        log("watchdog: over budget by 20 s, JSON written, exiting")
        os._exit(3)

    threading.Thread(target=watchdog, daemon=True, name="e2e-watchdog").start()

    # corpus
    corpus = Path(args.corpus) if args.corpus else None
    if corpus is None:
        if not args.smoke:
            raise SystemExit("--corpus is required (or --smoke)")
        corpus = tmp_root / "corpus"
        pa = argparse.Namespace(out=str(corpus), seconds=40.0, max_mb=2.0, seed=1, force=True)
        cmd_prepare(pa)
    files = read_corpus(corpus)
    if not files:
        raise SystemExit(f"no audio files in {corpus}")
    corpus_s = sum(float(f.get("duration_s") or 0.0) for f in files)
    if corpus_s <= 0:
        from flashasr.audio import probe

        corpus_s = sum(probe(f["abspath"]).duration for f in files)
    reps = max(1, math.ceil(args.hours * 3600 / corpus_s))
    t = time.perf_counter()
    inputs_root = tmp_root / "inputs"
    inputs = build_inputs(files, inputs_root, reps)
    d["corpus"] = {"dir": str(corpus), "files": len(files), "distinct_audio_s": round(corpus_s, 2),
                   "bytes": sum(Path(f["abspath"]).stat().st_size for f in files),
                   "by_format": _count_by(files, "format"), "repeats": reps, "inputs": len(inputs),
                   "input_audio_h": round(reps * corpus_s / 3600, 3),
                   "note": "each input is a symlink repNNN/<file> to a corpus file: opened and decoded "
                           "again every time; the files stay in the page cache (no disk reads)"}
    log(f"corpus {len(files)} files, {corpus_s / 60:.1f} min; {reps} copies -> {len(inputs)} inputs, "
        f"{reps * corpus_s / 3600:.2f} h ({time.perf_counter() - t:.1f} s)")
    res.save()

    # the decode worker processes, forked before the model makes this process large (as
    # `flashasr transcribe` does); every job from disk below uses them
    from flashasr.jobs import start_decode_pool

    pool = start_decode_pool(args.device, args.workers, args.cpu_pool) if args.early_pool else None
    d["conditions_pool"] = ("decode workers forked once before the model load, shared by every job"
                            if pool is not None else "each job forks its own decode workers")
    try:
        return _run_with(args, res, outs, d, tmp_root, files, corpus_s, reps, inputs_root, inputs, left, cuda, pool)
    finally:
        if pool is not None:
            pool.close()


def _run_with(args, res, outs, d, tmp_root, files, corpus_s, reps, inputs_root, inputs, left, cuda, pool) -> int:
    import torch  # noqa: F401

    from flashasr.jobs import run_job
    from flashasr.jobs.gpumon import NvmlSampler
    from flashasr.jobs.runner import default_batch_size, default_cpu_pool, default_workers
    from flashasr.pipeline.engines import load_model

    # model
    t = time.perf_counter()
    if args.model == "null":  # the CPU path alone (pieces cut as for the GPU engine: 30 s)
        model = NullModel(16000, 30.0)
        args.null_phase = False
    elif args.model_process:  # every phase's model calls go to a process of its own
        from flashasr.pipeline.model_process import ModelProcess

        model = ModelProcess(args.model, device=args.device)
    else:
        model = load_model(args.model, device=args.device)
    load_s = time.perf_counter() - t
    sr = int(getattr(model, "sample_rate", 16000))
    seg_max = float(getattr(model, "max_segment_seconds", 30.0))
    workers = args.workers or default_workers(args.device)
    bsz_default = default_batch_size(args.device)
    batch_sizes = []
    for b in (args.batch_sizes or "default").split(","):
        b = b.strip()
        v = bsz_default if b in ("default", "") else int(getattr(model, "batch_size", bsz_default) or bsz_default) \
            if b == "model" else int(b)
        if v not in batch_sizes:
            batch_sizes.append(v)
    d["model"] = {"spec": args.model, "name": getattr(model, "name", None), "class": type(model).__name__,
                  "device": str(getattr(model, "device", args.device)), "load_s": round(load_s, 2),
                  "max_segment_seconds": seg_max, "model_batch_size": getattr(model, "batch_size", None),
                  "calibration": getattr(model, "calibration", None),
                  "engine_info": getattr(model, "engine_info", None)}
    d["conditions"] = {"workers": workers, "model_process": bool(args.model_process), "runner_default_workers": default_workers(args.device),
                       "batch_sizes": batch_sizes, "runner_default_batch_size": bsz_default,
                       "format": args.format, "segmentation": args.segmentation, "max_buffered_audio_s": args.max_buffered_s,
                       "outputs": f"{args.format} files + summary.jsonl in a temporary folder "
                                  f"({tmp_root}), fsynced as the runner does"}
    d["phases"] = []
    log(f"model {d['model']['name']} ({d['model']['class']}) on {args.device} loaded in {load_s:.1f} s; "
        f"calibration {d['model']['calibration']}; workers {workers}, batch sizes {batch_sizes}")
    res.save()

    # the remaining time is shared between the parts by weight
    parts = [(f"warmup{b}", 0.7) for b in batch_sizes] + [(f"a{b}", 4.0) for b in batch_sizes] \
        + ([("null", 2.5)] if args.null_phase else []) + [("predecode", 0.7)] \
        + [(f"b1_{b}", 2.0) for b in batch_sizes] + [(f"b2_{b}", 1.0) for b in batch_sizes] + [("b3", 1.0)]
    weights = dict(parts)

    def cap(part: str) -> float:
        i = [p for p, _ in parts].index(part)
        rest = sum(w for _, w in parts[i:])
        return left() * weights[part] / rest

    def progress_cb(total: int, soft_deadline: float, state: dict):
        """Progress lines; past ``soft_deadline`` it stops the job cleanly: a KeyboardInterrupt
        raised here (in the job's writer thread, which calls on_result) ends run_job as Ctrl-C would."""
        state.update(n=0, t=time.perf_counter(), stopped=False)

        def cb(r):
            state["n"] += 1
            now = time.perf_counter()
            if now - state["t"] >= args.progress_s:
                state["t"] = now
                log(f"  {state['n']}/{total} files")
            if now > soft_deadline and not state["stopped"]:
                state["stopped"] = True
                raise KeyboardInterrupt
        return cb

    def job(name: str, job_inputs, n_files: int, out_dir: Path, bs: int, seconds: float, use_model=None,
            job_pool=None, **kw):
        gpu_peak_reset(cuda)
        log(f"{name}: {n_files} files, batch {bs}, time box {seconds:.0f} s")
        rep = None
        state: dict = {}
        # soft stop at the time box (between model calls, via on_result); hard interrupt 15 s later
        with TimeBox(seconds + 15.0) as tb:
            rep = run_job(job_inputs, use_model or model, out_dir, args.format, batch_size=bs, workers=workers,
                          resume=False, progress=False, keep_transcripts=False,
                          max_buffered_audio_s=args.max_buffered_s,
                          on_result=progress_cb(n_files, time.perf_counter() + seconds, state),
                          segmentation=args.segmentation,
                          cpu_pool=args.cpu_pool or default_cpu_pool(args.device),
                          worker_pool=job_pool or pool, **kw)
        hit = bool(tb.fired or state.get("stopped"))
        if rep is None:  # interrupted before the runner started its own bookkeeping
            d["phases"].append({"phase": name, "interrupted": True, "time_box_s": round(seconds, 1)})
            res.save()
            log(f"{name}: interrupted before it started")
            return None
        row = job_row(name, rep, gpu_peak(cuda))
        row["time_box_s"] = round(seconds, 1)
        row["time_box_hit"] = hit
        row["hard_interrupt"] = bool(tb.fired)
        row["outputs_on_disk"] = sum(1 for _ in out_dir.rglob(f"*.{args.format}"))
        d["phases"].append(row)
        res.save()
        log(f"{name}: {rep.audio_s / 3600:.3f} h in {rep.wall_s:.2f} s = {rep.speed_factor:.0f}x; "
            f"model busy {100 * rep.model_busy_fraction:.0f} %, decode threads {100 * rep.cpu_pool_busy_fraction:.0f} % busy"
            f" ({100 * rep.cpu_stage_utilisation:.0f} % on CPU)"
            f", bound by {rep.bound_by()}; failed {len(rep.failed)}" + (" (TIME BOX HIT)" if hit else ""))
        for line in rep.table().splitlines():
            log("  | " + line)
        log(f"  model calls [start s, s, pieces, audio s]: {rep.model_calls}; last decode at {rep.last_decode_s:.3f} s")
        if rep.engine_timings:  # the engine's own split of its calls, summed (where the call time went)
            tot: dict = {}
            for t in rep.engine_timings:
                for k, v in (t or {}).items():
                    tot[k] = tot.get(k, 0.0) + v
            calls_s = sum(c[1] for c in rep.model_calls)
            log(f"  engine timings over {len(rep.engine_timings)} calls ({calls_s:.3f} s of calls): "
                + ", ".join(f"{k} {v:.3f} s" for k, v in tot.items()))
        return rep

    # warm-up: one copy of the corpus per batch size (the GPU decoder captures a graph per new
    # power-of-two batch/length bucket; VAD session; page cache)
    for b in batch_sizes:
        if left() < 5:
            break
        try:
            job(f"warmup: 1 copy from disk, batch {b}", [inputs_root / "rep000"], len(files),
                tmp_root / f"out_warm{b}", b, cap(f"warmup{b}"))
        except Exception as e:
            res.error(f"warmup{b}", e)

    # (a) from disk, then (c) the CPU path alone: the same inputs from disk with a model that costs
    # nothing; once per --switch-intervals value (the interpreter's GIL switch interval; the first
    # value's rows are the ones the analysis reads)
    a_rows = {}
    intervals = [float(v) for v in (args.switch_intervals or "").split(",") if v.strip()] or [None]
    d["conditions"]["switch_intervals_s"] = [sys.getswitchinterval() if v is None else v for v in intervals]
    for n_var, sw in enumerate(intervals):
        if sw is not None:
            sys.setswitchinterval(sw)
        tag_sw = f", switch interval {sys.getswitchinterval() * 1e3:g} ms" if len(intervals) > 1 else ""
        for b in batch_sizes:
            if left() < 5:
                log(f"a{b}: skipped, out of time")
                continue
            try:
                rep = job(f"a: from disk, batch {b}{tag_sw}", [inputs_root], len(inputs), tmp_root / f"out_a{b}_{n_var}",
                          b, cap(f"a{b}") / len(intervals))
                if rep is not None and n_var == 0:
                    a_rows[b] = (rep, d["phases"][-1])
            except Exception as e:
                res.error(f"a{b}", e)
        if args.null_phase and left() > 5:
            try:
                # the CPU path of the GPU job: on CUDA the same VAD placement (batched on the GPU, the
                # workers only decode) as with the real model
                job(f"c: from disk, null model, batch {batch_sizes[0]}{tag_sw}", [inputs_root], len(inputs),
                    tmp_root / f"out_null_{n_var}", batch_sizes[0], cap("null") / len(intervals),
                    use_model=NullModel(sr, seg_max), vad_device=args.device if cuda else "cpu")
            except Exception as e:
                res.error("null", e)
    if intervals[0] is not None:
        sys.setswitchinterval(intervals[0])

    # (a') the same from disk with other run_job settings (--a-variants "min_batch=128;min_batch=512")
    for spec in [v.strip() for v in (args.a_variants or "").split(";") if v.strip()]:
        kw = {}
        for kv in spec.split(","):
            k, _, v = kv.partition("=")
            try:
                kw[k.strip()] = float(v) if "." in v else int(v)
            except ValueError:  # a word: vad_device=cpu
                kw[k.strip()] = v.strip()
        if left() < 5:
            log(f"variant {spec}: skipped, out of time")
            continue
        # pool_workers=N / pool_nice=N / pool_reserve=N (cores kept free of decoders): a pool of its own
        # for this run (forked now, outside the timing)
        var_pool = None
        env_of = {"pool_nice": "FLASHASR_DECODE_NICENESS", "pool_reserve": "FLASHASR_DECODE_RESERVED_CPUS"}
        if {"pool_workers", *env_of} & set(kw):
            env_before = {v: os.environ.get(v) for v in env_of.values()}
            for k, v in env_of.items():
                if k in kw:
                    os.environ[v] = str(kw.pop(k))
            from flashasr.jobs import start_decode_pool

            try:
                var_pool = start_decode_pool(args.device, kw.pop("pool_workers", workers), args.cpu_pool)
            except Exception as e:
                res.error(f"variant {spec}: pool", e)
                continue
            finally:
                for v, before in env_before.items():
                    if before is None:
                        os.environ.pop(v, None)
                    else:
                        os.environ[v] = before
        try:
            job(f"a: from disk, batch {batch_sizes[0]}, {spec}", [inputs_root], len(inputs),
                tmp_root / f"out_var_{len(d['phases'])}", batch_sizes[0], min(40.0, 0.25 * left()),
                job_pool=var_pool, **kw)
        except Exception as e:
            res.error(f"variant {spec}", e)
        finally:
            if var_pool is not None:
                var_pool.close()

    # (d) one format alone (e.g. mp3-44k): the stage costs per audio hour of that format through the
    # whole path (issue #12: their sum for 44.1 kHz mp3)
    for fmt_name in [f.strip() for f in (args.format_phases or "").split(",") if f.strip()]:
        sel = [f for f in files if f.get("format") == fmt_name]
        if not sel or left() < 5:
            log(f"format phase {fmt_name}: skipped ({'no such files' if not sel else 'out of time'})")
            continue
        sel_s = sum(float(f.get("duration_s") or 0.0) for f in sel) or 1.0
        fmt_root = tmp_root / f"inputs_{fmt_name}"
        fmt_inputs = build_inputs(sel, fmt_root, max(1, math.ceil(args.format_phase_hours * 3600 / sel_s)))
        try:
            job(f"d: {fmt_name} only from disk, batch {batch_sizes[0]}", [fmt_root], len(fmt_inputs),
                tmp_root / f"out_{fmt_name}", batch_sizes[0], min(30.0, 0.2 * left()))
        except Exception as e:
            res.error(f"format_{fmt_name}", e)

    # pre-decode the distinct files (also the single-thread stage costs per format)
    arrays = cost = None
    if left() > 5:
        try:
            log("predecode: distinct corpus files, per-thread CPU clocks")
            with TimeBox(max(cap("predecode"), min(30.0, 0.3 * left()))):  # the b parts need it
                arrays, cost = predecode(files, sr, seg_max, workers, args.segmentation, model.capabilities)
            if arrays is None:
                raise KeyboardInterrupt
            d["stage_cost_single_thread"] = cost
            d["stage_cost_note"] = ("per file, per-thread CPU clocks: decode = PyAV container decode at the "
                                    "source rate (load_audio target_rate=None, includes downmix); load_audio = "
                                    "decode + downmix + soxr HQ resample to 16 kHz (what the runner's decode "
                                    "stage does); resample_downmix = the difference; vad = split_for_asr")
            res.save()
            a = cost["all"]
            log(f"predecode: {a['audio_s']:.0f} s in {a['wall_s']:.2f} s wall; CPU s per audio h: decode "
                f"{a['decode_cpu_s_per_audio_h']}, +resample {a['resample_downmix_cpu_s_per_audio_h']}, "
                f"vad {a['vad_cpu_s_per_audio_h']}")
        except KeyboardInterrupt:
            log("predecode: time box hit")
            arrays = None
        except Exception as e:
            res.error("predecode", e)

    if arrays is not None:
        real = {str(p): str(Path(os.path.realpath(p))) for p in inputs}
        tls = threading.local()

        def decode_mem(path, rate):
            x, pieces = arrays[real.get(path) or os.path.realpath(path)]
            tls.pieces = pieces
            return _Decoded(x)

        def split_mem(samples, rate, max_s, method):
            return tls.pieces

        # (b1) the runner on pre-decoded, pre-cut audio
        for b in batch_sizes:
            if left() < 5:
                log(f"b1_{b}: skipped, out of time")
                continue
            try:
                job(f"b1: in memory via run_job, batch {b}", [inputs_root], len(inputs), tmp_root / f"out_b1_{b}", b,
                    cap(f"b1_{b}"), decode_fn=decode_mem, split_fn=split_mem)
            except Exception as e:
                res.error(f"b1_{b}", e)

        # (b2) transcribe_batch directly, same pieces, length-sorted batches of the same size
        all_pieces = []
        for p in inputs:
            x, pieces = arrays[real[str(p)]]
            all_pieces.extend(x[a:b_] for a, b_ in pieces)
        order = sorted(range(len(all_pieces)), key=lambda i: -len(all_pieces[i]))
        piece_audio_s = sum(len(w) for w in all_pieces) / sr
        for b in batch_sizes:
            if left() < 5:
                log(f"b2_{b}: skipped, out of time")
                continue
            try:
                d["phases"].append(model_loop(f"b2: transcribe_batch in memory, batch {b}", model, all_pieces,
                                              order, b, cap(f"b2_{b}"), cuda, args.device, NvmlSampler,
                                              piece_audio_s, sr))
                res.save()
            except Exception as e:
                res.error(f"b2_{b}", e)

        # (b3) the model's own packing: one call per corpus copy; tokens counted
        if left() > 3:
            try:
                d["phases"].append(engine_loop(model, files, arrays, reps, cap("b3"), cuda, args.device,
                                               NvmlSampler, sr))
                res.save()
            except Exception as e:
                res.error("b3", e)

    if args.model_process:
        model.close()
    d["analysis"] = analysis(d, a_rows, workers)
    d["status"] = "done" if not d["errors"] else "done_with_errors"
    res.save()
    print_table(d["phases"])
    an = d["analysis"]
    for k, v in an.items():
        print(f"  {k}: {v}", flush=True)
    log(f"wrote {', '.join(map(str, outs))}")
    return 0


def _count_by(files: list[dict], key: str) -> dict:
    out: dict[str, int] = {}
    for f in files:
        out[str(f.get(key))] = out.get(str(f.get(key)), 0) + 1
    return out


def model_loop(name, model, pieces, order, bs, seconds, cuda, device, Sampler, audio_s, sr) -> dict:
    """``model.transcribe_batch`` over ``pieces`` in length-sorted chunks of ``bs``."""
    log(f"{name}: {len(pieces)} pieces, time box {seconds:.0f} s")
    gpu_peak_reset(cuda)
    sampler = Sampler(device).start() if cuda else None
    done_s, calls, stopped = 0.0, 0, False
    per_call, timings = [], {}  # [s, pieces, audio s] per call; the engine's own split, summed
    t = time.perf_counter()
    with TimeBox(seconds + 15.0) as tb:  # backstop; the loop itself stops at the time box
        for s in range(0, len(order), bs):
            if time.perf_counter() - t > seconds:
                stopped = True
                break
            chunk = [pieces[i] for i in order[s:s + bs]]
            t0 = time.perf_counter()
            model.transcribe_batch(chunk)
            chunk_s = sum(len(w) for w in chunk) / sr
            per_call.append([round(time.perf_counter() - t0, 4), len(chunk), round(chunk_s, 1)])
            for k, v in (getattr(model, "last_timings", None) or {}).items():
                timings[k] = timings.get(k, 0.0) + v
            calls += 1
            done_s += chunk_s
    if cuda:
        import torch

        torch.cuda.synchronize()
    wall = time.perf_counter() - t
    fired = bool(tb.fired or stopped)
    row = {"phase": name, "audio_h": round(done_s / 3600, 4), "audio_s": round(done_s, 2), "wall_s": round(wall, 3),
           "speed_factor": round(done_s / wall, 2) if wall > 0 else 0.0, "calls": calls, "pieces": len(pieces),
           "model_busy_fraction": 1.0, "interrupted": fired, "time_box_s": round(seconds, 1),
           "nvml": sampler.stop() if sampler else None, **gpu_peak(cuda), "calls_s_pieces_audio_s": per_call,
           "engine_timings_sum_s": {k: round(v, 4) for k, v in timings.items()}}
    log(f"{name}: {done_s / 3600:.3f} h in {wall:.2f} s = {row['speed_factor']:.0f}x ({calls} calls)"
        + (" (TIME BOX HIT)" if fired else ""))
    log(f"  calls [s, pieces, audio s]: {per_call}")
    if timings:
        log("  engine timings summed: " + ", ".join(f"{k} {v:.3f} s" for k, v in timings.items()))
    return row


def engine_loop(model, files, arrays, reps, seconds, cuda, device, Sampler, sr) -> dict:
    """All pieces of one corpus copy per call of the model's piece decoder (``_decode_pieces``: the
    GPU engine's own sorting and profile packing, no transcript building); counts tokens."""
    name = "b3: all pieces of a copy per call"
    pieces = [x[a:b] for f in files for x, ps in [arrays[f["abspath"]]] for a, b in ps]
    per_copy_s = sum(len(w) for w in pieces) / sr
    dec = getattr(model, "_decode_pieces", None)
    log(f"{name}: {len(pieces)} pieces ({per_copy_s:.0f} s) x up to {reps}, time box {seconds:.0f} s")
    if dec is None:
        return {"phase": name, "skipped": "the model has no _decode_pieces (not a Parakeet model)"}
    gpu_peak_reset(cuda)
    sampler = Sampler(device).start() if cuda else None
    tokens, done_s, calls = 0, 0.0, 0
    t = time.perf_counter()
    stopped = False
    with TimeBox(seconds + 15.0) as tb:  # backstop; the loop itself stops at the time box
        for _ in range(reps):
            if time.perf_counter() - t > seconds:
                stopped = True
                break
            hyps = dec(pieces)
            tokens += sum(len(h.token_ids) for h in hyps)
            done_s += per_copy_s
            calls += 1
    if cuda:
        import torch

        torch.cuda.synchronize()
    wall = time.perf_counter() - t
    cal = getattr(model, "calibration", None) or {}
    row = {"phase": name, "audio_h": round(done_s / 3600, 4), "audio_s": round(done_s, 2), "wall_s": round(wall, 3),
           "speed_factor": round(done_s / wall, 2) if wall > 0 else 0.0, "calls": calls,
           "pieces_per_call": len(pieces), "model_busy_fraction": 1.0, "interrupted": bool(tb.fired or stopped),
           "time_box_s": round(seconds, 1), "tokens": tokens,
           "tokens_per_audio_s": round(tokens / done_s, 3) if done_s else None,
           "tokens_per_wall_s": round(tokens / wall, 1) if wall > 0 else None,
           "calibration_tokens_per_s": cal.get("tokens_per_s"),
           "nvml": sampler.stop() if sampler else None, **gpu_peak(cuda)}
    log(f"{name}: {done_s / 3600:.3f} h in {wall:.2f} s = {row['speed_factor']:.0f}x; "
        f"{row['tokens_per_audio_s']} tokens per audio s (calibration {cal.get('tokens_per_s')}), "
        f"{row['tokens_per_wall_s']} tokens per wall s" + (" (TIME BOX HIT)" if row["interrupted"] else ""))
    return row


def analysis(d: dict, a_rows: dict, workers: int) -> dict:
    """Which stage bounds the from-disk run, and what the CPU path costs (speed factor on disk
    vs the same audio in memory)."""
    out: dict = {}
    phases = {p["phase"]: p for p in d.get("phases", [])}
    for b, (rep, row) in a_rows.items():
        c = rep.cpu_per_audio_hour()
        need = rep.decode_cpu_s + rep.vad_cpu_s
        cap_s = workers * rep.wall_s
        e = {"speed_factor_from_disk": round(rep.speed_factor, 1),
             "cpu_stage_cpu_s_needed": round(need, 2), "cpu_stage_capacity_s (workers x wall)": round(cap_s, 2),
             "cpu_stage_utilisation": round(rep.cpu_stage_utilisation, 3),
             "cpu_pool_busy_fraction": round(rep.cpu_pool_busy_fraction, 3),
             "cpu_stage_cpu_efficiency (CPU s / wall s inside decode+VAD)": round(rep.cpu_stage_cpu_efficiency, 3),
             "cpu_stage_ceiling_speed_factor": round(workers * 3600 / (c["decode"] + c["vad"]), 0)
             if (c["decode"] + c["vad"]) > 0 else None,
             "model_busy_fraction": round(rep.model_busy_fraction, 3),
             "writer_busy_fraction": round(rep.writer_busy_fraction, 3),
             "nvml_mean_util_pct": (rep.nvml or {}).get("mean_util_pct"),
             "bound_by": rep.bound_by()}
        b1 = phases.get(f"b1: in memory via run_job, batch {b}")
        b2 = phases.get(f"b2: transcribe_batch in memory, batch {b}")
        if b1 and b1.get("speed_factor"):
            e["speed_factor_in_memory_run_job"] = b1["speed_factor"]
            e["cpu_path_cost (1 - disk/memory, run_job)"] = round(1 - rep.speed_factor / b1["speed_factor"], 3)
        if b2 and b2.get("speed_factor"):
            e["speed_factor_in_memory_transcribe_batch"] = b2["speed_factor"]
            e["disk_vs_transcribe_batch"] = round(rep.speed_factor / b2["speed_factor"], 3)
        out[f"batch_{b}"] = e
    c = next((p for p in d.get("phases", []) if p["phase"].startswith("c: ")), None)
    if c and c.get("speed_factor"):
        out["cpu_path_ceiling (null model from disk)"] = {
            "speed_factor": c["speed_factor"], "cpu_s_per_audio_hour": c.get("cpu_s_per_audio_hour"),
            "cpu_stage_utilisation": c.get("cpu_stage_utilisation"),
            "cpu_pool_busy_fraction": c.get("cpu_pool_busy_fraction"),
            "cpu_stage_cpu_efficiency": c.get("cpu_stage_cpu_efficiency"),
            "writer_busy_fraction": c.get("writer_busy_fraction"), "bound_by": c.get("bound_by"),
            "interrupted": c.get("interrupted")}
        for b, (rep, _row) in a_rows.items():
            out[f"batch_{b}"]["share_of_cpu_path_ceiling"] = round(rep.speed_factor / c["speed_factor"], 3)
    b3 = next((p for p in d.get("phases", []) if p["phase"].startswith("b3")), None)
    if b3 and b3.get("speed_factor"):
        out["engine_own_packing_speed_factor"] = b3["speed_factor"]
    out["rule"] = ("bound_by: too_small if fewer than 2 files were transcribed or 2 model calls made; "
                   "model if model calls >= 80 % of wall; cpu_stage if decode+VAD wall or CPU s "
                   ">= 80 % of workers x wall; writer if output writing (its own thread) >= 80 %; else input "
                   "(nothing saturated); cpu_stage_ceiling = workers x 3600 / (decode + VAD CPU s per audio h)")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="write the compressed corpus")
    p.add_argument("--out", required=True)
    p.add_argument("--seconds", type=float, default=1050.0, help="distinct audio to write (s)")
    p.add_argument("--max-mb", type=float, default=8.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    s = sub.add_parser("shared", help="copy the calibration clips and Parakeet yamls for random:NAME")
    s.add_argument("--out", required=True)
    r = sub.add_parser("run", help="run the benchmark")
    r.add_argument("--corpus", help="folder written by prepare")
    r.add_argument("--hours", type=float, default=None, help="input audio hours (default 4; smoke 0.03)")
    r.add_argument("--model", default=None,
                   help="model spec (default random:parakeet-tdt-0.6b-v3); 'null': a model that costs nothing")
    r.add_argument("--device", default="cuda")
    r.add_argument("--workers", type=int, default=None, help="decode threads (default: the runner's)")
    r.add_argument("--batch-sizes", default=None,
                   help="comma list of run_job batch sizes: numbers, 'default' (the runner's default) and "
                        "'model' (the model's own batch_size attribute); default: default")
    r.add_argument("--format", default="json")
    r.add_argument("--segmentation", default="vad", choices=("vad", "fixed"),
                   help="run_job segmentation (fixed: when onnxruntime/silero-vad are missing)")
    r.add_argument("--max-buffered-s", type=float, default=None,
                   help="run_job max_buffered_audio_s (default: the runner's, 4 h for GPU batches)")
    r.add_argument("--max-wall-s", type=float, default=None,
                   help="overall time budget in s, model load included (default 250; smoke 55)")
    r.add_argument("--progress-s", type=float, default=10.0, help="seconds between progress lines")
    r.add_argument("--cpu-pool", choices=("thread", "process"), default=None,
                   help="run_job CPU-stage workers (default: the runner's default for --device; the null "
                        "model phase uses the same)")
    r.add_argument("--null-phase", action=argparse.BooleanOptionalAction, default=True,
                   help="also run the inputs from disk with a model that costs nothing (the CPU path's ceiling)")
    r.add_argument("--model-process", action="store_true",
                   help="the model in a process of its own (flashasr.pipeline.model_process.ModelProcess) for "
                        "every phase: jobs map the decoded samples, in-memory phases copy them once per call; "
                        "compare with a run without it on the same machine")
    r.add_argument("--a-variants", default=None,
                   help="more from-disk runs with other run_job keywords, ';'-separated, e.g. "
                        "'min_batch=128;min_batch=512'")
    r.add_argument("--format-phases", default=None,
                   help="comma list of corpus formats (e.g. mp3-44k) each run alone from disk with the model, "
                        "for its stage costs per audio hour")
    r.add_argument("--format-phase-hours", type=float, default=0.5, help="audio hours of each format phase")
    r.add_argument("--early-pool", action=argparse.BooleanOptionalAction, default=True,
                   help="fork the decode workers once before the model load and share them between the jobs "
                        "(as flashasr transcribe does); --no-early-pool: each job forks its own")
    r.add_argument("--switch-intervals", default=None,
                   help="comma list of GIL switch intervals in s (sys.setswitchinterval) to run parts a and c "
                        "under, e.g. 0.005,0.0005 (default: the interpreter's, once)")
    r.add_argument("--smoke", action="store_true", help="CPU, tiny NeMo fixture, tiny inputs (< 60 s)")
    r.add_argument("--tag", default=None, help="result name: offline_e2e_<tag>.json (default gpu name / cpu)")
    r.add_argument("--json-out", default=None)
    r.add_argument("--work-dir", default=None, help="where the temporary inputs/outputs go (default $TMPDIR)")
    r.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = ap.parse_args(argv)
    if args.cmd == "prepare":
        return cmd_prepare(args)
    if args.cmd == "shared":
        return cmd_shared(args)
    return cmd_run(args)


if __name__ == "__main__":
    raise SystemExit(main())
