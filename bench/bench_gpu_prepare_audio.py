"""Prepare real speech for the GPU end-to-end benchmark (runs HERE, not on the device).

Decodes the speech clips of ../shared/audio (with a transcript, <= 30 s; the long clips are cut
into <= 30 s pieces at fixed 20 s steps) to 16 kHz mono int16 and stores them in
``.devdata/speech16k.npz`` (an ignored folder carried to the device), so the device needs no
audio decoder. About 17 minutes of distinct speech.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
SHARED = REPO.parent / "shared" / "audio"
MAX_MINUTES = 17.0  # keeps the carried file ~30 MiB (device tree limit 64 MiB)


def main(argv=None):
    import argparse

    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)  # --help, nothing else
    from flashasr.audio.decode import load_audio

    clips = [json.loads(l) for l in (SHARED / "manifest.jsonl").read_text().splitlines() if l.strip()]
    arrays, names, total = [], [], 0.0
    for c in clips:
        if c["category"] == "hard" or c["reference"] == "":
            continue
        a = load_audio(str(SHARED / c["path"]))
        a = np.asarray(getattr(a, "samples", a), dtype=np.float32).reshape(-1)
        step = 20 * 16000
        pieces = [a] if len(a) <= 30 * 16000 else [a[i: i + step] for i in range(0, len(a), step)]
        if total > MAX_MINUTES * 60:
            break
        for k, p in enumerate(pieces):
            if len(p) < 8000:
                continue
            arrays.append(np.clip(p * 32768.0, -32768, 32767).astype(np.int16))
            names.append(f"{c['id']}#{k}")
            total += len(p) / 16000
    out = REPO / ".devdata" / "speech16k.npz"
    out.parent.mkdir(exist_ok=True)
    np.savez(out, lengths=np.array([len(a) for a in arrays]), audio=np.concatenate(arrays), names=np.array(names))
    print(f"{len(arrays)} pieces, {total / 60:.1f} min, {out.stat().st_size / 2**20:.1f} MiB -> {out}")


if __name__ == "__main__":
    main()
