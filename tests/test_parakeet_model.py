"""Parakeet-TDT beyond the one NeMo fixture: other architectures, local attention, bad files,
short/long audio, hub ids, the 0.6B-v3 configuration, public entry points."""

from __future__ import annotations

import copy
import io
import math
import shutil
import tarfile

import numpy as np
import pytest
import torch
from numpy.testing import assert_allclose

import flashasr
from conftest import AUDIO, PARAKEET_FIXTURES
from flashasr.errors import ModelLoadError, UnsupportedModelError
from flashasr.models.parakeet.config import ParakeetConfig, load_yaml_config, parameter_count_formula
from flashasr.models.parakeet.decoder import greedy_tdt_label_looping, greedy_tdt_reference
from flashasr.models.parakeet.encoder import ConformerEncoder, relative_positions
from flashasr.models.parakeet.model import ParakeetASR, ParakeetModule, load_parakeet
from flashasr.options import TranscribeOptions
from flashasr.pipeline import plan_pieces, transcribe_samples
from flashasr.random_models import build_random_parakeet
from flashasr.models.parakeet.nemo_format import ours_to_nemo, read_nemo, write_nemo

TINY = PARAKEET_FIXTURES / "tiny-tdt"
NEMO = TINY / "model.nemo"
V3_YAML = PARAKEET_FIXTURES / "parakeet-tdt-0.6b-v3.yaml"
V2_YAML = PARAKEET_FIXTURES / "parakeet-tdt-0.6b-v2.yaml"


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py


@pytest.fixture(scope="module")
def tiny_archive():
    return read_nemo(NEMO)


@pytest.fixture(scope="module")
def tiny():
    return load_parakeet(NEMO)


@pytest.fixture(scope="module")
def clips():
    ref = np.load(TINY / "reference.npz")
    return [ref["audio"][b, : ref["audio_lengths"][b]] for b in range(4)]


def _variant(base: dict, *, enc=None, dec=None, joint=None, jointnet=None, pre=None, durations=None,
             vocab=None, max_symbols=None) -> dict:
    cfg = copy.deepcopy(base)
    cfg["encoder"].update(enc or {})
    cfg["decoder"].update(dec or {})
    cfg["decoder"]["prednet"].update((dec or {}).get("prednet", {}))
    cfg["joint"].update(joint or {})
    cfg["joint"]["jointnet"].update(jointnet or {})
    cfg["preprocessor"].update(pre or {})
    d_out = cfg["encoder"]["d_model"]
    cfg["joint"]["jointnet"]["encoder_hidden"] = d_out
    cfg["joint"]["jointnet"]["pred_hidden"] = cfg["decoder"]["prednet"]["pred_hidden"]
    cfg["model_defaults"] = {}
    if durations is not None:
        cfg["decoding"]["durations"] = durations
        cfg["loss"]["tdt_kwargs"]["durations"] = durations
        cfg["joint"]["num_extra_outputs"] = len(durations)
    if vocab is not None:
        cfg["decoder"]["vocab_size"] = vocab
        cfg["joint"]["num_classes"] = vocab
        cfg["joint"].pop("vocabulary", None)
        cfg.pop("labels", None)
    if max_symbols is not None:
        cfg["decoding"]["greedy"]["max_symbols"] = max_symbols
    return cfg


def _write(tmp_path, name, cfg, state, tok_bytes, compress=False):
    cfg = copy.deepcopy(cfg)
    cfg["tokenizer"]["model_path"] = "nemo:0123abcd_tokenizer.model"
    path = tmp_path / f"{name}.nemo"
    write_nemo(path, cfg, state, {"0123abcd_tokenizer.model": tok_bytes}, compress=compress)
    return path


VARIANTS = {
    # deeper/narrower, x4 subsampling, xscaling, biases, LayerNorm conv, no joint dropout (joint_net.1)
    "a": dict(enc=dict(d_model=64, n_layers=3, n_heads=2, subsampling_factor=4, subsampling_conv_channels=16,
                       xscaling=True, use_bias=True, conv_kernel_size=5, conv_norm_type="layer_norm"),
              dec=dict(prednet=dict(pred_hidden=32, pred_rnn_layers=1)), jointnet=dict(joint_hidden=48, dropout=0.0),
              durations=[0, 1, 2]),
    # x16 subsampling, 80 mels + hamming window, shared (tied) pos biases, tanh joint, 3 LSTM layers
    "b": dict(enc=dict(d_model=48, n_layers=1, n_heads=3, subsampling_factor=16, subsampling_conv_channels=8,
                       feat_in=80, untie_biases=False, ff_expansion_factor=2),
              pre=dict(features=80, window="hamming", n_fft=None),
              dec=dict(prednet=dict(pred_hidden=40, pred_rnn_layers=3)), jointnet=dict(joint_hidden=24, activation="tanh"),
              durations=[0, 1, 2, 3, 4, 5, 6, 7, 8], max_symbols=3),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_other_architectures_roundtrip_through_nemo_files(tmp_path, tiny_archive, clips, variant):
    cfg = _variant(tiny_archive.config, **VARIANTS[variant])
    ref_model = ParakeetASR.from_config(cfg, seed=7)
    state = ours_to_nemo(ref_model.net.state_dict(), ref_model.cfg.joint_out_index)
    if not cfg["encoder"].get("untie_biases", True):  # NeMo also saves the shared pair at encoder level
        state["encoder.pos_bias_u"] = state["encoder.layers.0.self_attn.pos_bias_u"]
        state["encoder.pos_bias_v"] = state["encoder.layers.0.self_attn.pos_bias_v"]
    path = _write(tmp_path, variant, cfg, state, tiny_archive.tokenizer_model, compress=variant == "b")
    m = load_parakeet(path)
    assert m.num_parameters() == ref_model.num_parameters() == parameter_count_formula(m.cfg)["total"]
    assert m.durations == cfg["decoding"]["durations"]
    audio = [clips[0], clips[1][:24000]]
    a, lens = m._pad_batch(audio)
    e1, l1 = m.encode(a, lens)
    e2, l2 = ref_model.encode(a, lens)
    assert torch.equal(l1, l2) and torch.equal(e1, e2)
    f = cfg["encoder"]["subsampling_factor"]
    flen = torch.tensor([len(c) // 160 for c in audio])
    expect = flen.clone()
    for _ in range(int(math.log2(f))):
        expect = (expect - 1) // 2 + 1
    assert l1.tolist() == expect.tolist()
    ref_h = greedy_tdt_reference(e1, l1, m.predictor, m.joint, m.durations, m.blank_id, m.max_symbols_per_step)
    ll_h = greedy_tdt_label_looping(e1, l1, m.predictor, m.joint, m.durations, m.blank_id, m.max_symbols_per_step)
    assert [(h.token_ids, h.token_frames, h.token_durations) for h in ref_h] == \
           [(h.token_ids, h.token_frames, h.token_durations) for h in ll_h]
    batch = m.transcribe_batch(audio, word_timestamps=True)
    single = [m.transcribe_waveform(c, word_timestamps=True) for c in audio]
    assert [t.text for t in batch] == [t.text for t in single]
    for t, h in zip(batch, ref_h):
        assert t.text == m.tokenizer.decode(h.token_ids)
        assert all(0 <= w.start <= w.end <= t.duration for w in t.words)


@pytest.mark.parametrize("vocab,durations", [(50, [0, 1, 2, 3]), (300, [1, 2, 4]), (1030, [0, 1, 2, 3, 4])])
def test_random_vocab_sizes_and_durations(tiny_archive, clips, vocab, durations):
    cfg = _variant(tiny_archive.config, vocab=vocab, durations=durations,
                   enc=dict(d_model=32, n_layers=1, n_heads=4, subsampling_conv_channels=4))
    m = ParakeetASR.from_config(cfg, seed=vocab)
    assert m.joint.out.out_features == vocab + 1 + len(durations) and m.blank_id == vocab
    clips = [clips[0], clips[1][:20000]]
    a, lens = m._pad_batch(clips)
    enc, L = m.encode(a, lens)
    r = greedy_tdt_reference(enc, L, m.predictor, m.joint, durations, vocab, 10)
    f = greedy_tdt_label_looping(enc, L, m.predictor, m.joint, durations, vocab, 10)
    assert [(h.token_ids, h.token_frames, h.token_durations) for h in r] == \
           [(h.token_ids, h.token_frames, h.token_durations) for h in f]
    assert [t.text for t in m.transcribe_batch(clips)] == [m.tokenizer.decode(h.token_ids) for h in r]


def _banded_reference(attn, x, valid, left, right):
    """Independent rel-pos attention with a band mask (gather instead of rel_shift, explicit softmax)."""
    B, T, d = x.shape
    H, dk = attn.h, attn.d_k
    q = attn.linear_q(x).view(B, T, H, dk).transpose(1, 2)
    k = attn.linear_k(x).view(B, T, H, dk).transpose(1, 2)
    v = attn.linear_v(x).view(B, T, H, dk).transpose(1, 2)
    p = attn.linear_pos(relative_positions(T, d)).view(2 * T - 1, H, dk).transpose(0, 1)  # pos T-1-idx
    ac = (q + attn.pos_bias_u[None, :, None]) @ k.transpose(-1, -2)
    full = (q + attn.pos_bias_v[None, :, None]) @ p.transpose(-1, -2)[None]  # [B, H, T, 2T-1]
    i = torch.arange(T)[:, None]
    j = torch.arange(T)[None, :]
    bd = full.gather(-1, (T - 1 - i + j).expand(B, H, T, T))
    ok = valid[:, None, :, None] & valid[:, None, None, :] & ((j - i) <= right) & ((i - j) <= left)
    scores = ((ac + bd) / math.sqrt(dk)).masked_fill(~ok, -10000.0)
    w = torch.softmax(scores, -1).masked_fill(~ok, 0.0)
    out = (w @ v) * valid[:, None, :, None]
    return attn.linear_out(out.transpose(1, 2).reshape(B, T, d))


def test_local_attention_equals_full_when_context_covers_input(tiny):
    ref = np.load(TINY / "reference.npz")
    feats, flen = torch.from_numpy(ref["features"]), torch.from_numpy(ref["feature_lengths"])
    enc = tiny.encoder
    with torch.no_grad():
        full, L = enc(feats, flen)
        T = full.shape[-1]
        try:
            enc.set_attention_context([T - 1, T - 1])  # covers every pair, but takes the local path
            local, _ = enc(feats, flen)
        finally:
            enc.set_attention_context([-1, -1])
    for b, n in enumerate(L.tolist()):
        assert_allclose(local[b, :, :n].numpy(), full[b, :, :n].numpy(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("T,left,right", [(40, 5, 3), (600, 16, 16), (300, 0, 7)])
def test_local_attention_matches_banded_reference(tiny, T, left, right):
    attn = tiny.encoder.layers[0].self_attn
    g = torch.Generator().manual_seed(T)
    x = torch.randn(2, T, attn.h * attn.d_k, generator=g)
    valid = torch.arange(T)[None, :] < torch.tensor([T, T - 11])[:, None]
    with torch.no_grad():
        want = _banded_reference(attn, x, valid, left, right)
        pos = attn.local_positions(T, attn.h * attn.d_k, left, right)
        got = attn(x, valid, pos, (left, right))
    for b in range(2):
        n = int(valid[b].sum())
        assert_allclose(got[b, :n].numpy(), want[b, :n].numpy(), rtol=1e-4, atol=1e-5)


def test_sdpa_and_math_attention_agree_with_padding(tiny):
    attn = tiny.encoder.layers[1].self_attn
    T = 50
    x = torch.randn(3, T, 96)
    valid = torch.arange(T)[None, :] < torch.tensor([50, 1, 20])[:, None]
    pos = relative_positions(T, 96)
    with torch.no_grad():
        a = attn(x, valid, pos, impl="sdpa")
        b = attn(x, valid, pos, impl="math")
        c = _banded_reference(attn, x, valid, T, T)
    assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-5)
    assert_allclose(a.numpy(), c.numpy(), rtol=1e-5, atol=1e-5)


def test_local_attention_runs_on_long_input(tiny):
    """10 minutes of features (7500 encoder frames) with a [64, 64] window; padding-independent."""
    enc = tiny.encoder
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(1, 128, 60000, generator=g)
    try:
        enc.set_attention_context([64, 64])
        with torch.no_grad():
            out, L = enc(feats, torch.tensor([60000]))
            short, Ls = enc(feats[:, :, :8000], torch.tensor([8000]))
    finally:
        enc.set_attention_context([-1, -1])
    assert int(L[0]) == 7500 and out.shape == (1, 96, 7500) and torch.isfinite(out).all()
    # frames far from the cut only see the first 8000 feature frames: identical up to float noise
    # (2 layers x 64 frames of context + 1-frame subsampling receptive field)
    n = int(Ls[0]) - 2 * 64 - 4
    assert_allclose(out[0, :, :n].numpy(), short[0, :, :n].numpy(), rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- bad files

def _bytes_nemo(tmp_path, data: bytes, name="bad.nemo"):
    p = tmp_path / name
    p.write_bytes(data)
    return p


@pytest.mark.parametrize("frac", [0.5, 0.97])
def test_truncated_archive(tmp_path, frac):
    data = NEMO.read_bytes()
    with pytest.raises(ModelLoadError, match="truncated"):
        load_parakeet(_bytes_nemo(tmp_path, data[: int(len(data) * frac)]))


def test_not_a_tar_and_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match="not a .nemo archive"):
        load_parakeet(_bytes_nemo(tmp_path, b"this is not a tar archive\n" * 100))
    with pytest.raises(ModelLoadError) as e:
        load_parakeet(tmp_path / "nope.nemo")
    assert e.value.code == "model_not_found"
    with pytest.raises(ModelLoadError) as e:
        flashasr.load_model(str(tmp_path / "nope.nemo"))
    assert e.value.code == "model_not_found"


def test_archive_without_weights(tmp_path):
    p = tmp_path / "noweights.nemo"
    with tarfile.open(NEMO) as src, tarfile.open(p, "w:") as dst:
        for m in src.getmembers():
            if not m.name.endswith("model_weights.ckpt"):
                dst.addfile(m, src.extractfile(m))
    with pytest.raises(ModelLoadError, match="model_weights.ckpt"):
        load_parakeet(p)


@pytest.mark.parametrize("section,key,value,match", [
    ("encoder", "_target_", "nemo.collections.asr.modules.SqueezeformerEncoder", "SqueezeformerEncoder"),
    ("decoder", "_target_", "nemo.collections.asr.modules.StatelessTransducerDecoder", "StatelessTransducerDecoder"),
    ("joint", "_target_", "nemo.collections.asr.modules.SampledRNNTJoint", "SampledRNNTJoint"),
    ("encoder", "self_attention_model", "abs_pos", "self_attention_model"),
    ("encoder", "subsampling", "vggnet", "subsampling"),
    ("encoder", "att_context_style", "chunked_limited", "att_context_style"),
    ("encoder", "att_context_size", [[70, 13], [70, 0]], "att_context_size"),
    ("encoder", "conv_norm_type", "fused_batch_norm", "conv_norm_type"),
    ("preprocessor", "_target_", "nemo.collections.asr.modules.AudioToMFCCPreprocessor", "AudioToMFCCPreprocessor"),
    ("", "target", "nemo.collections.asr.models.EncDecCTCModelBPE", "EncDecCTCModelBPE"),
])
def test_unsupported_architecture(tmp_path, tiny_archive, section, key, value, match):
    cfg = copy.deepcopy(tiny_archive.config)
    (cfg[section] if section else cfg)[key] = value
    p = _write(tmp_path, "unsup", cfg, tiny_archive.state_dict, tiny_archive.tokenizer_model)
    with pytest.raises(UnsupportedModelError, match=match):
        load_parakeet(p)


def test_weights_not_matching_config(tmp_path, tiny_archive):
    sd = dict(tiny_archive.state_dict)
    sd["joint.enc.weight"] = sd["joint.enc.weight"][:, :50]
    with pytest.raises(ModelLoadError, match=r"mismatched shapes.*joint\.enc\.weight"):
        load_parakeet(_write(tmp_path, "shape", tiny_archive.config, sd, tiny_archive.tokenizer_model))
    sd = dict(tiny_archive.state_dict)
    del sd["encoder.layers.1.conv.depthwise_conv.weight"]
    with pytest.raises(ModelLoadError, match=r"missing keys.*encoder\.layers\.1\.conv\.depthwise_conv\.weight"):
        load_parakeet(_write(tmp_path, "missing", tiny_archive.config, sd, tiny_archive.tokenizer_model))
    sd = dict(tiny_archive.state_dict)
    sd["encoder.layers.2.norm_out.weight"] = torch.ones(96)
    with pytest.raises(ModelLoadError, match=r"unexpected keys.*layers\.2\.norm_out"):
        load_parakeet(_write(tmp_path, "unexpected", tiny_archive.config, sd, tiny_archive.tokenizer_model))
    cfg = copy.deepcopy(tiny_archive.config)  # 3 layers in the config, 2 in the weights
    cfg["encoder"]["n_layers"] = 3
    with pytest.raises(ModelLoadError, match="missing keys"):
        load_parakeet(_write(tmp_path, "depth", cfg, tiny_archive.state_dict, tiny_archive.tokenizer_model))
    cfg = _variant(tiny_archive.config, vocab=100)
    with pytest.raises(ModelLoadError, match="tokenizer has 128 pieces"):
        load_parakeet(_write(tmp_path, "vocab", cfg, tiny_archive.state_dict, tiny_archive.tokenizer_model))


def test_hybrid_tdt_ctc_model_uses_the_tdt_branch(tmp_path, tiny_archive, tiny, clips):
    cfg = copy.deepcopy(tiny_archive.config)
    cfg["target"] = "nemo.collections.asr.models.hybrid_rnnt_ctc_bpe_models.EncDecHybridRNNTCTCBPEModel"
    cfg["aux_ctc"] = {"decoder": {"_target_": "nemo.collections.asr.modules.ConvASRDecoder",
                                  "feat_in": 96, "num_classes": 128}}
    sd = dict(tiny_archive.state_dict)
    sd["ctc_decoder.decoder_layers.0.weight"] = torch.zeros(129, 96, 1)
    sd["ctc_decoder.decoder_layers.0.bias"] = torch.zeros(129)
    m = load_parakeet(_write(tmp_path, "hybrid", cfg, sd, tiny_archive.tokenizer_model))
    assert m.transcribe_waveform(clips[2]).text == tiny.transcribe_waveform(clips[2]).text


def test_gzip_archive_loads(tmp_path, tiny_archive, tiny, clips):
    p = _write(tmp_path, "gz", tiny_archive.config, tiny_archive.state_dict, tiny_archive.tokenizer_model,
               compress=True)
    assert load_parakeet(p).transcribe_waveform(clips[1]).text == tiny.transcribe_waveform(clips[1]).text


# ---------------------------------------------------------------- audio edge cases, entry points

def test_short_audio_gives_empty_transcript(tiny):
    for n in (0, 1, 100, 159, 160, 1279):
        t = tiny.transcribe_waveform(np.full(n, 0.1, dtype=np.float32), word_timestamps=True)
        assert t.text == "" and t.segments == [] and t.words == [] and t.duration == pytest.approx(n / 16000)
    t = tiny.transcribe_waveform(np.random.default_rng(0).standard_normal(1280).astype(np.float32) * 0.1)
    assert isinstance(t.text, str)  # one encoder frame: decodes without error
    out = tiny.transcribe_batch([np.zeros(10, np.float32), np.zeros(16000, np.float32)])
    assert out[0].text == "" and len(out) == 2


def test_bad_waveform_arguments(tiny):
    with pytest.raises(flashasr.FlashASRError):
        tiny.transcribe_waveform(np.zeros((2, 100), np.float32))
    with pytest.raises(flashasr.FlashASRError):
        tiny.transcribe_waveform(np.zeros(100, np.int16))
    # not sample containers at all: the error names what was given (numpy made them 0-d arrays:
    # "got shape ()"), and raw bytes get the way to decode them
    import collections

    class Broken:  # numpy's view of it fails: named, not a RuntimeError out of the call
        def __array__(self, *a, **k):
            raise RuntimeError("no view")

    for bad, named in (("", "got str"), ({}, "got dict"), (None, "got NoneType"), (0.5, "got float"),
                       (b"\x00\x01", "decode raw PCM first"), ((x for x in [0.1]), "got generator"),
                       (collections.UserDict(a=1), "got UserDict"), (frozenset(), "got frozenset"),
                       (memoryview(np.zeros(9, np.int16)), "decode raw PCM first"), (Broken(), "no view")):
        with pytest.raises(flashasr.FlashASRError, match=named):
            tiny.transcribe_waveform(bad)


def test_long_audio_is_split_with_global_timestamps(tiny):
    """A 60 s real recording cut at pauses into <= 12 s pieces by the pipeline: timestamps are global."""
    from flashasr.audio import load_audio

    wav = load_audio(AUDIO / "long" / "long-silero-test-60s.wav").samples
    m = tiny
    opts = TranscribeOptions(max_segment_s=12.0, word_timestamps=True)
    spans = plan_pieces(wav, opts.resolve(m.capabilities), m.capabilities)
    assert len(spans) >= 5 and all(b - a <= 12 * 16000 for a, b in spans)
    t = transcribe_samples(m, wav, opts)
    assert t.duration == pytest.approx(len(wav) / 16000)
    starts = [w.start for w in t.words]
    assert starts == sorted(starts) and all(0 <= w.start <= w.end <= t.duration for w in t.words)
    assert max(w.end for w in t.words) > 40.0  # words reach the end of the recording
    # the piece texts, each transcribed alone, make up the whole text
    pieces = [m.transcribe_waveform(wav[a:b]).text.strip() for a, b in spans]
    assert t.text == " ".join(p for p in pieces if p)
    # a piece's words shifted by its start equal the words of the long result
    a, b = spans[2]
    local = m.transcribe_waveform(wav[a:b], word_timestamps=True).words
    glob = [w for w in t.words if a / 16000 <= w.start < b / 16000]
    assert [w.word for w in glob] == [w.word for w in local]
    assert_allclose([w.start for w in glob], [w.start + a / 16000 for w in local], atol=1e-9)


def test_fallback_split_without_vad_module():
    from flashasr.pipeline.plan import quiet_split

    x = np.random.default_rng(0).standard_normal(16000 * 100).astype(np.float32)
    x[16000 * 40: 16000 * 41] = 0.0  # a pause inside the last 30 % of the first 50 s window
    spans = quiet_split(x, 16000, 50.0)
    assert spans[0][0] == 0 and spans[-1][1] == len(x)
    assert all(b - a <= 50 * 16000 for a, b in spans)
    assert all(spans[i][1] == spans[i + 1][0] for i in range(len(spans) - 1))
    assert 40 * 16000 <= spans[0][1] <= 41 * 16000


def test_load_model_entry_point_transcribes_real_clip():
    from flashasr.audio import load_audio

    m = flashasr.load_model(str(NEMO))
    assert isinstance(m, ParakeetASR) and m.family == "parakeet"
    wav = load_audio(AUDIO / "en" / "en-ls-61-70968-0002.wav")
    t = m.transcribe_waveform(wav.samples, word_timestamps=True)
    assert t.language is None and t.model == "tiny-tdt"  # model.nemo is named after its folder
    assert t.duration == pytest.approx(2.97, abs=0.01)
    assert t.text and t.segments and t.words is not None


def test_hub_id_resolves_from_local_cache(tmp_path, monkeypatch):
    from flashasr.models.parakeet.hub import resolve_hub_id

    cache = tmp_path / "hub"
    repo = cache / "models--nvidia--parakeet-tdt-0.6b-v3"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    shutil.copy(NEMO, snap / "parakeet-tdt-0.6b-v3.nemo")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    p = resolve_hub_id("nvidia/parakeet-tdt-0.6b-v3")
    assert p.read_bytes() == NEMO.read_bytes()
    m = flashasr.load_model("nvidia/parakeet-tdt-0.6b-v3")
    assert isinstance(m, ParakeetASR) and m.blank_id == 128
    with pytest.raises(ModelLoadError) as e:
        resolve_hub_id("nvidia/parakeet-tdt-1.1b")
    assert e.value.code == "model_not_found"


def test_hub_id_not_cached_says_how_to_get_it(tmp_path, monkeypatch):
    """Found by a new user: an uncached Parakeet id spent ~25 s in hf_hub_download's retries and printed
    the hub's raw error. Now: the cache first, then one snapshot_download attempt, and a message
    naming the cache, the download command and the --model form."""
    import huggingface_hub

    from flashasr.models.parakeet.hub import resolve_hub_id

    def no_retry_loop(*a, **k):
        raise AssertionError("hf_hub_download retries for ~25 s without a network")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", no_retry_loop)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    for offline in ("1", ""):
        monkeypatch.setenv("HF_HUB_OFFLINE", offline)
        with pytest.raises(ModelLoadError) as e:
            resolve_hub_id("nvidia/parakeet-not-a-repo-0000")
        msg = str(e.value)
        assert e.value.code == "model_not_found"
        assert str(tmp_path / "hub") in msg and "huggingface-cli download nvidia/parakeet-not-a-repo-0000" in msg
        assert "--model /path/to/parakeet-not-a-repo-0000.nemo" in msg


# ---------------------------------------------------------------- the real architecture (random weights)

@pytest.mark.parametrize("yaml_path,vocab", [(V3_YAML, 8192), (V2_YAML, 1024)])
def test_v3_v2_configs_parameter_count_and_bf16_memory(yaml_path, vocab):
    raw = load_yaml_config(yaml_path)
    cfg = ParakeetConfig.from_dict(raw)
    assert cfg.vocab_size == vocab and cfg.durations == [0, 1, 2, 3, 4] and cfg.frame_seconds == pytest.approx(0.08)
    with torch.device("meta"):
        net = ParakeetModule(cfg)
    n = sum(p.numel() for p in net.parameters())
    # architecture arithmetic, term by term (d=1024, 24 layers, ff 4096, 8 heads x 128, kernel 9,
    # dw_striding x8 with 256 channels on 128 mels -> 16 bins, LSTM 2 x 640, joint 640)
    d, ff, C, L, H, J = 1024, 4096, 256, 24, 640, 640
    sub = (9 * C + C) + 2 * ((9 * C + C) + (C * C + C)) + (C * 16 * d + d)
    layer = 2 * (2 * d * ff) + 5 * d * d + 2 * 8 * 128 + (2 * d * d + 9 * d + 2 * d + d * d) + 5 * 2 * d
    pred = (vocab + 1) * H + 2 * (8 * H * H + 8 * H)
    joint = (d * J + J) + (H * J + J) + (J * (vocab + 6) + vocab + 6)
    assert n == sub + L * layer + pred + joint == parameter_count_formula(cfg)["total"]
    assert 0.55e9 < n < 0.7e9  # "0.6B"
    assert len(net.state_dict()) == 725  # tensors in the real model_weights.ckpt (yaml header, source C)
    bf16 = sum(p.numel() * torch.finfo(torch.bfloat16).bits // 8 for p in net.parameters())
    assert bf16 == 2 * n
    print(f"\n{yaml_path.name}: {n:,} parameters, bf16 weights {bf16 / 2**30:.3f} GiB")


def test_build_random_parakeet_small_config_is_seeded(tiny_archive):
    cfg = _variant(tiny_archive.config, enc=dict(n_layers=1))
    a = build_random_parakeet(cfg, seed=3)
    b = build_random_parakeet(cfg, seed=3)
    c = build_random_parakeet(cfg, seed=4)
    sa, sb, sc = a.net.state_dict(), b.net.state_dict(), c.net.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["encoder.layers.0.feed_forward1.linear1.weight"],
                           sc["encoder.layers.0.feed_forward1.linear1.weight"])
    assert float(sa["predictor.embed.weight"][a.blank_id].abs().sum()) == 0.0
    bf = build_random_parakeet(cfg, dtype="bfloat16", seed=3)
    assert bf.encoder.layers[0].feed_forward1.linear1.weight.dtype == torch.bfloat16
    assert bf.preprocessor.fb.dtype == torch.float32
    t = bf.transcribe_waveform(np.random.default_rng(0).standard_normal(32000).astype(np.float32) * 0.1)
    assert isinstance(t.text, str)


@pytest.mark.slow
def test_build_random_v3_and_run_one_second():
    m = build_random_parakeet(V3_YAML, dtype="bfloat16", seed=0)
    assert m.num_parameters() == parameter_count_formula(m.cfg)["total"]
    t = m.transcribe_waveform(np.random.default_rng(0).standard_normal(16000).astype(np.float32) * 0.1)
    assert isinstance(t.text, str)


def test_dtype_bf16_encoder_close_to_fp32(tiny, clips):
    bf = load_parakeet(NEMO, dtype="bfloat16")
    a, lens = tiny._pad_batch(clips[:2])
    e32, _ = tiny.encode(a, lens)
    e16, L = bf.encode(a, lens)
    assert e16.dtype == torch.bfloat16
    for b, n in enumerate(L.tolist()):
        err = (e16[b, :n].float() - e32[b, :n]).abs().max() / e32[b, :n].abs().max()
        assert float(err) < 3e-2
    with pytest.raises(ModelLoadError, match="dtype"):
        load_parakeet(NEMO, dtype="int8")


def test_subsampling_splits_huge_batches_identically(tiny):
    ref = np.load(TINY / "reference.npz")
    f, n = torch.from_numpy(ref["features"]), torch.from_numpy(ref["feature_lengths"])
    sub = tiny.encoder.pre_encode
    with torch.no_grad():
        a, la = sub(f.transpose(1, 2), n)
        old = sub.max_conv_elements
        try:
            sub.max_conv_elements = 2_000_000  # forces chunks of 2 items
            b, lb = sub(f.transpose(1, 2), n)
        finally:
            sub.max_conv_elements = old
    assert torch.equal(la, lb)
    assert_allclose(a.numpy(), b.numpy(), rtol=0, atol=1e-6)


def test_bf16_model_keeps_decoder_in_float32(clips):
    m = load_parakeet(NEMO, dtype="bfloat16")
    assert m.encoder.layers[0].self_attn.linear_q.weight.dtype == torch.bfloat16
    assert m.joint.enc.weight.dtype == torch.float32 and m.predictor.lstm.weight_hh_l0.dtype == torch.float32
    assert isinstance(m.transcribe_waveform(clips[2]).text, str)


def test_four_hour_request_plumbing(tiny, monkeypatch):
    """A 4 h single request: 240 pieces of <= 60 s, global timestamps up to 14,400 s.

    The per-piece decode is stubbed (one token "▁a" at each piece's first frame) so the test is
    fast; the real path is covered by test_long_audio_is_split_with_global_timestamps and the
    slow end-to-end test below. ``np.zeros`` pages are never touched, so memory stays small."""
    from flashasr.models.parakeet.decoder import Hypothesis

    n = 4 * 3600 * 16000
    wav = np.zeros(n, dtype=np.float32)
    seen = []

    def fake_decode(pieces):
        seen.extend(len(p) for p in pieces)
        return [Hypothesis([2], [0], [1]) for _ in pieces]

    monkeypatch.setattr(tiny, "_decode_pieces", fake_decode)
    t = transcribe_samples(tiny, wav, TranscribeOptions(segmentation="fixed", word_timestamps=True))
    assert len(seen) == 240 and max(seen) <= 60 * 16000 and sum(seen) == n
    assert t.duration == 14400.0 and len(t.words) == 240
    assert [w.start for w in t.words] == [60.0 * k for k in range(240)]
    assert t.words[-1].end == pytest.approx(14340.08) and t.text == " ".join(["a"] * 240)


@pytest.mark.slow
def test_twenty_minutes_real_audio_end_to_end(tiny):
    """VAD cuts + tiny model over 20 min of real speech (the 60 s clip repeated)."""
    from flashasr.audio import load_audio

    clip = load_audio(AUDIO / "long" / "long-silero-test-60s.wav").samples
    wav = np.resize(clip, 1200 * 16000).astype(np.float32)
    t = transcribe_samples(tiny, wav, TranscribeOptions(word_timestamps=True))
    assert t.duration == 1200.0 and t.words[-1].end > 1150.0
    assert all(0 <= w.start <= w.end <= 1200.0 for w in t.words)
    assert [w.start for w in t.words] == sorted(w.start for w in t.words)


def test_parakeet_refuses_translation_by_name():
    from flashasr.errors import UnsupportedTaskError

    m = flashasr.load_model(str(NEMO))
    assert not m.translates
    w = np.zeros(16000, np.float32)
    with pytest.raises(UnsupportedTaskError, match=r"model '.*' \(parakeet-tdt\) cannot translate") as e:
        m.transcribe_waveform(w, task="translate")
    assert e.value.code == "unsupported_task" and e.value.status == 400
    assert m.transcribe_waveform(w, task="transcribe").duration == pytest.approx(1.0)
