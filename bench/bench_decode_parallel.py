"""One long file decoded on several cores: ``load_audio_parallel`` vs sequential ``load_audio``.

Builds (once, cached in ``--cache-dir``) a long mp3 (44.1 kHz stereo, 128 kb/s CBR, libmp3lame)
and a long ogg/opus (48 kHz mono, 32 kb/s, libopus) by cycling the real speech clips of
../shared/audio (English read, conversational and long clips; the right channel of the mp3 is half
the left, half the left 7 s later: never anti-correlated), encoded with PyAV in streaming fashion. For each file:

* sequential ``load_audio`` (decode + downmix + soxr HQ to 16 kHz mono float32): wall and CPU s;
* ``load_audio_parallel`` with 1, 2, 4, 8, 16 workers (those <= the CPU count, or ``--workers``),
  threads (the module's shared pool): wall s, speed-up, and the join check against the
  sequential output (same length, max |difference|, whether any range fell back);
* threads vs a forked ``ProcessPoolExecutor`` (output through shared memory) at the largest
  worker count, wall s;

(A spinner thread measuring the GIL share of a decode was dropped: PyAV's per-frame calls give the
GIL up and wait up to the 5 ms switch interval to get it back, so a decode beside one busy
Python thread ran 300x slower -- 100 s instead of 0.3 s for 300 s of mp3 on the dev VM.)

Prints a short table and writes ``bench/results/decode_parallel_<hostname>.json``.
Usage: ``python bench/bench_decode_parallel.py [--seconds 3600] [--repeats 3]``
(on the 2-core dev VM: ``--seconds 600``).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import platform
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "bench"))
SHARED = Path(os.environ.get("FLASHASR_SHARED", REPO.parent / "shared"))
AUDIO = SHARED / "audio"

import flashasr.audio.parallel as par  # noqa: E402
from flashasr.audio import load_audio, load_audio_parallel  # noqa: E402

from bench_cpu_audio import cpu_info, versions  # noqa: E402

FILES = {  # name: (container, extension, encoder, rate, channels, bit rate)
    "mp3": ("mp3", "mp3", "libmp3lame", 44100, 2, 128000),
    "opus": ("ogg", "opus", "libopus", 48000, 1, 32000),
}
FILES_BY_EXT = {ext: fmt for fmt, ext, *_ in FILES.values()}


def speech_clips(rate: int) -> list[np.ndarray]:
    """The English and long clips of ../shared/audio at ``rate`` Hz, mono float32."""
    clips = [json.loads(line) for line in (AUDIO / "manifest.jsonl").read_text().splitlines() if line.strip()]
    keep = [c for c in clips if c["category"] in ("en_read", "en_conversational", "long")
            and (AUDIO / c["path"]).is_file()]  # a partial copy of the folder (the device) has fewer
    return [load_audio(AUDIO / c["path"], target_rate=rate).samples for c in keep]


def blocks(clips: list[np.ndarray], seconds: float, rate: int, channels: int, block: int = 1 << 16):
    """float32 [n, channels] blocks of the clips cycled up to ``seconds``."""
    total = int(seconds * rate)
    done = 0
    i = 0
    while done < total:
        x = clips[i % len(clips)][: total - done]
        i += 1
        if channels == 2:
            right = 0.5 * x + 0.5 * np.roll(x, 7 * rate)  # never anti-correlated: the downmix stays the mean
            x = np.stack([x, right], axis=1)
        else:
            x = x[:, None]
        for s in range(0, x.shape[0], block):
            yield x[s:s + block]
        done += x.shape[0]


#: Longer files are this much speech encoded once, then its packets repeated (remux, no re-encode:
#: an hour of 44.1 kHz stereo mp3 took over 4 minutes to encode on the H200 machine's cores).
ENCODE_ONCE_S = 600.0


def encode_long(path: Path, name: str, seconds: float) -> None:
    """The speech clips cycled to ``seconds`` in ``FILES[name]``'s format; beyond
    :data:`ENCODE_ONCE_S`, the packets of an encoded ``ENCODE_ONCE_S`` part repeated with
    continuous timestamps (the content repeats; every packet and timestamp is valid)."""
    if seconds > ENCODE_ONCE_S:
        part = path.with_name(path.stem + f"_part{int(ENCODE_ONCE_S)}s" + path.suffix)
        if not part.exists():
            _encode(part, name, ENCODE_ONCE_S)
        _repeat_packets(part, path, seconds)
        return
    _encode(path, name, seconds)


def _repeat_packets(src: Path, dst: Path, seconds: float) -> None:
    import av

    tmp = dst.with_suffix(".part")
    with av.open(str(src)) as inp:
        ist = inp.streams.audio[0]
        with av.open(str(tmp), mode="w", format=FILES_BY_EXT[dst.suffix[1:]]) as out:
            ost = out.add_stream_from_template(ist)
            tb = ist.time_base
            packets = [(bytes(p), p.duration) for p in inp.demux(ist) if p.size]
            inp.seek(0)
            first = next(p.pts for p in inp.demux(ist) if p.size)
            limit = first + int(seconds / tb)
            t = first  # timestamps run on without a gap from one repetition to the next
            # the encoder's first packet carries its pre-roll and its last one the end trimming: a
            # repetition takes neither, so every packet inside the file holds one whole frame
            body = packets[1:-1] if len(packets) > 2 else packets
            reps = 0
            while t < limit:
                for data, dur in (packets[:-1] if reps == 0 else body):
                    if t >= limit:
                        break
                    pkt = av.Packet(data)  # a fresh packet each time: muxing takes its buffer
                    pkt.pts = pkt.dts = t
                    pkt.duration = dur
                    pkt.time_base = tb
                    pkt.stream = ost
                    out.mux(pkt)
                    t += dur
                reps += 1
    tmp.rename(dst)


def _encode(path: Path, name: str, seconds: float) -> None:
    import av

    fmt, _, codec, rate, channels, bit_rate = FILES[name]
    clips = speech_clips(rate)
    layout = "stereo" if channels == 2 else "mono"
    tmp = path.with_suffix(".part")
    with av.open(str(tmp), mode="w", format=fmt) as out:
        st = out.add_stream(codec, rate=rate)
        st.layout = layout
        fmts = [f.name for f in st.codec_context.codec.audio_formats]
        fmt16 = "s16" if "s16" in fmts else "s16p"  # libmp3lame takes planar only
        st.format = fmt16
        st.bit_rate = bit_rate
        pts = 0
        for b in blocks(clips, seconds, rate, channels):
            a = np.round(np.clip(b, -1, 1) * 32767).astype(np.int16)
            a = a.reshape(1, -1) if fmt16 == "s16" else np.ascontiguousarray(a.T)
            frame = av.AudioFrame.from_ndarray(a, format=fmt16, layout=layout)
            frame.sample_rate = rate
            frame.pts = pts
            pts += b.shape[0]
            for pkt in st.encode(frame):
                out.mux(pkt)
        for pkt in st.encode(None):
            out.mux(pkt)
    tmp.rename(path)


def timed(fn, repeats: int):
    best_wall, best_cpu, result = float("inf"), float("inf"), None
    for _ in range(repeats):
        c, t = time.process_time(), time.perf_counter()
        result = fn()
        best_wall = min(best_wall, time.perf_counter() - t)
        best_cpu = min(best_cpu, time.process_time() - c)
        result = result if result is not None else None
    return best_wall, best_cpu, result


class FallbackSpy:
    """Counts parallel attempts that fell back to the sequential decode."""

    def __init__(self):
        self.fallbacks: list[str] = []
        self.real = par._run

    def __enter__(self):
        def run(plan, src, pool):
            try:
                return self.real(plan, src, pool)
            except par._Fallback as e:
                self.fallbacks.append(str(e))
                raise

        par._run = run
        return self

    def __exit__(self, *exc):
        par._run = self.real


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=3600.0, help="length of each test file")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", default=None, help="comma-separated worker counts (default 1,2,4,8,16 <= cores)")
    ap.add_argument("--codecs", default="mp3,opus")
    ap.add_argument("--cache-dir", default=None, help="keep the encoded files here (default: a temp dir)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    cores = os.cpu_count() or 1
    counts = ([int(w) for w in args.workers.split(",")] if args.workers
              else [n for n in (1, 2, 4, 8, 16) if n <= cores])
    t_start = time.time()
    load_before = os.getloadavg()
    tmpdir = None
    if args.cache_dir:
        cache = Path(args.cache_dir)
        cache.mkdir(parents=True, exist_ok=True)
    else:
        tmpdir = tempfile.TemporaryDirectory()
        cache = Path(tmpdir.name)
    rows = []
    for name in args.codecs.split(","):
        fmt, ext, codec, rate, channels, bit_rate = FILES[name]
        path = cache / f"speech_{int(args.seconds)}s_{name}.{ext}"
        t = time.perf_counter()
        if not path.exists():
            print(f"encoding {path.name} ...", flush=True)
            encode_long(path, name, args.seconds)
        print(f"{name}: encoded in {time.perf_counter() - t:.1f} s; timing ...", flush=True)
        encode_s = time.perf_counter() - t
        seq_wall, seq_cpu, ref = timed(lambda: load_audio(path), args.repeats)
        row = {"codec": name, "file": {"container": fmt, "encoder": codec, "rate": rate, "channels": channels,
                                       "bit_rate": bit_rate, "bytes": path.stat().st_size,
                                       "audio_s": round(ref.duration, 2), "encode_wall_s": round(encode_s, 1)},
               "sequential": {"wall_s": round(seq_wall, 3), "cpu_s": round(seq_cpu, 3),
                              "rtfx": round(ref.duration / seq_wall, 1)},
               "parallel_threads": []}
        for n in counts:
            with FallbackSpy() as spy:
                wall, cpu, got = timed(lambda: load_audio_parallel(path, workers=n), args.repeats)
            same_len = len(got) == len(ref)
            print(f"{name}: {n} workers {wall:.3f} s (sequential {seq_wall:.3f} s)", flush=True)
            row["parallel_threads"].append({
                "workers": n, "wall_s": round(wall, 3), "cpu_s": round(cpu, 3),
                "speedup": round(seq_wall / wall, 2), "rtfx": round(ref.duration / wall, 1),
                "same_length": same_len,
                "max_abs_diff": float(np.abs(got.samples - ref.samples).max()) if same_len else None,
                "fell_back": spy.fallbacks[:1]})
        n = max(counts)
        if n >= 2:
            ctx = __import__("multiprocessing").get_context("fork")
            with cf.ProcessPoolExecutor(n, mp_context=ctx) as ex:
                list(ex.map(int, range(n)))  # start every process before timing
                with FallbackSpy() as spy:
                    wall, cpu, got = timed(lambda: load_audio_parallel(path, workers=n, pool=ex), args.repeats)
            same_len = len(got) == len(ref)
            row["parallel_processes"] = {
                "workers": n, "wall_s": round(wall, 3), "parent_cpu_s": round(cpu, 3),
                "speedup": round(seq_wall / wall, 2), "same_length": same_len,
                "max_abs_diff": float(np.abs(got.samples - ref.samples).max()) if same_len else None,
                "fell_back": spy.fallbacks[:1]}
        rows.append(row)
    if tmpdir is not None:
        tmpdir.cleanup()

    host = socket.gethostname()
    result = {
        "benchmark": "decode_parallel",
        "machine": {"hostname": host, "cpu": cpu_info(), "cores": cores, "platform": platform.platform(),
                    "load_average_1_5_15_before": [round(v, 2) for v in load_before],
                    "load_average_1_5_15_after": [round(v, 2) for v in os.getloadavg()]},
        "versions": versions(),
        "conditions": {
            "audio": f"{args.seconds:g} s of real speech from ../shared/audio cycled; mp3 44.1 kHz stereo 128 kb/s "
                     "CBR (libmp3lame), ogg/opus 48 kHz mono 32 kb/s (libopus); output 16 kHz mono float32 (soxr HQ)",
            "timing": f"wall (perf_counter) and process CPU time, best of {args.repeats}; file in the page cache",
            "parallel": f"load_audio_parallel: ranges of the file decoded by threads (the module pool) or a forked "
                        f"ProcessPoolExecutor (output in shared memory); preroll {par.PREROLL_S} s, resampler "
                        f"context {par.CONTEXT_S} s",
            "note": "shared development machine: other processes compete (see load_average)",
        },
        "results": rows,
        "elapsed_s": round(time.time() - t_start, 1),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    out = Path(args.out) if args.out else REPO / "bench" / "results" / f"decode_parallel_{host}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")

    print(f"{'codec':6} {'audio':>7} {'workers':>8} {'pool':>8} {'wall s':>8} {'speedup':>8} {'RTFx':>7} {'max diff':>9}")
    for r in rows:
        a = r["file"]["audio_s"]
        print(f"{r['codec']:6} {a:>7.0f} {'seq':>8} {'-':>8} {r['sequential']['wall_s']:>8.3f} {1:>8.2f} "
              f"{r['sequential']['rtfx']:>7.0f} {'-':>9}")
        for p in r["parallel_threads"]:
            d = "-" if p["max_abs_diff"] is None else f"{p['max_abs_diff']:.1e}"
            fb = " (fell back)" if p["fell_back"] else ""
            print(f"{'':6} {'':>7} {p['workers']:>8} {'threads':>8} {p['wall_s']:>8.3f} {p['speedup']:>8.2f} "
                  f"{p['rtfx']:>7.0f} {d:>9}{fb}")
        p = r.get("parallel_processes")
        if p:
            d = "-" if p["max_abs_diff"] is None else f"{p['max_abs_diff']:.1e}"
            print(f"{'':6} {'':>7} {p['workers']:>8} {'procs':>8} {p['wall_s']:>8.3f} {p['speedup']:>8.2f} "
                  f"{a / p['wall_s']:>7.0f} {d:>9}")
    print(f"wrote {out} ({result['elapsed_s']} s)")


if __name__ == "__main__":
    main()
