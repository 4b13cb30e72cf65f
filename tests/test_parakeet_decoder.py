"""TDT decoding: batched label looping equals the per-utterance reference (random models)."""

from __future__ import annotations

import pytest
import torch

from flashasr.models.parakeet.decoder import (TDTJoint, TDTPredictor, greedy_tdt_label_looping,
                                              greedy_tdt_reference)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py


def _random_tdt(seed, V, H, L, D, J, durations, blank_bias=0.0):
    torch.manual_seed(seed)
    pred = TDTPredictor(V, H, L)
    joint = TDTJoint(D, H, J, V, durations)
    with torch.no_grad():
        pred.embed.weight[V].zero_()
        joint.out.weight.mul_(3.0)
        joint.out.bias[V] += blank_bias
    return pred.eval(), joint.eval()


@pytest.mark.parametrize("seed,V,H,L,D,J,durations,blank_bias", [
    (0, 50, 32, 1, 48, 40, [0, 1, 2, 3, 4], 0.0),
    (1, 300, 24, 2, 16, 32, [0, 1, 2], 1.0),
    (2, 7, 16, 3, 20, 8, [0, 2, 4, 8], -0.5),
    (3, 129, 64, 2, 96, 64, [1, 2, 3], 0.5),
])
def test_label_looping_equals_reference(seed, V, H, L, D, J, durations, blank_bias):
    pred, joint = _random_tdt(seed, V, H, L, D, J, durations, blank_bias)
    g = torch.Generator().manual_seed(100 + seed)
    B, T = 5, 300
    enc = torch.randn(B, T, D, generator=g)
    lengths = torch.tensor([T, 1, 0, 237, 299])
    ref = greedy_tdt_reference(enc, lengths, pred, joint, durations, V, 10)
    fast = greedy_tdt_label_looping(enc, lengths, pred, joint, durations, V, 10)
    n_tokens = 0
    for b, (r, f) in enumerate(zip(ref, fast)):
        assert f.token_ids == r.token_ids, b
        assert f.token_frames == r.token_frames, b
        assert f.token_durations == r.token_durations, b
        assert all(0 <= t < int(lengths[b]) for t in r.token_frames)
        assert all(r.token_frames[i] <= r.token_frames[i + 1] for i in range(len(r.token_frames) - 1))
        n_tokens += len(r.token_ids)
    assert ref[2].token_ids == []
    assert n_tokens > 20  # the random models actually emit tokens
    # channels-first input gives the same result
    cf = greedy_tdt_label_looping(enc.transpose(1, 2), lengths, pred, joint, durations, V, 10,
                                  channels_first=True)
    assert [h.token_ids for h in cf] == [h.token_ids for h in ref]


def test_max_symbols_forced_advance():
    """A model that always emits the same token with duration 0 hits max_symbols on every frame."""
    V, H, D, J = 5, 8, 4, 6
    pred, joint = _random_tdt(0, V, H, 1, D, J, [0, 1, 2])
    with torch.no_grad():
        joint.out.weight.zero_()
        joint.out.bias.zero_()
        joint.out.bias[2] = 5.0  # token 2
        joint.out.bias[V + 1] = 5.0  # duration 0
    enc = torch.randn(2, 6, D)
    lengths = torch.tensor([6, 3])
    for max_symbols in (1, 3, 10):
        for fn in (greedy_tdt_reference, greedy_tdt_label_looping):
            hyps = fn(enc, lengths, pred, joint, [0, 1, 2], V, max_symbols)
            for b, h in enumerate(hyps):
                n = int(lengths[b])
                assert h.token_ids == [2] * (n * max_symbols)
                assert h.token_frames == [t for t in range(n) for _ in range(max_symbols)]
                assert h.token_durations == [0] * (n * max_symbols)


def test_blank_with_duration_zero_advances_one_frame():
    V, H, D, J = 5, 8, 4, 6
    pred, joint = _random_tdt(0, V, H, 1, D, J, [0, 1, 2])
    with torch.no_grad():
        joint.out.weight.zero_()
        joint.out.bias.zero_()
        joint.out.bias[V] = 5.0  # blank
        joint.out.bias[V + 1] = 5.0  # duration 0
    enc = torch.randn(1, 7, D)
    for fn in (greedy_tdt_reference, greedy_tdt_label_looping):
        assert fn(enc, torch.tensor([7]), pred, joint, [0, 1, 2], V, 10)[0].token_ids == []


def test_predictor_sos_is_zero_embedding_and_state_shapes():
    pred = TDTPredictor(10, 12, 2)
    st = pred.init_state(3, torch.device("cpu"), torch.float32)
    assert st[0].shape == (2, 3, 12) and float(st[0].abs().sum()) == 0
    with torch.no_grad():
        pred.embed.weight[10].fill_(1.0)  # even a non-zero blank row gives the zero input
        g1, s1 = pred.step(torch.full((3,), 10), None)
        g0, _ = pred.lstm(torch.zeros(3, 1, 12), st)
    torch.testing.assert_close(g1, g0[:, 0])
    assert s1[0].shape == (2, 3, 12) and s1[1].shape == (2, 3, 12)


def test_low_precision_encoder_output_is_cast_to_the_joint_dtype():
    pred, joint = _random_tdt(5, 20, 16, 1, 12, 10, [0, 1, 2])
    enc = torch.randn(2, 30, 12).to(torch.bfloat16)
    lengths = torch.tensor([30, 17])
    want = greedy_tdt_reference(enc.float(), lengths, pred, joint, [0, 1, 2], 20, 10)
    for fn in (greedy_tdt_reference, greedy_tdt_label_looping):
        got = fn(enc, lengths, pred, joint, [0, 1, 2], 20, 10)
        assert [h.token_ids for h in got] == [h.token_ids for h in want]
