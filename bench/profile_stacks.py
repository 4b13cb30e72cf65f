"""Where the CPU time of a profiled job goes: py-spy's raw (collapsed) stacks -> a table per role.

Input: ``py-spy record --subprocesses --threads --format raw`` of a process tree that ran
:func:`flashasr.jobs.run_job` (e.g. ``scripts/gpu_profile_jobs.sh``). Every line is
``process PID:"cmd";thread (TID): NAME;frame;...;frame COUNT``; py-spy samples only threads that
are running (not waiting), so COUNT / rate is CPU-busy seconds.

Roles: ``main thread`` -- the root process's MainThread, only stacks under ``run_job`` (model
loading and calibration left out); ``decode workers`` -- every child process (the job's forked
decode/plan workers); ``other threads`` -- the root process's other threads (pool callbacks,
NVML sampler, torch). For each role: busy seconds, the functions where the time is spent (self,
the leaf frame) and the flashasr functions that hold it (inclusive).

    python bench/profile_stacks.py profile_jobs.txt --rate 100 --json-out bench/results/profile_jobs_h200.json
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter, defaultdict
from pathlib import Path

_FRAME = re.compile(r"^(?P<fn>.*) \((?P<file>[^():]+)(?::\d+)?\)$")


def parse(path: Path):
    """Yield (pid, is a child process, thread name, [frames root->leaf], count) per line of a raw
    py-spy file (``--threads``; with ``--subprocesses`` a child's stacks start with its parents')."""
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        stack, _, count = line.rpartition(" ")
        parts = stack.split(";")
        procs = []
        while parts and parts[0].startswith("process "):  # a child process is nested under its parent
            procs.append(int(re.match(r"process (\d+)", parts.pop(0)).group(1)))
        thread = parts.pop(0).split(": ", 1)[-1] if parts and parts[0].startswith("thread ") else "?"
        yield (procs[-1] if procs else -1), len(procs) > 1, thread, parts, int(count)


def _name(frame: str) -> str:
    m = _FRAME.match(frame)
    return f"{m.group('fn')} ({m.group('file')})" if m else frame


def summarize(path: Path, rate: float, top: int = 15) -> dict:
    roles: dict[str, dict] = defaultdict(lambda: {"samples": 0, "self": Counter(), "ours": Counter()})
    for _pid, child, thread, frames, n in parse(path):
        if child:
            role = "decode workers"
        elif thread == "MainThread":
            if not any(f.startswith("run_job ") for f in frames):
                continue
            role = "main thread"
        else:
            role = "other threads"
        r = roles[role]
        r["samples"] += n
        if frames:
            r["self"][_name(frames[-1])] += n
        for f in {_name(f) for f in frames if "flashasr/" in f}:
            r["ours"][f] += n
    out = {}
    for role, r in roles.items():
        total = max(1, r["samples"])
        out[role] = {
            "busy_s": round(r["samples"] / rate, 3),
            "self": [(f, round(c / rate, 3), round(100 * c / total, 1)) for f, c in r["self"].most_common(top)],
            "flashasr_inclusive": [(f, round(c / rate, 3), round(100 * c / total, 1))
                                   for f, c in r["ours"].most_common(top)],
        }
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("raw", type=Path)
    ap.add_argument("--rate", type=float, default=100.0, help="py-spy's --rate (samples per second)")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--json-out", type=Path, default=None)
    a = ap.parse_args(argv)
    s = summarize(a.raw, a.rate, a.top)
    for role, r in sorted(s.items()):
        print(f"\n== {role}: {r['busy_s']:.2f} CPU-busy s")
        print("   self (leaf frame)                                                      s      %")
        for f, sec, pct in r["self"]:
            print(f"   {f[:68]:68} {sec:7.2f} {pct:6.1f}")
        print("   flashasr functions (inclusive)")
        for f, sec, pct in r["flashasr_inclusive"][:10]:
            print(f"   {f[:68]:68} {sec:7.2f} {pct:6.1f}")
    if a.json_out:
        a.json_out.write_text(json.dumps({"source": str(a.raw), "rate_hz": a.rate, "roles": s}, indent=1))
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except BrokenPipeError:  # | head
        raise SystemExit(0)
