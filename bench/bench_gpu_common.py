"""Helpers shared by the GPU benchmarks (bench/bench_gpu_*.py): environment record, timing,
0.6B-v3-shaped random TDT predictor/joint with calibrated biases."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
# engine settings chosen by bench_gpu_profile.py in the same device call (FLASHASR_TUNE=path)
TUNE = json.loads(Path(os.environ["FLASHASR_TUNE"]).read_text()) if os.environ.get("FLASHASR_TUNE") else {}

# Parakeet-TDT 0.6B v3 decoder shapes (../shared/fixtures/parakeet/parakeet-tdt-0.6b-v3.yaml)
V3 = dict(vocab=8192, pred_hidden=640, pred_layers=2, enc_hidden=1024, joint_hidden=640,
          durations=[0, 1, 2, 3, 4], max_symbols=10)
# Output biases of the random joint, calibrated on CPU (bench_gpu_decoder.py --calibrate) so that
# greedy decoding of unit-variance random encoder frames emits ~3.5 tokens per second of audio
# (0.08 s frames) with a TDT duration mix like real speech; the realised figures are measured
# and reported by every run.
BLANK_BIAS = 3.8
DUR_BIAS = [-1.0, 0.6, 0.6, 0.4, 0.3]
OUT_WEIGHT_SCALE = 4.0


def env_record() -> dict:
    """GPU, driver, torch/CUDA versions and host facts for a results JSON."""
    rec = {"time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "python": platform.python_version(), "torch": torch.__version__,
           "cuda_runtime": torch.version.cuda, "host_cpus": os.cpu_count()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        rec.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), sm_count=p.multi_processor_count,
                   cudnn=torch.backends.cudnn.version())
    try:
        from flashasr.engine.fuse import ALL_TRANSFORMS
        from flashasr.engine.triton_norm import triton_status

        rec["encoder_fusions_default"] = list(ALL_TRANSFORMS)
        rec["triton_add_layer_norm"] = triton_status()
        import triton

        rec["triton"] = triton.__version__
    except Exception as e:  # noqa: BLE001
        rec.setdefault("triton", f"unavailable: {e}")
    try:
        from cuda.bindings import __version__ as cb
        from cuda.bindings import driver
        rec["cuda_bindings"] = cb
        rec["driver_cuda_version"] = int(driver.cuDriverGetVersion()[1])
    except Exception as e:  # noqa: BLE001
        rec["cuda_bindings"] = f"unavailable: {e}"
    return rec


def cuda_time(fn, *, warmup=2, reps=10) -> dict:
    """Median/min wall seconds of ``fn()`` with device synchronisation around each call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(ts), "min_s": min(ts), "reps": reps}


def make_v3_decoder(device="cuda", dtype=torch.bfloat16, seed=0, blank_bias=BLANK_BIAS, dur_bias=None):
    """Random TDTPredictor/TDTJoint with the 0.6B-v3 shapes and calibrated output biases."""
    from flashasr.models.parakeet.decoder import TDTJoint, TDTPredictor

    torch.manual_seed(seed)
    pred = TDTPredictor(V3["vocab"], V3["pred_hidden"], V3["pred_layers"])
    joint = TDTJoint(V3["enc_hidden"], V3["pred_hidden"], V3["joint_hidden"], V3["vocab"],
                     V3["durations"], max_symbols_per_step=V3["max_symbols"])
    with torch.no_grad():
        pred.embed.weight[V3["vocab"]].zero_()
        joint.out.weight[: V3["vocab"] + 1].mul_(OUT_WEIGHT_SCALE)  # token/blank rows only
        joint.out.bias.zero_()
        joint.out.bias[V3["vocab"]] = blank_bias
        joint.out.bias[V3["vocab"] + 1:] = torch.tensor(dur_bias or DUR_BIAS)
    return pred.eval().to(device=device, dtype=dtype), joint.eval().to(device=device, dtype=dtype)


def decode_stats(res, frames_total: int, frame_s: float = 0.08) -> dict:
    """Tokens per audio second and duration histogram of a TDTDecodeOutput."""
    n = sum(len(x) for x in res.token_ids)
    hist = {}
    for row in res.token_durations:
        for d in row:
            hist[d] = hist.get(d, 0) + 1
    mean_d = sum(k * v for k, v in hist.items()) / max(1, n)
    return {"tokens": n, "tokens_per_audio_s": n / max(1e-9, frames_total * frame_s),
            "token_duration_hist": {str(k): hist[k] for k in sorted(hist)},
            "mean_token_duration_frames": mean_d}


def write_result(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"gpu_{name}.json"
    out.write_text(json.dumps(payload, indent=2, default=str))
    extra = os.environ.get("OUT")
    if extra:
        Path(extra, out.name).write_text(out.read_text())
    return out


V3_YAML_CANDIDATES = [REPO / ".devdata" / "shared" / "fixtures" / "parakeet" / "parakeet-tdt-0.6b-v3.yaml",
                      REPO.parent / "shared" / "fixtures" / "parakeet" / "parakeet-tdt-0.6b-v3.yaml"]


def build_v3_model(device="cuda", seed=0):
    """Random-weight Parakeet-TDT 0.6B v3 (float32 weights; engines convert in place)."""
    from flashasr.random_models import build_random_parakeet

    path = next(p for p in V3_YAML_CANDIDATES if p.exists())
    return build_random_parakeet(path, device=device, dtype="float32", seed=seed)


@torch.no_grad()
def calibrate_joint(model, f_proj, lengths, target_tps=3.5, frame_s=0.08, iters=10):
    """Give a random joint realistic output statistics, in place: token/blank rows x4, duration
    biases DUR_BIAS, blank bias bisected so greedy decoding of ``f_proj`` (projected encoder
    output) emits ``target_tps`` tokens per audio second. Returns (blank_bias, realised tps)."""
    from flashasr.engine.tdt_graphs import TDTGraphDecoder

    j = model.joint
    V = j.blank_id
    j.out.weight[: V + 1].mul_(OUT_WEIGHT_SCALE)
    j.out.bias.zero_()
    j.out.bias[V + 1:] = torch.tensor(DUR_BIAS, dtype=j.out.bias.dtype, device=j.out.bias.device)
    dec = TDTGraphDecoder(model.predictor, j, mode="full_graph")
    lo, hi = -2.0, 10.0
    tps = 0.0
    for _ in range(iters):
        mid = (lo + hi) / 2
        j.out.bias[V] = mid
        r = dec.decode(f_proj, lengths, projected=True)
        tps = sum(map(len, r.token_ids)) / (float(lengths.sum()) * frame_s)
        lo, hi = (mid, hi) if tps > target_tps else (lo, mid)
    j.out.bias[V] = (lo + hi) / 2
    r = dec.decode(f_proj, lengths, projected=True)
    tps = sum(map(len, r.token_ids)) / (float(lengths.sum()) * frame_s)
    return (lo + hi) / 2, tps


def load_speech(path=None):
    """Real speech pieces (float32 16 kHz) from .devdata/speech16k.npz (bench_gpu_prepare_audio.py)."""
    import numpy as np

    z = np.load(path or REPO / ".devdata" / "speech16k.npz")
    out, o = [], 0
    for n in z["lengths"]:
        out.append(z["audio"][o: o + n].astype(np.float32) / 32768.0)
        o += n
    return out
