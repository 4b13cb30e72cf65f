"""Whisper log-mel front end against an independent numpy computation, and the tokenizer's
special tokens / decoding logit rules on synthetic inputs."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch

from flashasr.models.whisper.features import N_FRAMES, log_mel_spectrogram, mel_filterbank, pad_or_trim


# ---- independent reference (written separately from features.py) ------------------------------
def _slaney_mel(hz: float) -> float:
    # Slaney's Auditory Toolbox scale: 3 mels per 200 Hz below 1 kHz, log spacing above
    # (27 steps per factor 6.4).
    if hz < 1000.0:
        return 3.0 * hz / 200.0
    return 15.0 + 27.0 * math.log(hz / 1000.0) / math.log(6.4)


def _slaney_hz(mel: float) -> float:
    if mel < 15.0:
        return 200.0 * mel / 3.0
    return 1000.0 * 6.4 ** ((mel - 15.0) / 27.0)


def _reference_filterbank(n_mels: int, sr: int = 16000, n_fft: int = 400) -> np.ndarray:
    top = _slaney_mel(sr / 2)
    centers = [_slaney_hz(top * i / (n_mels + 1)) for i in range(n_mels + 2)]
    fb = np.zeros((n_mels, n_fft // 2 + 1))
    for m in range(n_mels):
        lo, mid, hi = centers[m], centers[m + 1], centers[m + 2]
        for k in range(n_fft // 2 + 1):
            f = k * sr / n_fft
            if lo < f <= mid:
                fb[m, k] = (f - lo) / (mid - lo)
            elif mid < f < hi:
                fb[m, k] = (hi - f) / (hi - mid)
        fb[m] *= 2.0 / (hi - lo)  # equal-area normalisation
    return fb


def _reference_log_mel(x: np.ndarray, n_mels: int) -> np.ndarray:
    n_fft, hop = 400, 160
    padded = np.pad(x.astype(np.float64), n_fft // 2, mode="reflect")
    n_frames = 1 + (len(padded) - n_fft) // hop
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n_fft) / n_fft)  # periodic Hann
    frames = np.stack([padded[i * hop: i * hop + n_fft] * window for i in range(n_frames)])
    power = np.abs(np.fft.rfft(frames, axis=1)) ** 2  # [frames, 201]
    power = power[:-1]  # the reference drops the last frame
    mel = _reference_filterbank(n_mels) @ power.T
    logm = np.log10(np.maximum(mel, 1e-10))
    logm = np.maximum(logm, logm.max() - 8.0)
    return (logm + 4.0) / 4.0


@pytest.mark.parametrize("n_mels", [80, 128])
def test_filterbank_matches_independent_formula(n_mels):
    ours = mel_filterbank(n_mels)
    ref = _reference_filterbank(n_mels)
    assert ours.shape == (n_mels, 201)
    np.testing.assert_allclose(ours, ref, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("n_mels", [80, 128])
def test_log_mel_matches_independent_computation(n_mels):
    rng = np.random.default_rng(0)
    t = np.arange(16000 * 3) / 16000
    x = (0.3 * np.sin(2 * np.pi * 440 * t) + 0.1 * np.sin(2 * np.pi * 3100 * t)
         + 0.02 * rng.standard_normal(t.size)).astype(np.float32)
    ours = log_mel_spectrogram(x, n_mels).numpy()
    ref = _reference_log_mel(x, n_mels)
    assert ours.shape == ref.shape == (n_mels, x.size // 160)
    np.testing.assert_allclose(ours, ref, atol=1e-4)


def test_log_mel_on_real_speech(audio_dir):
    from flashasr.audio import load_audio

    x = load_audio(audio_dir / "en" / "en-jfk-inaugural.wav").samples[: 16000 * 4]
    ours = log_mel_spectrogram(x, 80, padding=16000).numpy()
    ref = _reference_log_mel(np.concatenate([x, np.zeros(16000, np.float32)]), 80)
    np.testing.assert_allclose(ours, ref, atol=1e-4)
    # dynamic range: at most 8 decades => (8)/4 = 2 in normalised units
    assert ours.max() - ours.min() <= 2.0 + 1e-6


def test_pad_or_trim():
    m = torch.ones(80, 10)
    assert pad_or_trim(m).shape == (80, N_FRAMES)
    assert pad_or_trim(m)[:, 10:].abs().sum() == 0
    assert pad_or_trim(torch.ones(80, N_FRAMES + 5)).shape == (80, N_FRAMES)


def test_log_mel_rejects_2d():
    with pytest.raises(ValueError):
        log_mel_spectrogram(np.zeros((2, 1000), np.float32))


# ---- tokenizer -----------------------------------------------------------------------------
def _tok(name):
    from flashasr.models.whisper.embedded import embedded_dir
    from flashasr.models.whisper.tokenizer import WhisperTokenizer

    return WhisperTokenizer(embedded_dir(name) / "tokenizer.json", n_vocab=51864 if name == "tiny.en" else 51865)


def test_special_tokens_english_and_multilingual():
    en, ml = _tok("tiny.en"), _tok("base")
    # English-only vocabulary: eot 50256, sot 50257, timestamps after <|notimestamps|> 50362.
    assert (en.eot, en.sot, en.no_timestamps, en.timestamp_begin) == (50256, 50257, 50362, 50363)
    assert en.no_speech == 50361 and not en.multilingual and en.sot_sequence("en") == [50257]
    # Multilingual: everything one later; 99 languages.
    assert (ml.eot, ml.sot, ml.transcribe, ml.no_timestamps, ml.timestamp_begin) == (50257, 50258, 50359, 50363, 50364)
    assert ml.multilingual and len(ml.language_tokens) == 99
    assert ml.sot_sequence("de") == [50258, ml.language_tokens["de"], 50359]
    assert list(ml.language_tokens)[:3] == ["en", "zh", "de"]
    assert en.decode(en.encode(" Hello world")) == " Hello world"
    assert 220 in en.suppress_tokens_begin and en.eot in en.suppress_tokens_begin
    assert en.sot in en.suppress_tokens and en.no_speech in en.suppress_tokens


def test_large_v3_tokenizer_is_derived(tmp_path):
    from flashasr.models.whisper.embedded import embedded_dir
    from flashasr.models.whisper.loaders import _large_v3_tokenizer_json
    from flashasr.models.whisper.tokenizer import WhisperTokenizer

    p = _large_v3_tokenizer_json(embedded_dir("base") / "tokenizer.json", tmp_path)
    t = WhisperTokenizer(p, n_vocab=51866)
    assert len(t.language_tokens) == 100 and t.language_tokens["yue"] == 50358
    assert (t.translate, t.transcribe, t.no_speech, t.no_timestamps, t.timestamp_begin) == (
        50359, 50360, 50363, 50364, 50365)


def test_non_speech_tokens_cover_symbols():
    t = _tok("tiny.en")
    ns = set(t.non_speech_tokens)
    for s in ['"', "#", "(", ")", "[", "]", "♪"]:
        assert t.encode(s)[0] in ns
    assert t.encode(" the")[0] not in ns


# ---- logit rules -------------------------------------------------------------------------------
def test_timestamp_rules():
    from flashasr.models.whisper.decoding import LogitRules

    t = _tok("tiny.en")
    v, tb = 51864, t.timestamp_begin
    rules = LogitRules(t, v, "cpu")
    neg = float("-inf")
    state0 = (torch.zeros(2, dtype=torch.bool), torch.ones(2, dtype=torch.bool), torch.full((2,), -1))
    # step 0: only timestamps <= 1.0 s (index 50) allowed, never text or <|notimestamps|>
    out = rules.apply(torch.zeros(2, v), 0, state0)
    allowed = torch.isfinite(out[0]).nonzero()[:, 0]
    assert allowed.min() == tb and allowed.max() == tb + 50
    # after [ts, text, ts(=1.00 s)]: last is a timestamp after text -> only timestamps >= it, or eot
    st = (torch.tensor([True]), torch.tensor([False]), torch.tensor([tb + 50]))
    logits = torch.zeros(1, v)
    logits[0, t.eot] = 20.0  # eot likelier than all timestamps together: no forced timestamp
    out = rules.apply(logits, 3, st)
    ok = torch.isfinite(out[0]).nonzero()[:, 0].tolist()
    assert t.eot in ok and (tb + 50) in ok and (tb + 49) not in ok and all(i >= t.eot for i in ok)
    # after two timestamps: text only (timestamps forbidden)
    st = (torch.tensor([True]), torch.tensor([True]), torch.tensor([tb + 50]))
    out = rules.apply(torch.zeros(1, v), 4, st)
    assert not torch.isfinite(out[0, tb:]).any() and torch.isfinite(out[0, t.encode(" the")]).all()
    # forced timestamp: timestamp mass beats every text token
    logits = torch.full((1, v), neg)
    logits[0, 100] = 0.0
    logits[0, tb + 60: tb + 70] = -0.5
    st = (torch.tensor([False]), torch.tensor([True]), torch.tensor([tb + 50]))
    out = rules.apply(logits, 4, st)
    assert out[0, 100] == neg and out[0, tb + 60] > neg


def test_dtw_and_median_filter():
    from flashasr.models.whisper.alignment import dtw, median_filter

    rng = np.random.default_rng(3)
    cost = rng.random((6, 9))
    rows, cols = dtw(cost)
    assert rows[0] == 0 and cols[0] == 0 and rows[-1] == 5 and cols[-1] == 8
    steps = set(zip(np.diff(rows).tolist(), np.diff(cols).tolist()))
    assert steps <= {(1, 1), (1, 0), (0, 1)}
    # brute-force minimum over all monotonic paths equals the DTW path cost
    @functools.lru_cache(maxsize=None)
    def best(i, j):
        if i == 0 and j == 0:
            return cost[0, 0]
        opts = [best(a, b) for a, b in ((i - 1, j - 1), (i - 1, j), (i, j - 1)) if a >= 0 and b >= 0]
        return cost[i, j] + min(opts)
    assert cost[rows, cols].sum() == pytest.approx(best(5, 8))
    # a diagonal cheap band is followed
    c = np.ones((5, 5)) - np.eye(5)
    r, k = dtw(c)
    assert r.tolist() == k.tolist() == [0, 1, 2, 3, 4]
    x = torch.tensor([[1.0, 9.0, 1.0, 1.0, 1.0, 5.0, 5.0, 5.0]])
    assert median_filter(x, 3)[0, 1] == 1.0 and median_filter(x, 3).shape == x.shape


def test_fallback_reuses_initial_results():
    """``decode_with_fallback(initial=...)`` keeps confident rows without decoding them again and
    picks the best try for rows where every temperature fails."""
    from flashasr.models.whisper import decoding as D

    good = D.DecodingResult([1], [-0.1], " hi", "en", -0.2, -0.4, 0.01, 0.0, 1.0)
    bad = D.DecodingResult([2], [-3.0], " uh", "en", -1.5, -3.0, 0.57, 0.0, 1.0)
    calls = []

    def fake_decode(model, tok, feats, langs, *, temperature, **kw):
        calls.append((temperature, feats.shape[0]))
        return [D.DecodingResult([3], [-2.0], " eh", "en", -1.2 - temperature, -2.4, 0.57, temperature, 1.0)
                for _ in langs]

    orig = D.decode_windows
    D.decode_windows = fake_decode
    try:
        out = D.decode_with_fallback(None, None, torch.zeros(2, 4, 8), ["en", "en"], seeds=[0, 1],
                                     initial=[good, bad])
    finally:
        D.decode_windows = orig
    assert out[0] is good and [t for t, _ in calls] == [0.2, 0.4, 0.6, 0.8, 1.0]
    assert all(n == 1 for _, n in calls)  # only the failing row is decoded again
    assert out[1].avg_logprob == -1.4 and out[1].fallback_exhausted  # best failed try (T=0.2)
    assert D.is_no_speech(out[1])  # no_speech_prob 0.57 > 0.55 with every temperature failed
    assert not D.is_no_speech(good)
