"""Helpers of bench/bench_gpu_nemo_peer.py that need no NeMo (the NeMo run itself is a device
benchmark: scripts/gpu_bench_nemo_peer.sh; its CPU smoke test needs nemo-toolkit, which CI lacks)."""

from __future__ import annotations

import argparse
import sys

import numpy as np
import pytest

from conftest import PARAKEET_FIXTURES, REPO

sys.path.insert(0, str(REPO / "bench"))
import bench_gpu_nemo_peer as peer  # noqa: E402


def test_tokenizer_has_exact_size_and_is_deterministic(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    p1 = peer.train_tokenizer(tmp_path / "a", 512, seed=3)
    p2 = peer.train_tokenizer(tmp_path / "b", 512, seed=3)
    assert p1.read_bytes() == p2.read_bytes()
    sp = spm.SentencePieceProcessor(model_file=str(p1))
    assert sp.get_piece_size() == 512
    assert sp.id_to_piece(0) == "<unk>"
    assert (tmp_path / "a" / "vocab.txt").read_text().count("\n") == 512


def test_sorted_batches_cover_every_input_once_longest_first():
    rng = np.random.default_rng(0)
    lengths = [int(x) for x in rng.integers(8000, 30 * 16000, size=101)]
    plan = peer.sorted_batches(lengths, max_batch=16, max_seconds=120.0)
    flat = [i for b in plan for i in b]
    assert sorted(flat) == list(range(len(lengths)))
    assert [lengths[i] for i in flat] == sorted(lengths, reverse=True)
    for b in plan:
        assert len(b) <= 16
        assert len(b) == 1 or len(b) * lengths[b[0]] <= 120 * 16000


def test_agreement_counts():
    a = [[1, 2, 3], [4], [], [5, 6]]
    b = [[1, 2, 3], [4, 7], [], [6, 5]]
    r = peer.agreement(a, b)
    assert r["inputs"] == 4 and r["identical_inputs"] == 2
    assert r["identical_fraction"] == 0.5
    # matching positions 3 + 1 + 0 + 0 over max-lengths 3 + 2 + 0 + 2
    assert r["token_position_match"] == pytest.approx(4 / 7)
    assert (r["tokens_a"], r["tokens_b"]) == (6, 7)


def test_smoke_config_is_a_valid_small_v3():
    from flashasr.models.parakeet.config import ParakeetConfig

    yaml = PARAKEET_FIXTURES / "parakeet-tdt-0.6b-v3.yaml"
    if not yaml.exists():
        pytest.skip(f"{yaml} missing")
    full = peer.load_v3_config(yaml)
    small = ParakeetConfig.from_dict(peer.smoke_overrides(full))
    assert (small.vocab_size, small.encoder.n_layers, small.encoder.d_model) == (128, 2, 64)
    assert small.durations == [0, 1, 2, 3, 4]
    assert ParakeetConfig.from_dict(full).vocab_size == 8192  # the original is left unchanged


def test_load_pieces_pads_short_inputs_to_one_second_centered(tmp_path):
    pieces = [np.full(4000, 1000, np.int16), np.full(20000, -2000, np.int16)]
    path = tmp_path / "speech.npz"
    np.savez(path, lengths=np.array([len(p) for p in pieces]), audio=np.concatenate(pieces),
             names=np.array(["a", "b"]))
    out = peer.load_pieces(argparse.Namespace(speech=str(path), max_pieces=0))
    assert [len(w) for w in out] == [16000, 20000]
    assert all(w.dtype == np.float32 for w in out)
    left = (16000 - 4000) // 2
    assert not out[0][:left].any() and not out[0][left + 4000:].any()
    np.testing.assert_allclose(out[0][left: left + 4000], 1000 / 32768.0)
    np.testing.assert_allclose(out[1], -2000 / 32768.0)
