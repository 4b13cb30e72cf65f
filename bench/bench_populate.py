"""Mapping decoded samples from shared memory with every page faulted in, and the GIL (issue #12).

The job's decode workers hand samples over in POSIX shared memory; the main process
(:func:`flashasr.shm.take_array`) and the job's model process (``_Maps`` in
:mod:`flashasr.pipeline.model_process`) map them with every page faulted in, so the first pass
over the samples takes no page faults. Two ways of doing that, each measured here on segments of
``--sizes-mb``:

* ``map_populate``: ``mmap.mmap(..., flags=MAP_SHARED | MAP_POPULATE)``: the kernel faults the
  pages in inside the ``mmap`` call, which CPython makes holding the GIL;
* ``madvise``: a plain mapping, then :func:`flashasr.shm.populate` (``madvise(MADV_POPULATE_READ)``
  through ctypes, which releases the GIL);
* ``lazy``: a plain mapping, pages faulted in by the first pass (for reference).

Per way and size: the mapping's wall time alone; the first pass (``np.isfinite(x).all()``, as the
model's check) after it; and how long another thread waits for the GIL while mappings run: a
probe thread sleeps 200 us in a loop beside a loop of mappings and records how late it wakes (it
needs the GIL to go on; a C call that keeps the GIL delays it by the call's length, Python code by
at most the switch interval). Reported: the probe's p50 / p99 / max lateness, the same with the
probe beside a thread that only sleeps (``idle``: the machine's own wake-up noise). Alternating
repeats, medians.

    python bench/bench_populate.py            # writes bench/results/populate_cpu.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import sys
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from flashasr.shm import populate  # noqa: E402

WAYS = ("map_populate", "madvise", "lazy")


def _segment(size: int) -> str:
    import _posixshmem

    name = f"/flashasr_bench_populate_{os.getpid()}_{size}"
    fd = _posixshmem.shm_open(name, os.O_CREAT | os.O_RDWR, mode=0o600)
    try:
        os.ftruncate(fd, size)
        with mmap.mmap(fd, size) as m:
            np.frombuffer(m, np.float32)[:] = 0.25  # the pages exist in the segment, as a worker leaves them
    except BaseException:
        _posixshmem.shm_unlink(name)
        raise
    finally:
        os.close(fd)
    return name


def _map(name: str, size: int, way: str) -> np.ndarray:
    import _posixshmem

    fd = _posixshmem.shm_open(name, os.O_RDONLY, mode=0o600)
    try:
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if way == "map_populate" else 0)
        m = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    if way == "madvise" and not populate(m):
        raise RuntimeError("madvise(MADV_POPULATE_READ) is not available here")
    return np.frombuffer(m, np.float32)


def _probe_lateness(work, seconds: float) -> np.ndarray:
    """How late (s) a thread sleeping 200 us at a time wakes while ``work`` runs in a loop here."""
    stop, late = [False], []

    def probe():
        while not stop[0]:
            t = time.perf_counter()
            time.sleep(0.0002)
            late.append(time.perf_counter() - t - 0.0002)

    t = threading.Thread(target=probe)
    t.start()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        work()
    stop[0] = True
    t.join()
    return np.asarray(late)


def _stats_us(late: np.ndarray) -> dict:
    return {"p50_us": round(1e6 * float(np.percentile(late, 50)), 1),
            "p99_us": round(1e6 * float(np.percentile(late, 99)), 1), "max_us": round(1e6 * float(late.max()), 1)}


def measure(size_mb: float, repeats: int, seconds: float) -> dict:
    size = max(mmap.PAGESIZE, int(size_mb * 2**20) // mmap.PAGESIZE * mmap.PAGESIZE)
    name = _segment(size)
    try:
        out = {}
        for way in WAYS:
            alone, first = [], []
            for _ in range(max(3, repeats)):
                t = time.perf_counter()
                x = _map(name, size, way)
                alone.append(time.perf_counter() - t)
                t = time.perf_counter()
                bool(np.isfinite(x).all())
                first.append(time.perf_counter() - t)
                del x
            out[way] = {"map_ms": round(1e3 * float(np.median(alone)), 3),
                        "first_pass_ms": round(1e3 * float(np.median(first)), 3)}
        late: dict[str, list] = {w: [] for w in ("idle", *WAYS)}
        for _ in range(repeats):  # alternate: the machine's other load shifts all alike
            late["idle"].append(_stats_us(_probe_lateness(lambda: time.sleep(0.001), seconds)))
            for way in WAYS:
                late[way].append(_stats_us(_probe_lateness(lambda: _map(name, size, way), seconds)))
        med = {w: {k: round(float(np.median([r[k] for r in rs])), 1) for k in ("p50_us", "p99_us", "max_us")}
               for w, rs in late.items()}
        for way in WAYS:
            out[way]["probe_late"] = med[way]
        return {"size_mb": round(size / 2**20, 3), "probe_late_idle": med["idle"], **out}
    finally:
        import _posixshmem

        _posixshmem.shm_unlink(name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-mb", default="0.67,5.4,64", help="segment sizes: 11 s of float32 at 16 kHz, "
                    "8 of them, a model call's worth")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=1.0, help="length of each probe measurement")
    ap.add_argument("--switch-interval", type=float, default=0.0001,
                    help="sys.setswitchinterval during the run (s): short, so the probe gets the GIL "
                         "whenever the mapping thread can let it go")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "populate_cpu.json"))
    args = ap.parse_args(argv)
    try:
        sizes = [float(s) for s in args.sizes_mb.split(",") if s.strip()]
    except ValueError:
        ap.error(f"--sizes-mb: numbers in MB, comma separated (got {args.sizes_mb!r})")
    import math

    if not sizes or args.repeats < 1 or not all(math.isfinite(v) and v > 0 for v in
                                                 (*sizes, args.seconds, args.switch_interval)):
        ap.error("sizes, --repeats, --seconds and --switch-interval must be finite and positive")
    if max(sizes) > 4096:
        ap.error("--sizes-mb: at most 4096 MB a segment")
    if not sys.platform.startswith("linux"):
        print("bench_populate.py needs Linux (MAP_POPULATE, MADV_POPULATE_READ)", file=sys.stderr)
        return 2
    sys.setswitchinterval(args.switch_interval)
    rows = [measure(s, args.repeats, args.seconds) for s in sizes]
    print(f"{'MB':>7} {'way':>13} {'map ms':>8} {'first pass ms':>14} {'probe late p50/p99/max us':>27}")
    for r in rows:
        i = r["probe_late_idle"]
        print(f"{r['size_mb']:>7} {'(idle)':>13} {'':>8} {'':>14} {i['p50_us']:>9}/{i['p99_us']}/{i['max_us']}")
        for way in WAYS:
            w, q = r[way], r[way]["probe_late"]
            print(f"{r['size_mb']:>7} {way:>13} {w['map_ms']:>8} {w['first_pass_ms']:>14} "
                  f"{q['p50_us']:>9}/{q['p99_us']}/{q['max_us']}")
    res = {"benchmark": "populate", "env": {"time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                            "python": platform.python_version(), "platform": platform.platform(),
                                            "cpus": os.cpu_count(), "load_average": os.getloadavg()},
           "conditions": {"repeats": args.repeats, "seconds": args.seconds, "switch_interval_s": args.switch_interval,
                          "segment": "POSIX shared memory, every page written before (as a decode worker leaves "
                                     "it), mapped read-only"},
           "results": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
