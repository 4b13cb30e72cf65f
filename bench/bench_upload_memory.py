"""Peak memory of one long upload at each door: the CLI, the server in single and in multi mode.

Issue #17 item 5: a long upload is decoded and transcribed piece by piece, so the server's peak
memory for a 60-minute upload stays within 1.2x the CLI's for the same file; the figure for a
4-hour upload is reported.

Audio: 16 kHz mono PCM16 WAV built from the real English clips of ``../shared/audio/en`` (read in
place, decoded to 16 kHz; ``FLASHASR_SHARED`` moves the shared folder), with pauses, cached in
``~/.cache/flashasr/bench_upload_memory`` (``--cache``) between runs:

* ``dense``: ``--minutes`` (60) of the clips back to back, 0.4-1.6 s pauses between them;
* ``sparse``: ``--sparse-minutes`` (240) where every 120 s holds one clip (at most 10 s of speech)
  and silence after it, so 4 hours run in reasonable time on 2 cores.

16 kHz is the model's rate, so no door resamples; a 4-hour file is 461 MB (under the server's
1,024 MB upload limit; at 44.1 kHz it would not be). Pauses carry a faint noise floor (-70 dBFS).

Doors, one at a time, same file, same model (``--model``, default the embedded tiny.en, the
default of ``flashasr transcribe`` and ``flashasr serve``), default options otherwise:

* ``cli``: ``python -m flashasr transcribe FILE --model M -q`` (text on stdout);
* ``single``: ``python -m flashasr serve --model M`` and one ``POST /v1/audio/transcriptions`` of
  the file (``response_format=json``; the reply must hold text);
* ``multi``: the same with ``--mode multi`` (engine process + one front end);
* ``cli_batch1`` (not in the default list): the CLI with ``--batch-size 1``, the server's CPU
  ``--max-batch``, to separate the batch's working memory from the rest.

Memory: a sampler thread walks the door's process tree (the process and all its descendants:
decode processes, the forkserver, the engine) every ``--interval-ms`` (50) and sums the RSS of
every process; every fifth sample it also sums PSS (``/proc/PID/smaps_rollup``: shared pages,
e.g. a shared-memory segment mapped by both front end and engine, counted once, not once per
process). Peaks of both sums are reported; RSS is the headline (what the issue asks), PSS the
tree's true footprint. Also: shared-memory files ``/dev/shm/flashasr_*`` (memory even while no
process maps them), the root process's own ``ru_maxrss`` (``wait4``: a cross-check of the
sampler), and for servers the idle tree (RSS/PSS after ready, before the upload) and the peak
during the request, so the upload's own cost is visible. Wall time: CLI process start to exit;
server: the request (POST to reply) and the start-up to ready.

Usage::

    python bench/bench_upload_memory.py                 # 60 min dense + 240 min sparse, 3 doors each
    python bench/bench_upload_memory.py --smoke         # 2 min dense, 3 doors (well under a minute)
    python bench/bench_upload_memory.py --minutes 30 --sets dense --doors cli,multi

Prints a table and writes ``bench/results/upload_memory_cpu.json`` (``--out``; the smoke run
``upload_memory_cpu_smoke.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import threading
import time
import wave
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import psutil

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("FLASHASR_SHARED", REPO.parent / "shared"))
CLIPS = SHARED / "audio" / "en"
RESULTS = REPO / "bench" / "results"
RATE = 16000
TARGET_RATIO = 1.2
RECIPE_VERSION = 1  # bump when the audio recipe changes (cached files are rebuilt)
SPARSE_BLOCK_S = 120.0
SPARSE_SPEECH_S = 10.0
MIB = 1 << 20


# ----------------------------------------------------------------------------- audio
def speech_clips() -> list[tuple[str, np.ndarray]]:
    """The real English clips of ``SHARED/audio/en`` (sorted by name), each decoded to 16 kHz
    float32 by :func:`flashasr.audio.load_audio`."""
    from flashasr.audio import load_audio

    exts = {".wav", ".flac", ".ogg", ".mp3", ".opus", ".m4a"}
    paths = sorted(p for p in CLIPS.iterdir() if p.suffix.lower() in exts)
    if not paths:
        raise SystemExit(f"no clips in {CLIPS} (set FLASHASR_SHARED)")
    return [(p.name, load_audio(str(p), target_rate=RATE).samples) for p in paths]


def _pcm16(x: np.ndarray) -> bytes:
    return (np.clip(x, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()


def _pause(rng: np.random.Generator, seconds: float) -> np.ndarray:
    """A pause: a faint Gaussian noise floor (-70 dBFS RMS), not digital zero."""
    return (rng.standard_normal(int(round(seconds * RATE))) * 10 ** (-70 / 20)).astype(np.float32)


def _dense_blocks(clips, total_s: float, rng):
    """Clips back to back in order (looped), each followed by a 0.4-1.6 s pause."""
    n, i = int(total_s * RATE), 0
    while n > 0:
        name, x = clips[i % len(clips)]
        for part in (x, _pause(rng, rng.uniform(0.4, 1.6))):
            part = part[:n]
            n -= part.size
            yield part
        i += 1


def _sparse_blocks(clips, total_s: float, rng):
    """Every ``SPARSE_BLOCK_S`` seconds one clip (cut to ``SPARSE_SPEECH_S``), then silence."""
    n, i = int(total_s * RATE), 0
    block = int(SPARSE_BLOCK_S * RATE)
    while n > 0:
        name, x = clips[i % len(clips)]
        speech = x[: int(SPARSE_SPEECH_S * RATE)]
        lead = _pause(rng, 0.5)
        for part in (lead, speech, _pause(rng, (block - lead.size - speech.size) / RATE)):
            part = part[:n]
            n -= part.size
            yield part
        i += 1


def build_wav(path: Path, kind: str, minutes: float) -> dict:
    """Write the ``kind`` ('dense' or 'sparse') recording of ``minutes`` to ``path`` (16 kHz mono
    PCM16), block by block (never the whole file in memory); returns its description."""
    clips = speech_clips()
    rng = np.random.default_rng(17)
    blocks = {"dense": _dense_blocks, "sparse": _sparse_blocks}[kind](clips, minutes * 60.0, rng)
    tmp = path.with_suffix(".part")
    with wave.open(str(tmp), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        for b in blocks:
            w.writeframes(_pcm16(b))
    tmp.rename(path)
    return {"clips": [c[0] for c in clips], "clips_s": round(sum(c[1].size for c in clips) / RATE, 1)}


def cached_wav(cache: Path, kind: str, minutes: float) -> tuple[Path, dict]:
    """The ``kind`` recording of ``minutes`` from ``cache`` (built when missing or stale):
    ``(path, description)``; the description is kept beside it as JSON."""
    cache.mkdir(parents=True, exist_ok=True)
    stem = f"{kind}_{minutes:g}min_v{RECIPE_VERSION}"
    path, meta_path = cache / f"{stem}.wav", cache / f"{stem}.json"
    want = {"kind": kind, "minutes": minutes, "rate": RATE, "format": "wav pcm16 mono",
            "recipe_version": RECIPE_VERSION, "source": str(CLIPS)}
    if kind == "sparse":
        want.update(block_s=SPARSE_BLOCK_S, speech_per_block_s=SPARSE_SPEECH_S)
    if path.exists() and meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if all(meta.get(k) == v for k, v in want.items()) and meta.get("bytes") == path.stat().st_size:
            return path, meta
    t0 = time.perf_counter()
    meta = {**want, **build_wav(path, kind, minutes)}
    meta.update(bytes=path.stat().st_size, duration_s=minutes * 60.0, build_s=round(time.perf_counter() - t0, 1))
    meta_path.write_text(json.dumps(meta, indent=1))
    return path, meta


# ----------------------------------------------------------------------------- memory sampling
def _shm_bytes() -> int:
    """Bytes in ``/dev/shm/flashasr_*`` (our shared-memory segments that still have a name)."""
    total = 0
    try:
        for e in os.scandir("/dev/shm"):
            if e.name.startswith("flashasr_"):
                try:
                    total += e.stat().st_blocks * 512
                except OSError:
                    pass
    except OSError:
        pass
    return total


@dataclass
class Sample:
    t: float          # seconds since the sampler started
    rss: int          # bytes, sum over the tree
    procs: int        # processes in the tree
    pss: int | None = None  # bytes, sum over the tree (every PSS_EVERY-th sample)
    shm: int | None = None  # bytes in /dev/shm/flashasr_* (with PSS)


class TreeSampler:
    """Samples the process tree of ``pid`` in a thread: sum of RSS every ``interval`` seconds,
    sum of PSS and the named shared memory every ``pss_every``-th sample. ``mark(name)`` notes a
    phase boundary (peaks are reported per phase: the samples from one mark to the next)."""

    def __init__(self, pid: int, interval: float = 0.05, pss_every: int = 5):
        self.root = psutil.Process(pid)
        self.interval, self.pss_every = interval, pss_every
        self.samples: list[Sample] = []
        self.marks: list[tuple[str, int]] = [("start", 0)]
        self._stop = threading.Event()
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _tree(self) -> list[psutil.Process]:
        try:
            return [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            return []

    def _take(self, with_pss: bool) -> Sample | None:
        rss, pss, n = 0, 0, 0
        for p in self._tree():
            try:
                if with_pss:
                    mi = p.memory_full_info()
                    pss += mi.pss
                else:
                    mi = p.memory_info()
                rss += mi.rss
                n += 1
            except psutil.Error:
                pass  # exited meanwhile
        if n == 0:
            return None
        return Sample(round(time.perf_counter() - self._t0, 3), rss, n,
                      pss if with_pss else None, _shm_bytes() if with_pss else None)

    def _run(self) -> None:
        k = 0
        while not self._stop.is_set():
            s = self._take(k % self.pss_every == 0)
            if s is not None:
                self.samples.append(s)
            k += 1
            self._stop.wait(self.interval)

    def mark(self, name: str) -> None:
        """A new phase starts now (the next sample belongs to it)."""
        self.marks.append((name, len(self.samples)))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def phase(self, name: str) -> list[Sample]:
        """The samples of phase ``name`` (from its mark to the next)."""
        bounds = [i for _, i in self.marks] + [len(self.samples)]
        for k, (n, _) in enumerate(self.marks):
            if n == name:
                return self.samples[bounds[k]:bounds[k + 1]]
        return []


def peaks(samples: list[Sample]) -> dict:
    """Peak RSS, PSS and named shared memory (MiB) over ``samples``, and the most processes."""
    def top(vals):
        vals = [v for v in vals if v is not None]
        return round(max(vals) / MIB, 1) if vals else None

    return {"rss_mib": top(s.rss for s in samples), "pss_mib": top(s.pss for s in samples),
            "shm_mib": top(s.shm for s in samples), "procs": max((s.procs for s in samples), default=0),
            "samples": len(samples)}


def trace(samples: list[Sample], step_s: float = 1.0) -> list[list]:
    """The samples thinned to at most one per ``step_s``: ``[t, rss_mib, pss_mib]`` (the peak of
    each step, so the thinned trace keeps the maxima)."""
    out: dict[int, list] = {}
    for s in samples:
        k = int(s.t // step_s)
        row = out.setdefault(k, [round(k * step_s, 1), 0.0, None])
        row[1] = max(row[1], round(s.rss / MIB, 1))
        if s.pss is not None:
            row[2] = max(row[2] or 0.0, round(s.pss / MIB, 1))
    return [out[k] for k in sorted(out)]


# ----------------------------------------------------------------------------- doors
def _env() -> dict:
    """The doors' environment: this tree's ``src`` first on PYTHONPATH (so its code runs)."""
    src = str(REPO / "src")
    pp = os.environ.get("PYTHONPATH", "")
    return dict(os.environ, PYTHONPATH=src + (os.pathsep + pp if pp else ""), PYTHONUNBUFFERED="1")


def _wait4(proc: subprocess.Popen) -> tuple[int, int]:
    """Reap ``proc``: ``(exit status, its ru_maxrss in bytes)``."""
    _, status, ru = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, ru.ru_maxrss * 1024


@dataclass
class DoorResult:
    door: str
    wall_s: float
    peak: dict
    text_chars: int
    ok: bool
    ru_maxrss_root_mib: float | None = None
    idle: dict | None = None
    request_peak: dict | None = None
    ready_s: float | None = None
    server_timing: str | None = None
    error: str | None = None
    trace: list = field(default_factory=list)


def run_cli(wav: Path, model: str, interval: float, log: Path, extra: tuple[str, ...] = (),
            door: str = "cli") -> DoorResult:
    """``flashasr transcribe WAV`` (+ ``extra`` options) as a process: its tree's peak memory and
    wall time."""
    cmd = [sys.executable, "-m", "flashasr", "transcribe", str(wav), "--model", model, "-q", *extra]
    t0 = time.perf_counter()
    with open(log, "wb") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=_env())
    sampler = TreeSampler(proc.pid, interval)
    out = proc.stdout.read().decode("utf-8", "replace")  # the transcript (drained while it runs)
    proc.stdout.close()
    sampler.stop()
    rc, maxrss = _wait4(proc)
    wall = time.perf_counter() - t0
    ok = rc == 0 and len(out.strip()) > 0
    return DoorResult(door, round(wall, 1), peaks(sampler.samples), len(out.strip()), ok,
                      round(maxrss / MIB, 1), error=None if ok else f"exit {rc}: {log.read_text()[-2000:]}",
                      trace=trace(sampler.samples))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(base: str, proc: subprocess.Popen, timeout: float) -> None:
    import httpx

    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited early (status {proc.returncode})")
        try:
            if httpx.get(base + "/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"server not ready after {timeout:g} s")


def _post(base: str, wav: Path) -> tuple[int, dict | str, str | None]:
    """One ``POST /v1/audio/transcriptions`` of ``wav`` (the file streamed from disk):
    ``(status, JSON body or text, Server-Timing)``."""
    import httpx

    with open(wav, "rb") as f:
        r = httpx.post(base + "/v1/audio/transcriptions", files={"file": (wav.name, f, "audio/wav")},
                       data={"response_format": "json"}, timeout=None)
    try:
        body = r.json()
    except ValueError:
        body = r.text
    return r.status_code, body, r.headers.get("server-timing")


def run_server(wav: Path, model: str, mode: str, interval: float, log: Path, idle_s: float = 3.0) -> DoorResult:
    """``flashasr serve --mode MODE`` and one upload of ``wav``: peak over the server's life, its
    idle tree before the upload, the peak during the request, wall times."""
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "flashasr", "serve", "--port", str(port), "--model", model, "--mode", mode,
           "--request-timeout-s", "86400", "--no-access-log"]
    t0 = time.perf_counter()
    with open(log, "wb") as err:
        proc = subprocess.Popen(cmd, stdout=err, stderr=subprocess.STDOUT, env=_env(), start_new_session=True)
    sampler = TreeSampler(proc.pid, interval)
    status, body, timing, error = None, "", None, None
    try:
        _wait_ready(base, proc, timeout=600)
        ready_s = time.perf_counter() - t0
        time.sleep(idle_s / 2)  # let start-up settle (warm-up garbage, forkserver)
        sampler.mark("idle")
        time.sleep(idle_s / 2)
        sampler.mark("request")
        t1 = time.perf_counter()
        status, body, timing = _post(base, wav)
        wall = time.perf_counter() - t1
        sampler.mark("after")
    except Exception as e:  # noqa: BLE001 - reported in the result
        ready_s, wall, error = None, time.perf_counter() - t0, f"{type(e).__name__}: {e}"
    finally:
        sampler.stop()
        _stop(proc)
    text = body.get("text", "") if isinstance(body, dict) else ""
    ok = error is None and status == 200 and len(text.strip()) > 0
    if error is None and not ok:
        error = f"HTTP {status}: {str(body)[:500]}"
    if error:
        error += "\n" + log.read_text(errors="replace")[-2000:]
    return DoorResult(mode, round(wall, 1), peaks(sampler.samples), len(text.strip()), ok,
                      idle=peaks(sampler.phase("idle")), request_peak=peaks(sampler.phase("request")),
                      ready_s=None if ready_s is None else round(ready_s, 1), server_timing=timing, error=error,
                      trace=trace(sampler.samples))


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL after 20 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


# ----------------------------------------------------------------------------- report
def machine() -> dict:
    """CPU, cores, memory, kernel, load average now."""
    from bench_cpu_audio import cpu_info

    return {"cpu": cpu_info(), "cores": os.cpu_count(), "mem_total_mib": round(psutil.virtual_memory().total / MIB),
            "kernel": platform.release(), "python": platform.python_version(), "loadavg": os.getloadavg()}


def git_commit() -> dict:
    """HEAD of this tree and whether tracked files differ from it."""
    def git(*a):
        return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()

    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def ratios(doors: dict[str, DoorResult]) -> dict:
    """Each server door's peak (RSS and PSS) over the CLI's, and whether it meets the target."""
    cli = doors.get("cli")
    out = {}
    if cli is None or not cli.ok:
        return out
    for name, d in doors.items():
        if name.startswith("cli") or not d.ok:
            continue
        r = {k: round(d.peak[k] / cli.peak[k], 2) for k in ("rss_mib", "pss_mib") if d.peak[k] and cli.peak[k]}
        out[name] = {**r, "target": TARGET_RATIO, "met_rss": r.get("rss_mib", 9) <= TARGET_RATIO,
                     "met_pss": r.get("pss_mib", 9) <= TARGET_RATIO}
    return out


def print_table(label: str, meta: dict, doors: dict[str, DoorResult], rat: dict) -> None:
    """One table per recording: each door's peak, ratio, idle, request cost and times."""
    print(f"\n{label}: {meta['duration_s'] / 60:g} min ({meta['bytes'] / MIB:.0f} MiB WAV)")
    print(f"{'door':<7} {'peak RSS':>9} {'x CLI':>6} {'peak PSS':>9} {'x CLI':>6} {'idle RSS':>9} "
          f"{'req +RSS':>9} {'wall s':>7} {'chars':>7}")
    for name, d in doors.items():
        if not d.ok:
            print(f"{name:<7} FAILED: {(d.error or '')[:200]}")
            continue
        r = rat.get(name, {})
        idle = d.idle["rss_mib"] if d.idle else None
        cost = round(d.request_peak["rss_mib"] - idle, 1) if d.idle and d.request_peak["rss_mib"] else None
        print(f"{name:<7} {d.peak['rss_mib']:>9} {r.get('rss_mib', '-')!s:>6} {d.peak['pss_mib']!s:>9} "
              f"{r.get('pss_mib', '-')!s:>6} {idle if idle is not None else '-'!s:>9} "
              f"{cost if cost is not None else '-'!s:>9} {d.wall_s:>7} {d.text_chars:>7}")
    for name, r in rat.items():
        print(f"  {name}: {r['rss_mib']}x the CLI's peak RSS (PSS {r.get('pss_mib')}x): target <= {TARGET_RATIO}x "
              f"{'met' if r['met_rss'] else 'NOT met'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=60.0, help="length of the dense recording (default 60)")
    ap.add_argument("--sparse-minutes", type=float, default=240.0, help="length of the sparse one (default 240)")
    ap.add_argument("--sets", default="dense,sparse", help="recordings to run: dense, sparse or both")
    ap.add_argument("--doors", default="cli,single,multi",
                    help="doors to measure: cli, single, multi (the default) and cli_batch1")
    ap.add_argument("--model", default="tiny.en", help="model for every door (default tiny.en, the embedded default)")
    ap.add_argument("--interval-ms", type=float, default=50.0, help="RSS sampling interval (default 50)")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "flashasr" / "bench_upload_memory",
                    help="where the WAVs are built and kept")
    ap.add_argument("--smoke", action="store_true", help="2 minutes of dense audio only (a quick check)")
    ap.add_argument("--out", type=Path, default=None, help="result JSON (default bench/results/upload_memory_cpu.json)")
    a = ap.parse_args()
    sys.path.insert(0, str(REPO / "src"))
    sys.path.insert(0, str(REPO / "bench"))
    if a.smoke:
        a.minutes, a.sets = 2.0, "dense"
    out = a.out or RESULTS / f"upload_memory_cpu{'_smoke' if a.smoke else ''}.json"
    from bench_cpu_audio import versions

    result = {"bench": "bench/bench_upload_memory.py", "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
              "machine": machine(), "versions": versions(), "git": git_commit(),
              "conditions": {"model": a.model, "device": "cpu", "interval_ms": a.interval_ms, "pss_every": 5,
                             "doors": a.doors, "target_ratio": TARGET_RATIO,
                             "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "FLASHASR_DECODE_WORKERS")},
                             "memory": "peak over the sampled process tree (root + descendants): sum of RSS; "
                                       "sum of PSS every 5th sample; /dev/shm/flashasr_* bytes"},
              "recordings": {}}
    logs = Path(a.cache) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for kind in [s.strip() for s in a.sets.split(",") if s.strip()]:
        minutes = a.minutes if kind == "dense" else a.sparse_minutes
        wav, meta = cached_wav(a.cache, kind, minutes)
        doors: dict[str, DoorResult] = {}
        loads = {}
        for door in [d.strip() for d in a.doors.split(",") if d.strip()]:
            loads[door] = {"before": os.getloadavg()}
            log = logs / f"{kind}_{door}.log"
            if door == "cli":
                doors[door] = run_cli(wav, a.model, a.interval_ms / 1000, log)
            elif door == "cli_batch1":
                doors[door] = run_cli(wav, a.model, a.interval_ms / 1000, log, ("--batch-size", "1"), door)
            else:
                doors[door] = run_server(wav, a.model, door, a.interval_ms / 1000, log)
            loads[door]["after"] = os.getloadavg()
            print(f"  {kind} {door}: peak RSS {doors[door].peak['rss_mib']} MiB, {doors[door].wall_s} s"
                  f"{'' if doors[door].ok else ' FAILED'}", flush=True)
        rat = ratios(doors)
        result["recordings"][kind] = {"audio": meta, "path": str(wav), "loadavg": loads, "ratios": rat,
                                      "doors": {k: asdict(v) for k, v in doors.items()}}
        print_table(kind, meta, doors, rat)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {out.relative_to(REPO) if out.is_relative_to(REPO) else out}")


if __name__ == "__main__":
    main()
