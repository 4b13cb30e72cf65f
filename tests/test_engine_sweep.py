"""Correctness sweep of the offline engine over input lengths around shape boundaries.

Model: the NeMo tiny fixture (random weights drawn by NeMo) with its joint's blank bias
calibrated so greedy decoding emits ~3.5 tokens per audio second (real-speech rate) instead of
whatever the random weights give. Inputs: cuts of real speech (the fixture's clips, tiled) at
lengths

* every 80 ms (plus +-1 sample at the centre) around 255/256/257 encoder frames (20.4-20.6 s)
  and 375/376 frames (29.9-30.1 s),
* around each default profile boundary of :func:`choose_profiles` (b - 80 ms, b - 1 sample, b,
  b + 1 sample, b + 80 ms; above the largest profile the engine runs eagerly),
* every 0.88 s from 0.1 s to 40 s (plus 60-1300 samples: below and at one encoder frame).

Checked: every length transcribes; tokens/frames/durations from one call on all inputs
(mixed-length batches in profiles) == each input alone == ``greedy_tdt_reference`` on the
unfused model's own encoder output. CPU: eager encoder, torch decoder, fusions on. GPU
(``gpu`` marker): float32 (TF32 off), profile CUDA graphs, every decoder mode.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from conftest import PARAKEET_FIXTURES
from flashasr.engine.offline import OfflineParakeetEngine
from flashasr.engine.profiles import DEFAULT_BOUNDARIES_S, choose_profiles
from flashasr.models.parakeet.decoder import greedy_tdt_reference

TINY = PARAKEET_FIXTURES / "tiny-tdt"
SR = 16000
FRAME = 1280  # samples per encoder frame (10 ms hop x 8)
SECONDS_PER_BATCH = 64.0  # small profile batches: cheap on CPU, still several rows per batch


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py


def sweep_lengths() -> list[int]:
    """Input lengths in samples (sorted, unique)."""
    out = set()
    for lo, hi in ((20.40, 20.60), (29.92, 30.08)):  # 255..257 and 374..376 encoder frames
        k = 0
        while lo + 0.08 * k <= hi + 1e-9:
            out.add(int(round((lo + 0.08 * k) * SR)))
            k += 1
    for c in (256 * FRAME, 375 * FRAME):
        out |= {c - 1, c + 1}
    bounds = sorted({p.seconds for p in choose_profiles(seconds_per_batch=SECONDS_PER_BATCH)}
                    | set(DEFAULT_BOUNDARIES_S))
    for b in bounds:
        n = int(round(b * SR))
        out |= {n - FRAME, n - 1, n, n + 1, n + FRAME}
    s = 0.1
    while s <= 40.0 + 1e-9:
        out.add(int(round(s * SR)))
        s += 0.88
    out |= {60, FRAME - 1, FRAME, FRAME + 1, 40 * SR}
    return sorted(out)


def _speech(n_max: int) -> np.ndarray:
    z = np.load(TINY / "reference.npz")
    w = np.concatenate([z["audio"][b, : z["audio_lengths"][b]] for b in range(len(z["audio_lengths"]))])
    return np.tile(w, n_max // len(w) + 1)[:n_max].astype(np.float32)


def sweep_inputs() -> list[np.ndarray]:
    """One waveform per sweep length; each starts at a different offset of the tiled speech."""
    lengths = sweep_lengths()
    src = _speech(max(lengths) + 97 * len(lengths))
    return [src[97 * i: 97 * i + n].copy() for i, n in enumerate(lengths)]


def load_model(device="cpu"):
    from flashasr.models.parakeet.model import ParakeetASR

    return ParakeetASR.from_nemo(TINY / "model.nemo", device=device)


@torch.no_grad()
def _encode(model, w: np.ndarray):
    dev = next(model.encoder.parameters()).device
    audio = torch.from_numpy(w)[None].to(dev)
    feats, flen = model.preprocessor(audio, torch.tensor([len(w)], device=dev))
    return model.encoder(feats, flen, channels_last=True)


@torch.no_grad()
def calibrate_blank(model, w: np.ndarray, target_tps=3.5, iters=12) -> float:
    """Set the joint's blank logit bias (in place) by bisection so greedy decoding of ``w``
    emits ``target_tps`` tokens per second; returns the realised rate."""
    enc, elen = _encode(model, w)
    bias = model.joint.out.bias
    V = model.joint.blank_id
    base = float(bias[V])
    lo, hi = -5.0, 15.0
    rate = 0.0
    for _ in range(iters):
        mid = (lo + hi) / 2
        bias[V] = base + mid
        h = greedy_tdt_reference(enc, elen, model.predictor, model.joint, model.durations, V, 10)[0]
        rate = len(h.token_ids) / (len(w) / SR)
        lo, hi = (mid, hi) if rate > target_tps else (lo, mid)
    return rate


@torch.no_grad()
def reference_tokens(model, waves) -> list[tuple]:
    """Per input: the model's own encoder (unfused, unpadded) + the reference greedy loop."""
    out = []
    for w in waves:
        if len(w) < FRAME:
            out.append(([], [], []))
            continue
        enc, elen = _encode(model, w)
        h = greedy_tdt_reference(enc, elen, model.predictor, model.joint, model.durations, model.blank_id, 10)[0]
        out.append((h.token_ids, h.token_frames, h.token_durations))
    return out


def _tuples(out):
    return [(it.token_ids, it.token_frames, it.token_durations) for it in out.items]


def _check_engine(eng, waves, ref, shuffle_seed=0):
    perm = np.random.default_rng(shuffle_seed).permutation(len(waves))  # mixed input order
    out = eng.transcribe_arrays([waves[i] for i in perm])
    batched = _tuples(out)
    got = [None] * len(waves)
    for k, i in enumerate(perm):
        got[i] = batched[k]
    bad = [(len(waves[i]), got[i][0][:8], ref[i][0][:8]) for i in range(len(waves)) if got[i] != ref[i]]
    assert not bad, f"batched != reference for {len(bad)} lengths, first: {bad[:3]}"
    alone = [_tuples(eng.transcribe_arrays([w]))[0] for w in waves]
    bad = [len(waves[i]) for i in range(len(waves)) if alone[i] != ref[i]]
    assert not bad, f"alone != reference at lengths (samples) {bad[:10]}"
    return out


@pytest.fixture(scope="module")
def calibrated():
    model = load_model()
    waves = sweep_inputs()
    rate = calibrate_blank(model, _speech(40 * SR))
    ref = reference_tokens(model, waves)
    return model, waves, ref, rate


def test_sweep_lengths_cover_boundaries():
    ls = sweep_lengths()
    assert len(ls) < 140 and min(ls) < FRAME and max(ls) == 40 * SR
    for c in (255, 256, 257, 375):
        assert c * FRAME in ls
    for b in DEFAULT_BOUNDARIES_S:
        assert {int(round(b * SR)) + d for d in (-FRAME, -1, 0, 1, FRAME)} <= set(ls)


def test_sweep_cpu_batched_equals_alone_equals_reference(calibrated):
    model, waves, ref, rate = calibrated
    assert 2.5 < rate < 4.5, rate
    n_tok = sum(len(r[0]) for r in ref)
    audio_s = sum(map(len, waves)) / SR
    assert n_tok / audio_s > 2.0  # tokens are emitted at a realistic rate everywhere, not only in the calibration cut
    eng = OfflineParakeetEngine(copy.deepcopy(model), profiles=choose_profiles(seconds_per_batch=SECONDS_PER_BATCH),
                                with_text=False)
    assert eng.encoder.fusions.get("bn_fold") == len(model.encoder.layers)
    out = _check_engine(eng, waves, ref)
    assert any(n > 1 for *_, n in out.batches)  # real mixed-length batches ran
    assert (None, None, 1) in out.batches  # inputs above 30 s ran eagerly


@pytest.mark.gpu
def test_sweep_gpu_graph_modes_equal_reference():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = load_model("cuda")
    waves = sweep_inputs()
    calibrate_blank(model, _speech(40 * SR))
    ref = reference_tokens(model, waves)
    for mode in ("full_graph", "graphs_no_while", "torch"):
        for fuse in (True, False):
            eng = OfflineParakeetEngine(copy.deepcopy(model), dtype=torch.float32, decoder_mode=mode, fuse=fuse,
                                        profiles=choose_profiles(seconds_per_batch=SECONDS_PER_BATCH),
                                        with_text=False)
            _check_engine(eng, waves, ref, shuffle_seed=len(mode))
            out = eng.transcribe_arrays(waves, pipelined=True)
            assert _tuples(out) == ref
            assert set(out.decoder_modes) == {mode}, out.decoder_modes
            if mode != "full_graph":
                break  # fusion on/off is covered once; other modes with fusions on
