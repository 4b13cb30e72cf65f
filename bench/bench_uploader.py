"""Packing a batch of waveforms for the GPU while other threads run Python (the offline job's case).

:class:`flashasr.engine.PinnedUploader` against the per-row numpy loop it replaced (kept here as
the reference: ``host[i, :len(w)] = w``; ``host[i, len(w):] = 0`` into a pinned ``[B, N]`` buffer,
then one copy of the padded batch). Each row copy of more than a few hundred samples makes numpy
release the GIL and take it back; with other threads running Python, taking it back waits up to a
switch interval (the job runs at 0.5 ms). Measured: wall time of ``upload`` + device synchronize
for 512 rows of 5-15 s (the offline job's largest batch), with 0, 1 and 4 threads spinning in
Python, best and median of 7; and that both give identical tensors.

    python bench/bench_uploader.py --device cuda     # writes bench/results/uploader_<gpu|cpu>.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from flashasr.engine.features_gpu import PinnedUploader  # noqa: E402


class LoopUploader:
    """The reference: the per-row numpy loop into a pinned padded buffer (flashasr before 2026-12-05)."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.pin = self.device.type == "cuda"
        self._buf = None

    def upload(self, waves, batch=None, samples=None):
        B, N = batch or len(waves), samples or max(len(w) for w in waves)
        if self._buf is None or self._buf.numel() < B * N:
            self._buf = torch.empty(B * N, dtype=torch.float32, pin_memory=self.pin)
            self._len = torch.empty(B, dtype=torch.long, pin_memory=self.pin)
        host, hn, ln = self._buf[: B * N].view(B, N), self._buf[: B * N].view(B, N).numpy(), self._len[:B].numpy()
        ln[:] = 0
        for i, w in enumerate(waves):
            hn[i, : len(w)] = w
            hn[i, len(w):] = 0.0
            ln[i] = len(w)
        hn[len(waves):] = 0.0
        if self.device.type == "cuda":
            return host.to(self.device, non_blocking=True), self._len[:B].to(self.device, non_blocking=True)
        return host.clone(), self._len[:B].clone()


def timed(up, waves, device, repeats):
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    up.upload(waves)
    sync()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        up.upload(waves)
        sync()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return {"best_ms": round(ts[0] * 1e3, 1), "median_ms": round(ts[len(ts) // 2] * 1e3, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--spinners", default="0,1,4")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--switch-interval-s", type=float, default=0.0005)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.rows < 1 or a.repeats < 1:
        ap.error("--rows and --repeats must be at least 1")
    sys.setswitchinterval(a.switch_interval_s)
    rng = np.random.default_rng(0)
    waves = [rng.standard_normal(int(rng.integers(80_000, 240_000))).astype(np.float32) for _ in range(a.rows)]
    rows, stop = [], threading.Event()

    def spin():
        x = 0
        while not stop.is_set():
            x += 1

    print(f"{'other Python threads':>20} {'per-row loop best/median ms':>28} {'PinnedUploader best/median ms':>30}")
    for k in (int(s) for s in a.spinners.split(",")):
        stop.clear()
        threads = [threading.Thread(target=spin, daemon=True) for _ in range(k)]
        for t in threads:
            t.start()
        r = {"spinners": k, "loop": timed(LoopUploader(a.device), waves, a.device, a.repeats),
             "uploader": timed(PinnedUploader(a.device), waves, a.device, a.repeats)}
        stop.set()
        for t in threads:
            t.join()
        rows.append(r)
        print(f"{k:>20} {r['loop']['best_ms']:>13.1f} / {r['loop']['median_ms']:<12.1f}"
              f" {r['uploader']['best_ms']:>14.1f} / {r['uploader']['median_ms']:<12.1f}")
    a1, l1 = LoopUploader(a.device).upload(waves, batch=a.rows + 8, samples=250_000)
    a2, l2 = PinnedUploader(a.device).upload(waves, batch=a.rows + 8, samples=250_000)
    identical = bool(torch.equal(a1, a2) and torch.equal(l1, l2))
    print(f"identical tensors: {identical}")
    gpu = torch.cuda.get_device_name() if a.device.startswith("cuda") else None
    result = {"benchmark": "uploader", "machine": {"host": platform.node(), "cores": os.cpu_count(), "gpu": gpu},
              "versions": {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__},
              "conditions": {"device": a.device, "rows": a.rows, "row_seconds": "5-15 at 16 kHz (random)",
                             "switch_interval_s": a.switch_interval_s, "repeats": a.repeats,
                             "timing": "upload + device synchronize, wall; other threads spin in Python"},
              "results": rows, "identical": identical}
    out = Path(a.out) if a.out else REPO / "bench" / "results" / f"uploader_{'gpu' if gpu else 'cpu'}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
