"""Parakeet-TDT against NVIDIA NeMo 3.0.0 reference outputs (../shared/fixtures/parakeet/tiny-tdt).

Follows the fixture README's "How a test should use them": our own .nemo loader, preprocessor,
encoder and decoders; tolerances from its table; token ids / frames / durations / texts exact.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from numpy.testing import assert_allclose

from conftest import PARAKEET_FIXTURES
from flashasr.models.parakeet.decoder import greedy_tdt_label_looping, greedy_tdt_reference
from flashasr.models.parakeet.model import load_parakeet

TINY = PARAKEET_FIXTURES / "tiny-tdt"


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py


@pytest.fixture(scope="module")
def ref():
    return dict(np.load(TINY / "reference.npz"))


@pytest.fixture(scope="module")
def meta():
    return json.loads((TINY / "meta.json").read_text())


@pytest.fixture(scope="module")
def model():
    return load_parakeet(TINY / "model.nemo")


def _items(ref):
    return [ref["audio"][b, : ref["audio_lengths"][b]] for b in range(len(ref["audio_lengths"]))]


def test_loaded_model_matches_fixture_description(model, meta):
    assert model.num_parameters() == meta["num_parameters"]
    assert model.blank_id == meta["blank_id"] == 128
    assert model.durations == [0, 1, 2, 3, 4]
    assert model.num_classes_with_blank == 129 and model.max_symbols_per_step == 10
    assert model.frame_seconds == pytest.approx(0.08)
    assert model.joint.out.out_features == 134


def test_features_padded_batch_and_single(model, ref):
    feats, flen = model.features(torch.from_numpy(ref["audio"]), torch.from_numpy(ref["audio_lengths"]))
    assert flen.tolist() == ref["feature_lengths"].tolist()
    assert tuple(feats.shape) == ref["features"].shape
    for b, n in enumerate(ref["feature_lengths"]):
        assert_allclose(feats[b, :, :n].numpy(), ref["features"][b, :, :n], rtol=1e-4, atol=5e-4)
        assert float(feats[b, :, n:].abs().max() if feats.shape[-1] > n else 0.0) == 0.0
    for b, wav in enumerate(_items(ref)):
        f1, l1 = model.features(torch.from_numpy(wav)[None], torch.tensor([len(wav)]))
        n = int(ref["feature_lengths"][b])
        assert int(l1[0]) == n
        assert_allclose(f1[0, :, :n].numpy(), ref["features"][b, :, :n], rtol=1e-4, atol=5e-4)


@pytest.mark.parametrize("impl", ["sdpa", "math"])
def test_encoder_from_nemo_features(model, ref, impl):
    model.encoder.attention_impl = impl
    try:
        with torch.no_grad():
            enc, L, inter = model.encoder(torch.from_numpy(ref["features"]), torch.from_numpy(ref["feature_lengths"]),
                                          return_intermediates=True)
    finally:
        model.encoder.attention_impl = "sdpa"
    assert L.tolist() == ref["encoded_lengths"].tolist() == ref["pre_encode_lengths"].tolist()
    for b, n in enumerate(ref["encoded_lengths"]):
        assert_allclose(inter["pre_encode"][b, :n].numpy(), ref["pre_encode_output"][b, :n], rtol=1e-4, atol=1e-4)
        assert_allclose(inter["layer0"][b, :n].numpy(), ref["layer0_output"][b, :n], rtol=1e-4, atol=1e-4)
        assert_allclose(enc[b, :, :n].numpy(), ref["encoder_output"][b, :, :n], rtol=1e-4, atol=1e-4)


def test_encoder_end_to_end_batch_and_single(model, ref):
    audio, lengths = torch.from_numpy(ref["audio"]), torch.from_numpy(ref["audio_lengths"])
    enc, L = model.encode(audio, lengths)
    assert L.tolist() == ref["encoded_lengths"].tolist()
    for b, n in enumerate(ref["encoded_lengths"]):
        assert_allclose(enc[b, :n].numpy(), ref["encoder_output"][b, :, :n].T, rtol=1e-3, atol=5e-4)
    for b, wav in enumerate(_items(ref)):
        e1, l1 = model.encode(torch.from_numpy(wav)[None], torch.tensor([len(wav)]))
        n = int(ref["encoded_lengths"][b])
        assert int(l1[0]) == n and e1.shape[1] == n
        assert_allclose(e1[0].numpy(), ref["encoder_output"][b, :, :n].T, rtol=1e-3, atol=5e-4)


def test_predictor_and_joint_first_step(model, ref):
    B = len(ref["audio_lengths"])
    with torch.no_grad():
        g, state = model.predictor.step(torch.full((B,), model.blank_id), None)
        assert_allclose(g.numpy(), ref["sos_predictor_output"], rtol=1e-4, atol=1e-5)
        assert state[0].shape == (2, B, 64)
        f = model.joint.project_encoder(torch.from_numpy(ref["encoder_output"]).transpose(1, 2))[:, 0]
        logits = model.joint.joint_after_projection(f, model.joint.project_predictor(g))
    assert_allclose(logits.numpy(), ref["joint_logits_first_step"], rtol=1e-4, atol=1e-4)


def _check_hyps(hyps, ref):
    for b, h in enumerate(hyps):
        assert h.token_ids == ref[f"item{b}_token_ids"].tolist(), b
        assert h.token_frames == ref[f"item{b}_token_frames"].tolist(), b
        assert h.token_durations == ref[f"item{b}_token_durations"].tolist(), b


@pytest.mark.parametrize("fn", [greedy_tdt_reference, greedy_tdt_label_looping])
def test_decode_from_nemo_encoder_output(model, ref, fn):
    hyps = fn(torch.from_numpy(ref["encoder_output"]), torch.from_numpy(ref["encoded_lengths"]), model.predictor,
              model.joint, model.durations, model.blank_id, model.max_symbols_per_step, channels_first=True)
    _check_hyps(hyps, ref)
    assert [model.tokenizer.decode(h.token_ids) for h in hyps] == ref["texts"].tolist()


def test_decode_from_our_encoder_batch_and_single(model, ref):
    enc, L = model.encode(torch.from_numpy(ref["audio"]), torch.from_numpy(ref["audio_lengths"]))
    _check_hyps(model.decode(enc, L), ref)
    texts = [t.text for t in model.transcribe_batch(_items(ref))]
    assert texts == ref["texts"].tolist()
    for b, wav in enumerate(_items(ref)):
        t = model.transcribe_waveform(wav)
        assert t.text == ref["texts"][b]
        assert t.language is None and t.duration == pytest.approx(len(wav) / 16000)


def test_word_timestamps_match_nemo_transcribe(model, ref, meta):
    """NeMo transcribe(timestamps=True) words; item 0 is run zero-padded to 1 s as NeMo does."""
    items = _items(ref)
    wav0 = items[0]
    pad = 16000 - len(wav0)
    items[0] = np.concatenate([np.zeros(pad // 2, np.float32), wav0, np.zeros(pad - pad // 2, np.float32)])
    ts = model.transcribe_batch(items, word_timestamps=True)
    assert [t.text for t in ts] == meta["transcribe_texts"]
    for t, want in zip(ts, meta["transcribe_word_timestamps"]):
        assert [w.word.strip() for w in t.words] == [w["word"] for w in want]
        for w, nw in zip(t.words, want):
            assert w.start == pytest.approx(nw["start"], abs=1e-6)
            assert w.end == pytest.approx(min(nw["end"], t.duration), abs=1e-6)  # ours clamp to duration
        assert all(0.0 <= s.start <= s.end <= t.duration for s in t.segments)
        assert "".join(s.text for s in t.segments).strip() == t.text
        # segments break after sentence punctuation
        for s in t.segments[:-1]:
            assert s.text.rstrip()[-1] in ".?!"


def test_pad_min_seconds_reproduces_nemo_transcribe(model, ref, meta):
    """With NeMo transcribe()'s 1 s minimum padding the 0.7 s clip gives transcribe()'s text."""
    wav0 = _items(ref)[0]
    model.pad_min_seconds = 1.0
    try:
        t = model.transcribe_waveform(wav0, word_timestamps=True)
    finally:
        model.pad_min_seconds = 0.0
    assert t.text == meta["transcribe_texts"][0] != ref["texts"][0]
    assert t.duration == pytest.approx(0.7)
    assert all(0.0 <= w.start <= w.end <= 0.7 for w in t.words)


def test_transcript_of_and_merge_shift_and_clamp(model, ref):
    """Hypotheses from any decoder (engine integration) -> a piece's transcript; the pipeline's
    merger puts pieces at their offsets -> global, clamped times."""
    from flashasr.models.parakeet.decoder import Hypothesis
    from flashasr.options import TranscribeOptions
    from flashasr.pipeline import merge_pieces

    opts = TranscribeOptions(word_timestamps=True)
    h = Hypothesis(ref["item2_token_ids"].tolist(), ref["item2_token_frames"].tolist(),
                   ref["item2_token_durations"].tolist())
    one = model.transcript_of(h, 5.0, options=opts)
    assert one.text == ref["texts"][2]
    two = merge_pieces([(0.0, model.transcript_of(h, 7.5, options=opts)), (7.5, model.transcript_of(h, 5.5, options=opts))],
                       13.0, options=opts)
    assert two.text == ref["texts"][2] + " " + ref["texts"][2]
    n = len(one.words)
    assert [w.word for w in two.words] == [w.word for w in one.words] * 2
    assert_allclose([w.start for w in two.words[n:]], [w.start + 7.5 for w in one.words])
    assert [s.id for s in two.segments] == list(range(len(two.segments)))
    short = model.transcript_of(h, 2.0, options=opts)  # clamp to duration
    assert all(0.0 <= w.start <= w.end <= 2.0 for w in short.words)
