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

_PROC = re.compile(r'process (\d+):"(?:[^"]*)";')
_FRAME = re.compile(r"^(?P<fn>.*) \((?P<file>[^():]+)(?::\d+)?\)$")


def parse(path: Path):
    """Yield (pid, is a child process, thread name, [frames root->leaf], count) per line of a raw
    py-spy file (``--threads``; with ``--subprocesses`` a child's stacks start with its parents')."""
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        stack, _, count = line.rpartition(" ")
        procs = []
        while m := _PROC.match(stack):  # a child process is nested under its parent (its command may hold ';')
            procs.append(int(m.group(1)))
            stack = stack[m.end():]
        parts = stack.split(";")
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
    return _tables(roles, rate, top)


def _tables(roles: dict, rate: float, top: int) -> dict:
    out = {}
    for role, r in roles.items():
        total = max(1, r["samples"])
        out[role] = {
            "busy_s": round(r["samples"] / rate, 3),
            **({"processes": len(r["pids"])} if "pids" in r else {}),
            "self": [(f, round(c / rate, 3), round(100 * c / total, 1)) for f, c in r["self"].most_common(top)],
            "flashasr_inclusive": [(f, round(c / rate, 3), round(100 * c / total, 1))
                                   for f, c in r["ours"].most_common(top)],
        }
    return out


STARTUP = ("load_and_warm ", "make_streamer ", "_find_and_load ", "_call_with_frames_removed ")  # a server's start


def summarize_server(path: Path, rate: float, top: int = 15, skip: tuple[str, ...] = STARTUP) -> dict:
    """The same tables for ``py-spy record --subprocesses --threads -- flashasr serve ...``, by server role:
    ``engine model thread`` (the scheduler's ``flashasr-model`` thread), ``engine event loop`` (the engine
    process's main thread: IPC and scheduling), ``engine other threads``, ``front ends`` (every worker
    process serving HTTP/WebSockets, all threads; ``processes`` counts them) and ``supervisor`` (the rest;
    in ``--mode single`` the one process is the engine). Stacks with a frame starting with one of ``skip``
    (model loading, warm-up, imports) are left out, so a profile of the server's whole life shows its
    serving."""
    lines = [ln for ln in parse(path) if not any(f.startswith(skip) for f in ln[3])]
    engine = {pid for pid, _c, thread, _f, _n in lines if thread.startswith("flashasr-model")}
    front = {pid for pid, _c, _t, frames, _n in lines if any("uvicorn/" in f or "serve/websocket.py" in f for f in frames)}
    roles: dict[str, dict] = defaultdict(lambda: {"samples": 0, "self": Counter(), "ours": Counter(), "pids": set()})
    for pid, _child, thread, frames, n in lines:
        if pid in engine:
            role = ("engine model thread" if thread.startswith("flashasr-model") else
                    "engine event loop" if thread == "MainThread" or thread.startswith("thread (") else
                    "engine other threads")
        else:
            role = "front ends" if pid in front else "supervisor"
        r = roles[role]
        r["samples"] += n
        r["pids"].add(pid)
        if frames:
            r["self"][_name(frames[-1])] += n
        for f in {_name(f) for f in frames if "flashasr/" in f}:
            r["ours"][f] += n
    return _tables(roles, rate, top)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("raw", type=Path)
    ap.add_argument("--rate", type=float, default=100.0, help="py-spy's --rate (samples per second)")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("--server", action="store_true", help="roles of a `flashasr serve` tree (summarize_server)")
    a = ap.parse_args(argv)
    s = (summarize_server if a.server else summarize)(a.raw, a.rate, a.top)
    for role, r in sorted(s.items()):
        print(f"\n== {role}: {r['busy_s']:.2f} CPU-busy s" + (f" ({r['processes']} processes)" if "processes" in r else ""))
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
