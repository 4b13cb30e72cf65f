"""Engine TDT decoder (label looping on static tensors): all modes equal the reference decoder.

CPU: the ``torch`` mode against ``greedy_tdt_reference`` on the NeMo fixture and random models.
GPU (``@pytest.mark.gpu``, run on the device machine): ``full_graph`` / ``graphs_no_while`` /
``torch`` give identical tokens, frames and durations; bucket re-capture; fallback.
"""

from __future__ import annotations

import io
import tarfile

import numpy as np
import pytest
import torch

from conftest import PARAKEET_FIXTURES
from flashasr.engine.tdt_graphs import DecodeMode, DecoderInputError, TDTGraphDecoder
from flashasr.models.parakeet.decoder import TDTJoint, TDTPredictor, greedy_tdt_reference


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py


TINY = PARAKEET_FIXTURES / "tiny-tdt"


def _random_tdt(seed, V, H, L, D, J, durations, blank_bias=0.0, dur_bias=None, device="cpu"):
    torch.manual_seed(seed)
    pred = TDTPredictor(V, H, L)
    joint = TDTJoint(D, H, J, V, durations)
    with torch.no_grad():
        pred.embed.weight[V].zero_()
        joint.out.weight.mul_(3.0)
        joint.out.bias[V] += blank_bias
        if dur_bias is not None:
            joint.out.bias[V + 1:] += torch.tensor(dur_bias, dtype=torch.float32)
    return pred.eval().to(device), joint.eval().to(device)


def _tiny_fixture_modules(device="cpu"):
    with tarfile.open(TINY / "model.nemo", "r:") as t:
        sd = torch.load(io.BytesIO(t.extractfile("./model_weights.ckpt").read()), weights_only=True)
    V, H = sd["decoder.prediction.embed.weight"].shape
    V -= 1
    L = sum(1 for k in sd if k.startswith("decoder.prediction.dec_rnn.lstm.weight_ih_l"))
    J, D = sd["joint.enc.weight"].shape
    pred = TDTPredictor(V, H, L)
    joint = TDTJoint(D, H, J, V, [0, 1, 2, 3, 4], max_symbols_per_step=10)
    pred.embed.weight.data.copy_(sd["decoder.prediction.embed.weight"])
    for k, v in sd.items():
        if k.startswith("decoder.prediction.dec_rnn.lstm."):
            getattr(pred.lstm, k.rsplit(".", 1)[1]).data.copy_(v)
    for name, mod in (("enc", joint.enc), ("pred", joint.pred), ("joint_net.2", joint.out)):
        mod.weight.data.copy_(sd[f"joint.{name}.weight"])
        mod.bias.data.copy_(sd[f"joint.{name}.bias"])
    return pred.eval().to(device), joint.eval().to(device)


def _nemo_per_utterance(enc, lengths, pred, joint, max_symbols):
    """NeMo 3.0.0 GreedyTDTInfer loop, literally (for the max-symbols quirk mode)."""
    V, durs = joint.blank_id, joint.durations
    out = []
    with torch.no_grad():
        f_all = joint.project_encoder(enc)
        for b in range(enc.shape[0]):
            ids, frames, dd = [], [], []
            g, st = pred.step(torch.tensor([V]), None)
            gp = joint.project_predictor(g)
            t, T = 0, int(lengths[b])
            while t < T:
                need_loop, added = True, 0
                while need_loop and added < max_symbols:
                    logits = joint.joint_after_projection(f_all[b:b + 1, t], gp)[0]
                    k = int(logits[: V + 1].argmax())
                    skip = durs[int(logits[V + 1:].argmax())]
                    if k != V:
                        ids.append(k), frames.append(t), dd.append(skip)
                        g, st = pred.step(torch.tensor([k]), st)
                        gp = joint.project_predictor(g)
                    added += 1
                    t += skip
                    need_loop = skip == 0
                if added == max_symbols:
                    t += 1
            out.append((ids, frames, dd))
    return out


def _assert_same(res, ref):
    assert res.token_ids == [h.token_ids for h in ref]
    assert res.token_frames == [h.token_frames for h in ref]
    assert res.token_durations == [h.token_durations for h in ref]


def test_fixture_torch_mode_matches_nemo_and_reference():
    z = np.load(TINY / "reference.npz")
    pred, joint = _tiny_fixture_modules()
    enc = torch.from_numpy(z["encoder_output"]).transpose(1, 2).contiguous()
    lengths = torch.from_numpy(z["encoded_lengths"])
    dec = TDTGraphDecoder(pred, joint, mode="torch")
    res = dec.decode(enc, lengths)
    assert res.mode == "torch"
    for b in range(enc.shape[0]):
        assert res.token_ids[b] == z[f"item{b}_token_ids"].tolist()
        assert res.token_frames[b] == z[f"item{b}_token_frames"].tolist()
        assert res.token_durations[b] == z[f"item{b}_token_durations"].tolist()
    _assert_same(res, greedy_tdt_reference(enc, lengths, pred, joint, joint.durations, joint.blank_id, 10))


CASES = [
    (0, 50, 32, 1, 48, 40, [0, 1, 2, 3, 4], 0.0, None),
    (1, 300, 24, 2, 16, 32, [0, 1, 2], 1.0, None),
    (2, 7, 16, 3, 20, 8, [0, 2, 4, 8], -0.5, None),
    (3, 129, 64, 2, 96, 64, [1, 2, 3], 0.5, None),
    (4, 20, 16, 2, 8, 16, [0, 1, 2], 0.0, [3.0, 0.0, 0.0]),  # many duration-0 tokens
]


@pytest.mark.parametrize("seed,V,H,L,D,J,durations,blank_bias,dur_bias", CASES)
def test_random_torch_mode_matches_reference(seed, V, H, L, D, J, durations, blank_bias, dur_bias):
    pred, joint = _random_tdt(seed, V, H, L, D, J, durations, blank_bias, dur_bias)
    g = torch.Generator().manual_seed(100 + seed)
    B, T = 4, 50
    enc = torch.randn(B, T, D, generator=g)
    lengths = torch.tensor([T, 1, 0, 37])
    for ms in ((10, 2) if dur_bias is not None else (10,)):
        ref = greedy_tdt_reference(enc, lengths, pred, joint, durations, V, ms)
        res = TDTGraphDecoder(pred, joint, mode="torch", max_symbols=ms).decode(enc, lengths)
        _assert_same(res, ref)
        assert res.token_ids[2] == []
    assert sum(len(x) for x in res.token_ids) > 5


def test_quirk_mode_matches_nemo_per_utterance_loop():
    pred, joint = _random_tdt(4, 20, 16, 2, 8, 16, [0, 1, 2], 0.0, [2.5, 0.0, 0.0])
    enc = torch.randn(2, 30, 8, generator=torch.Generator().manual_seed(7))
    lengths = torch.tensor([30, 13])
    for ms in (2, 3):
        want = _nemo_per_utterance(enc, lengths, pred, joint, ms)
        res = TDTGraphDecoder(pred, joint, mode="torch", max_symbols=ms,
                              nemo_max_symbols_quirk=True).decode(enc, lengths)
        assert [list(x) for x in zip(res.token_ids, res.token_frames, res.token_durations)] == \
            [list(x) for x in want]


def test_bad_input_raises():
    pred, joint = _random_tdt(0, 10, 8, 1, 4, 8, [0, 1])
    dec = TDTGraphDecoder(pred, joint, mode="torch")
    with pytest.raises(DecoderInputError):
        dec.decode(torch.randn(2, 5), torch.tensor([1, 2]))
    with pytest.raises(DecoderInputError):
        dec.decode(torch.randn(2, 5, 4), torch.tensor([1, 6]))
    with pytest.raises(DecoderInputError):
        dec.decode(torch.randn(2, 5, 4), torch.tensor([1]))


# ---------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("seed,V,H,L,D,J,durations,blank_bias,dur_bias", CASES)
def test_gpu_all_modes_identical(seed, V, H, L, D, J, durations, blank_bias, dur_bias):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    pred, joint = _random_tdt(seed, V, H, L, D, J, durations, blank_bias, dur_bias, device="cuda")
    g = torch.Generator().manual_seed(200 + seed)
    B, T = 6, 150
    enc = torch.randn(B, T, D, generator=g)
    lengths = torch.tensor([T, 1, 0, 97, 149, 60])
    ref = greedy_tdt_reference(enc, lengths, pred.cpu(), joint.cpu(), durations, V, 10)
    pred.cuda(), joint.cuda()
    results = {}
    for mode in ("full_graph", "graphs_no_while", "torch"):
        dec = TDTGraphDecoder(pred, joint, mode=mode)
        for _ in range(2):  # second call replays the captured graphs
            res = dec.decode(enc.cuda(), lengths.cuda())
            assert res.mode == mode, dec.events
        results[mode] = res
        _assert_same(res, ref)


@pytest.mark.gpu
def test_gpu_fixture_full_graph_and_recapture():
    z = np.load(TINY / "reference.npz")
    pred, joint = _tiny_fixture_modules("cuda")
    enc = torch.from_numpy(z["encoder_output"]).transpose(1, 2).contiguous().cuda()
    lengths = torch.from_numpy(z["encoded_lengths"]).cuda()
    dec = TDTGraphDecoder(pred, joint, mode="full_graph", min_frames=16)
    for sub in ([0], [0, 1], [0, 1, 2, 3], [3, 2]):  # grows batch and frames: new buckets
        idx = torch.tensor(sub, device="cuda")
        T = int(lengths[idx].max())
        res = dec.decode(enc[idx, :T], lengths[idx])
        assert res.mode == "full_graph", dec.events
        for i, b in enumerate(sub):
            assert res.token_ids[i] == z[f"item{b}_token_ids"].tolist()
            assert res.token_frames[i] == z[f"item{b}_token_frames"].tolist()
            assert res.token_durations[i] == z[f"item{b}_token_durations"].tolist()
    assert len(dec._buckets) >= 2


@pytest.mark.gpu
def test_gpu_fallback_when_full_graph_breaks(monkeypatch):
    pred, joint = _random_tdt(0, 50, 32, 1, 48, 40, [0, 1, 2, 3, 4], device="cuda")
    enc = torch.randn(3, 40, 48, device="cuda")
    lengths = torch.tensor([40, 20, 3], device="cuda")
    dec = TDTGraphDecoder(pred, joint, mode="full_graph")

    def boom(*a, **k):
        raise RuntimeError("simulated capture failure")

    monkeypatch.setattr(dec, "_capture_full", boom)
    res = dec.decode(enc, lengths)
    assert res.mode == "graphs_no_while" and res.fallbacks == ["full_graph"]
    ref = dec.decode(enc, lengths, mode="torch")
    assert res.token_ids == ref.token_ids and res.token_frames == ref.token_frames
    # the process is fine afterwards: a fresh decoder still captures the full graph
    assert TDTGraphDecoder(pred, joint).decode(enc, lengths).mode == "full_graph"


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["random", "v3", "bf16", "quirk", "ties"])
def test_gpu_fused_joint_step_identical(case):
    """The fused head/inner step (engine/tdt_fused.py: Triton + the joint's own nn.Linear) gives
    the same tokens, frames and durations as the PyTorch step, in every mode: small and 0.6B-v3
    sized vocabularies (several argmax chunks), bf16, the NeMo max-symbols quirk, and exact ties
    between logits (first index wins, as torch.argmax)."""
    from flashasr.engine.tdt_fused import fused_status

    torch.backends.cuda.matmul.allow_tf32 = False
    shapes = {"random": (0, 300, 24, 2, 16, 32, [0, 1, 2], 1.0, None),
              "v3": (5, 8192, 640, 2, 96, 640, [0, 1, 2, 3, 4], 0.0, None),
              "bf16": (6, 1000, 64, 2, 48, 128, [0, 1, 2, 3, 4], 2.0, None),
              "quirk": (4, 20, 16, 2, 8, 16, [0, 1, 2], 0.0, [2.5, 0.0, 0.0]),
              "ties": (7, 40, 16, 1, 8, 16, [0, 1, 2, 4], 0.0, None)}[case]
    seed, V, H, L, D, J, durations, blank_bias, dur_bias = shapes
    pred, joint = _random_tdt(seed, V, H, L, D, J, durations, blank_bias, dur_bias, device="cuda")
    if case == "ties":  # every label logit 1.0 except a tie at 3 and 7; durations tied at 1 and 2
        with torch.no_grad():
            joint.out.weight.zero_()
            joint.out.bias.fill_(1.0)
            joint.out.bias[3] = joint.out.bias[7] = 5.0
            joint.out.bias[V + 1 + 1] = joint.out.bias[V + 1 + 2] = 5.0
    dtype = torch.bfloat16 if case == "bf16" else torch.float32
    pred, joint = pred.to(dtype), joint.to(dtype)
    g = torch.Generator().manual_seed(300 + seed)
    enc = torch.randn(7, 120, D, generator=g).to("cuda", dtype)
    lengths = torch.tensor([120, 1, 0, 77, 119, 40, 3], device="cuda")
    kw = dict(max_symbols=2, nemo_max_symbols_quirk=True) if case == "quirk" else {}
    for mode in ("full_graph", "graphs_no_while", "torch"):
        want = TDTGraphDecoder(pred, joint, mode=mode, fused=False, **kw).decode(enc, lengths)
        dec = TDTGraphDecoder(pred, joint, mode=mode, **kw)
        for _ in range(2):  # capture, then replay
            got = dec.decode(enc, lengths)
            assert got.mode == mode, dec.events
            assert got.token_ids == want.token_ids
            assert got.token_frames == want.token_frames
            assert got.token_durations == want.token_durations
    assert sum(len(x) for x in want.token_ids) > 3
    if case == "ties":
        assert set(want.token_ids[0]) == {3} and set(want.token_durations[0]) == {1}
    assert fused_status()["in_use"], fused_status()
