"""How much GPU work the job's batches cost against the best packing of the same pieces (CPU only).

The offline job's calls from disk ran at 8,630x on the H100 against 12,238x for the engine in memory
fed length-sorted chunks of 512 pieces (``bench/results/offline_e2e_h100_model_process_12h.json``).
One suspect is the batches themselves: :class:`flashasr.jobs.batcher.Batcher` takes the oldest
pending piece and the 511 nearest to it in length from the pieces decoded so far, so a batch may
span more lengths than a sorted chunk does. This benchmark prices both without a GPU. It cuts the
corpus into the job's pieces (decode + Silero VAD, 30 s window). Each call is priced by the engine's
own plan (:meth:`flashasr.engine.offline.OfflineParakeetEngine.plan`: its profiles, rows padded to
the profile, ``launch_cost_s`` per profile launch). The result is the padded work in audio seconds
per audio second of speech, for:

* length-sorted chunks of ``--batch`` pieces over the whole corpus (the in-memory engine phase);
* the batcher's rule with ``P`` pieces pending when each batch is taken (files arrive in input
  order, as the job reads them).

    python bench/bench_batch_packing.py --corpus .devjobs/corpus --copies 40
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def corpus_pieces(corpus: Path, workers: int, seg_max: float = 30.0) -> dict[str, list[tuple[int, int]]]:
    """Per corpus file its pieces ``(start, end)`` in samples at 16 kHz, as the job cuts them."""
    from bench_offline_e2e import runner_pieces
    from flashasr.audio import load_audio

    files = sorted(p for p in (corpus / "audio").iterdir() if p.is_file())

    def one(p: Path):
        s = load_audio(p, target_rate=16000).samples
        return p.name, [(int(a), int(b)) for a, b in runner_pieces(s, 16000, seg_max)]

    with ThreadPoolExecutor(workers) as ex:
        return dict(ex.map(one, files))


def engine_pricer():
    """``cost(lengths)``: the padded work (samples) of one engine call over pieces of these lengths."""
    from flashasr.engine.offline import OfflineParakeetEngine
    from flashasr.engine.parakeet_gpu import SERVING_SMALL_BATCHES
    from flashasr.engine.profiles import choose_profiles

    eng = types.SimpleNamespace(min_samples=1280, launch_cost_s=16.0, sample_rate=16000,
                                encoder=types.SimpleNamespace(profiles=choose_profiles(small_batches=SERVING_SMALL_BATCHES)))
    eng._plan_candidates = lambda: OfflineParakeetEngine._plan_candidates(eng)
    launch = eng.launch_cost_s * eng.sample_rate

    def cost(lengths: list[int]) -> float:
        plan = OfflineParakeetEngine.plan(eng, lengths)
        return sum((p.batch * p.samples if p is not None else lengths[idx[0]]) + launch for p, idx in plan)

    return cost


def batcher_batches(files: list[list[tuple[int, int]]], batch: int, pool: int) -> list[list[int]]:
    """The pieces' lengths of each batch :class:`~flashasr.jobs.batcher.Batcher` takes when ``pool``
    pieces are pending at each take (or the rest, at the end)."""
    from flashasr.jobs.batcher import Batcher, FileState
    from flashasr.jobs.inputs import InputItem
    from flashasr.options import TranscribeOptions

    opts = TranscribeOptions()
    bt = Batcher(batch)
    out, k = [], 0
    while k < len(files) or bt.pending:
        while k < len(files) and len(bt.pending) < pool:
            bt.add(FileState(k, InputItem(path=Path(f"f{k}"), key=f"f{k}", display=f"f{k}"), opts, np.zeros(1, np.float32),
                             list(files[k]), 0.0))
            k += 1
        taken, _opts, _waves = bt.take_batch()
        out.append([b - a for a, b in (files[f][p] for f, p in taken)])
        bt.complete(taken, [None] * len(taken))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", required=True, help="folder from bench_offline_e2e.py prepare")
    ap.add_argument("--copies", type=int, default=40, help="copies of the corpus, in input order (40: 12.1 h)")
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--pools", default="512,768,1024,1536,2048", help="pending pieces at each take")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    per_file = corpus_pieces(Path(args.corpus), args.workers)
    names = sorted(per_file)
    files = [per_file[n] for _ in range(args.copies) for n in names]
    lengths = [b - a for f in files for a, b in f]
    audio = float(sum(lengths))
    cost = engine_pricer()
    s = sorted(lengths)
    sorted_work = sum(cost(s[i: i + args.batch]) for i in range(0, len(s), args.batch))
    rows = [{"batches": f"length-sorted chunks of {args.batch}", "calls": -(-len(s) // args.batch),
             "padded_work_per_audio_s": round(sorted_work / audio, 4), "vs_sorted": 1.0}]
    for pool in [int(x) for x in args.pools.split(",") if x.strip()]:
        bs = batcher_batches(files, args.batch, max(pool, 1))
        work = sum(cost(b) for b in bs)
        rows.append({"batches": f"batcher, {pool} pending at each take", "calls": len(bs),
                     "padded_work_per_audio_s": round(work / audio, 4), "vs_sorted": round(work / sorted_work, 4)})
    print(f"{len(lengths)} pieces, {audio / 16000 / 3600:.2f} h ({args.copies} copies of {len(names)} files)")
    print(f"{'batches':40s} {'calls':>5s} {'padded work / audio':>20s} {'vs sorted':>10s}")
    for r in rows:
        print(f"{r['batches']:40s} {r['calls']:5d} {r['padded_work_per_audio_s']:20.3f} {r['vs_sorted']:10.3f}")
    out = {"benchmark": "batch_packing", "env": {"python": platform.python_version(), "host": platform.node()},
           "conditions": {"corpus": str(args.corpus), "copies": args.copies, "files": len(files),
                          "pieces": len(lengths), "audio_h": round(audio / 16000 / 3600, 3), "batch": args.batch,
                          "pricing": "OfflineParakeetEngine.plan with choose_profiles(small_batches="
                                     "SERVING_SMALL_BATCHES), launch_cost_s 16; pieces: decode + VAD, 30 s window",
                          "wall_s": round(time.perf_counter() - t0, 1)},
           "rows": rows}
    path = Path(args.json_out) if args.json_out else REPO / "bench" / "results" / "batch_packing.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO / "bench"))
    raise SystemExit(main())
