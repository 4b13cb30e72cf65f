"""Diagnostic: does the full-graph (WHILE node) decoder capture and match the torch mode, per
body-allocation strategy? Prints one line per strategy. Device only."""
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_gpu_common import make_v3_decoder  # noqa: E402
from flashasr.engine.tdt_graphs import TDTGraphDecoder  # noqa: E402

if "-h" in sys.argv or "--help" in sys.argv:
    raise SystemExit(__doc__)
if not torch.cuda.is_available():
    raise SystemExit("bench_gpu_whilediag.py needs a CUDA GPU (run it on the device machine)")
for strat in ("thread", "none"):
    os.environ["FLASHASR_WHILE_POOL"] = strat
    try:
        pred, joint = make_v3_decoder("cuda", torch.float32, 0)
        enc = torch.randn(8, 150, 1024, device="cuda")
        lengths = torch.randint(50, 151, (8,), device="cuda")
        dec = TDTGraphDecoder(pred, joint, mode="full_graph")
        dec.capture(8, 150, modes=["full_graph"])
        r1 = dec.decode(enc, lengths)
        r2 = dec.decode(enc, lengths, mode="torch")
        print(f"strategy={strat}: mode={r1.mode} identical={r1.token_ids == r2.token_ids and r1.token_frames == r2.token_frames} "
              f"tokens={sum(map(len, r1.token_ids))} events={dec.events}", flush=True)
    except Exception:
        print(f"strategy={strat}: FAILED")
        traceback.print_exc()
os.environ["FLASHASR_WHILE_POOL"] = "thread"
