"""bench/bench_serve.py's server process: it does not outlive a benchmark killed with SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_child_started_with_term_with_parent_stops_when_its_parent_is_killed():
    """The benchmark process (here a stand-in) dies by SIGKILL: its server child, in a session of its
    own (so no terminal or group signal reaches it), gets SIGTERM and ends."""
    parent = subprocess.Popen(
        [sys.executable, "-c",
         "import subprocess, sys, time; sys.path.insert(0, sys.argv[1]); from bench_serve import _term_with_parent\n"
         "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True, "
         "preexec_fn=_term_with_parent)\nprint(c.pid, flush=True); time.sleep(60)", str(BENCH)],
        stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        assert _alive(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        t_end = time.time() + 10
        while _alive(child) and time.time() < t_end:
            time.sleep(0.05)
        assert not _alive(child), "the child outlived its killed parent"
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


def test_the_benchmark_server_is_started_with_it(monkeypatch, tmp_path):
    import bench_serve

    seen = {}

    class Exited:
        def __init__(self, *a, **kw):
            seen.update(kw)

        def poll(self):
            return 1

    monkeypatch.setattr(bench_serve.subprocess, "Popen", Exited)
    with pytest.raises(RuntimeError, match="exited early"):
        bench_serve.Server(["--model", "x"], tmp_path / "log.txt", ready_timeout=1)
    assert seen["preexec_fn"] is bench_serve._term_with_parent and seen["start_new_session"]
