"""Helpers for the serving tests: start `flashasr serve` as a subprocess on a free loopback port."""

from __future__ import annotations

import io
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import wave
from pathlib import Path

import httpx
import numpy as np

from conftest import AUDIO

CLIP = AUDIO / "en" / "en-ls-61-70968-0002.wav"  # 2.97 s, 16 kHz mono s16le: "A GOLDEN FORTUNE AND A HAPPY LIFE"
CLIP_WORDS = "a golden fortune and a happy life".split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A `python -m flashasr.serve.app` subprocess on 127.0.0.1 (killed by :meth:`stop`); its stdout
    and stderr go to ``log_path``. ``port=0``: the server picks the port and its start-up line names it.
    With ``--ssl-certfile`` in ``args`` it speaks https (``base``; readiness polled without verifying).
    ``popen``: more keywords for :class:`subprocess.Popen` (``start_new_session=True``: a process group
    of its own, for a test that signals the whole group)."""

    def __init__(self, tmp: Path, *args: str, ready_timeout: float = 150.0, port: int | None = None, **popen):
        self.port = free_port() if port is None else port
        fd, name = tempfile.mkstemp(prefix="server-", suffix=".log", dir=tmp)
        self.log_path, self._log = Path(name), os.fdopen(fd, "wb")
        env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "flashasr.serve.app", "--port", str(self.port),
                                      "--log-level", "info", *args], stdout=self._log, stderr=subprocess.STDOUT,
                                     env=env, **popen)
        t_end = time.monotonic() + ready_timeout
        scheme = "https" if "--ssl-certfile" in args else "http"
        while not self.port:
            assert self.proc.poll() is None, f"server exited early:\n{self.log()}"
            m = re.search(r"listening on https?://127\.0\.0\.1:(\d+)", self.log())
            self.port = int(m.group(1)) if m else 0
            assert time.monotonic() < t_end, f"no start-up line after {ready_timeout} s:\n{self.log()}"
            time.sleep(0.1)
        self.base = f"{scheme}://127.0.0.1:{self.port}"
        in_a_row = 0  # /ready answers for the front end a connection reaches (multi mode: several
        while True:   # behind one port, each connecting to the engine on its own): 8 in a row
            assert self.proc.poll() is None, f"server exited early:\n{self.log()}"
            try:
                r = httpx.get(self.base + "/ready", timeout=2, verify=False)
                in_a_row = in_a_row + 1 if r.status_code == 200 else 0
                if in_a_row >= 8:
                    self.info = r.json()
                    break
                if in_a_row:
                    continue
            except httpx.HTTPError:
                in_a_row = 0
            assert time.monotonic() < t_end, f"server not ready after {ready_timeout} s:\n{self.log()}"
            time.sleep(0.25)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def threads(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/task"))

    def metric(self, name: str, label: str | None = None) -> float:
        """The sum of ``name``'s samples in ``/metrics`` (those whose line holds ``label``, if given)."""
        total = 0.0
        for line in httpx.get(self.base + "/metrics", timeout=5).text.splitlines():
            if line.startswith(name) and (len(line) > len(name) and line[len(name)] in " {"):
                if label is None or label in line:
                    total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()


def pcm16(path: Path = CLIP) -> bytes:
    """The clip's samples as raw little-endian PCM16 (16 kHz mono WAV input)."""
    with wave.open(str(path)) as w:
        assert w.getframerate() == 16000 and w.getnchannels() == 1 and w.getsampwidth() == 2
        return w.readframes(w.getnframes())


def wav_bytes(pcm: bytes, rate: int = 16000) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm)
    return buf.getvalue()


def words(text: str) -> list[str]:
    return "".join(c.lower() if c.isalnum() or c in " '" else " " for c in text).split()


def silence(seconds: float, rate: int = 16000) -> bytes:
    return np.zeros(int(seconds * rate), "<i2").tobytes()

