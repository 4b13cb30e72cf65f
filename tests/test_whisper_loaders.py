"""Whisper checkpoint loaders: the embedded CTranslate2 models, synthetic OpenAI ``.pt`` and
Hugging Face directories written from the real tiny.en weights, and clear errors on bad files."""

from __future__ import annotations

import functools
import json
import shutil
import struct

import numpy as np
import pytest
import torch

from flashasr.errors import FlashASRError, ModelLoadError, UnsupportedModelError
from flashasr.models.whisper.embedded import embedded_dir, load_embedded
from flashasr.models.whisper.loaders import MultiFileReader, load_whisper, read_ct2_model_bin


@functools.lru_cache(maxsize=1)
def tiny():
    return load_embedded("tiny.en")


@functools.lru_cache(maxsize=1)
def tiny_ct2_vars():
    with open(embedded_dir("tiny.en") / "model.bin", "rb") as f:
        return read_ct2_model_bin(f)[2]


def test_registry_loads_default_tiny_en():
    from flashasr.models.registry import load_model

    m = load_model(None)
    assert m.name == "whisper-tiny.en" and m.family == "whisper" and not m.multilingual
    assert m.max_segment_seconds == 30.0 and m.device == "cpu"
    d = m.model.dims
    assert (d.n_mels, d.n_audio_layer, d.n_text_layer, d.n_audio_state, d.n_vocab) == (80, 4, 4, 384, 51864)
    n = m.model.num_parameters()
    assert 36e6 < n < 40e6, n  # tiny ~ 39 M (OpenAI's count); 37.2 M with the tied projection once


def test_base_loads_from_two_package_parts():
    m = load_embedded("base")
    d = m.model.dims
    assert m.name == "whisper-base" and m.multilingual
    assert (d.n_audio_layer, d.n_text_layer, d.n_audio_state, d.n_audio_head, d.n_vocab) == (6, 6, 512, 8, 51865)
    n = m.model.num_parameters()
    assert 70e6 < n < 75e6, n  # base ~ 74 M
    assert m.alignment_heads and len(m.alignment_heads) == 8


def test_multi_file_reader_crosses_the_boundary(tmp_path):
    rng = np.random.default_rng(1)
    data = rng.integers(0, 256, 10_000, dtype=np.uint8).tobytes()
    (tmp_path / "a").write_bytes(data[:3333])
    (tmp_path / "b").write_bytes(data[3333:])
    r = MultiFileReader([tmp_path / "a", tmp_path / "b"])
    assert r.size == 10_000
    assert r.read(3000) == data[:3000]
    assert r.read(1000) == data[3000:4000]  # spans both files
    r.seek(9990)
    assert r.read(100) == data[9990:]  # short read at the end
    r.close()


# ---- synthetic OpenAI / HF checkpoints from the real CT2 tiny.en weights ----------------------
def _ct2_to_named(v, style):
    """Write tiny.en's CT2 variables under OpenAI or HF key names (test-local mapping)."""
    out = {}
    hf = style == "hf"
    pre_e, pre_d = ("model.encoder", "model.decoder") if hf else ("encoder", "decoder")
    for c in ("conv1", "conv2"):
        out[f"{pre_e}.{c}.weight"] = v[f"encoder/{c}/weight"]
        out[f"{pre_e}.{c}.bias"] = v[f"encoder/{c}/bias"]
    out[f"{pre_e}.embed_positions.weight" if hf else "encoder.positional_embedding"] = v["encoder/position_encodings/encodings"]
    names = (dict(q="q_proj", k="k_proj", v="v_proj", o="out_proj", attn="self_attn", cross="encoder_attn",
                  attn_ln="self_attn_layer_norm", cross_ln="encoder_attn_layer_norm", mlp_ln="final_layer_norm",
                  fc1="fc1", fc2="fc2", block="layers")
             if hf else dict(q="query", k="key", v="value", o="out", attn="attn", cross="cross_attn",
                             attn_ln="attn_ln", cross_ln="cross_attn_ln", mlp_ln="mlp_ln", fc1="mlp.0",
                             fc2="mlp.2", block="blocks"))

    def ln(dst, src):
        out[dst + ".weight"], out[dst + ".bias"] = v[src + "/gamma"], v[src + "/beta"]

    def lin(dst, src):
        out[dst + ".weight"], out[dst + ".bias"] = v[src + "/weight"], v[src + "/bias"]

    for side, pre in (("encoder", pre_e), ("decoder", pre_d)):
        for i in range(4):
            s, d = f"{side}/layer_{i}", f"{pre}.{names['block']}.{i}"
            w, b = v[s + "/self_attention/linear_0/weight"], v[s + "/self_attention/linear_0/bias"]
            q, k, vv = w.chunk(3)
            qb, kb, vb = b.chunk(3)
            assert torch.all(kb == 0)  # Whisper's key projection has no bias
            a = f"{d}.{names['attn']}"
            out[f"{a}.{names['q']}.weight"], out[f"{a}.{names['q']}.bias"] = q.clone(), qb.clone()
            out[f"{a}.{names['k']}.weight"] = k.clone()
            out[f"{a}.{names['v']}.weight"], out[f"{a}.{names['v']}.bias"] = vv.clone(), vb.clone()
            lin(f"{a}.{names['o']}", s + "/self_attention/linear_1")
            ln(f"{d}.{names['attn_ln']}", s + "/self_attention/layer_norm")
            if side == "decoder":
                c = f"{d}.{names['cross']}"
                lin(f"{c}.{names['q']}", s + "/attention/linear_0")
                kw, vw = v[s + "/attention/linear_1/weight"].chunk(2)
                _, vbias = v[s + "/attention/linear_1/bias"].chunk(2)
                out[f"{c}.{names['k']}.weight"] = kw.clone()
                out[f"{c}.{names['v']}.weight"], out[f"{c}.{names['v']}.bias"] = vw.clone(), vbias.clone()
                lin(f"{c}.{names['o']}", s + "/attention/linear_2")
                ln(f"{d}.{names['cross_ln']}", s + "/attention/layer_norm")
            ln(f"{d}.{names['mlp_ln']}", s + "/ffn/layer_norm")
            lin(f"{d}.{names['fc1']}", s + "/ffn/linear_0")
            lin(f"{d}.{names['fc2']}", s + "/ffn/linear_1")
    ln(f"{pre_e}.layer_norm" if hf else "encoder.ln_post", "encoder/layer_norm")
    ln(f"{pre_d}.layer_norm" if hf else "decoder.ln", "decoder/layer_norm")
    out[f"{pre_d}.embed_tokens.weight" if hf else "decoder.token_embedding.weight"] = v["decoder/embeddings/weight"]
    out[f"{pre_d}.embed_positions.weight" if hf else "decoder.positional_embedding"] = v["decoder/position_encodings/encodings"]
    if hf:
        out["proj_out.weight"] = v["decoder/embeddings/weight"]
    return {k: t.contiguous().clone() for k, t in out.items()}


TINY_DIMS = dict(n_mels=80, n_audio_ctx=1500, n_audio_state=384, n_audio_head=6, n_audio_layer=4, n_vocab=51864,
                 n_text_ctx=448, n_text_state=384, n_text_head=6, n_text_layer=4)


def _assert_same_weights(a, b):
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def _jfk(audio_dir):
    from flashasr.audio import load_audio

    return load_audio(audio_dir / "en" / "en-jfk-inaugural.wav").samples


def _assert_same_outputs(a, b, audio_dir):
    """Same encoder output and same first-step logits on real speech (bit-identical)."""
    from flashasr.models.whisper.features import log_mel_spectrogram, pad_or_trim

    mel = pad_or_trim(log_mel_spectrogram(_jfk(audio_dir), 80))[None]
    with torch.inference_mode():
        fa, fb = a.model.encode(mel), b.model.encode(mel)
        assert torch.equal(fa, fb)
        prompt = torch.tensor([[a.tokenizer.sot]])
        la = a.model.decode_step(prompt, a.model.new_cache(fa, 4), 0)
        lb = b.model.decode_step(prompt, b.model.new_cache(fb, 4), 0)
        assert torch.equal(la, lb)


def test_openai_pt_round_trip(tmp_path, audio_dir):
    sd = _ct2_to_named(tiny_ct2_vars(), "openai")
    p = tmp_path / "tiny.en.pt"
    torch.save({"dims": TINY_DIMS, "model_state_dict": sd}, p)
    m = load_whisper(p)
    _assert_same_weights(m, tiny())
    _assert_same_outputs(m, tiny(), audio_dir)
    assert m.tokenizer.eot == 50256  # tokenizer: the embedded English one (no tokenizer.json beside)


def test_hf_directory_round_trip(tmp_path, audio_dir):
    from safetensors.torch import save_file

    sd = _ct2_to_named(tiny_ct2_vars(), "hf")
    save_file(sd, str(tmp_path / "model.safetensors"))
    cfg = dict(model_type="whisper", architectures=["WhisperForConditionalGeneration"], num_mel_bins=80,
               max_source_positions=1500, d_model=384, encoder_attention_heads=6, encoder_layers=4,
               vocab_size=51864, max_target_positions=448, decoder_attention_heads=6, decoder_layers=4)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shutil.copy(embedded_dir("tiny.en") / "tokenizer.json", tmp_path / "tokenizer.json")
    m = load_whisper(tmp_path)
    _assert_same_weights(m, tiny())
    _assert_same_outputs(m, tiny(), audio_dir)
    # a config that disagrees with the tensors is a clear shape error
    cfg["d_model"] = 512
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError) as e:
        load_whisper(tmp_path)
    assert e.value.code == "shape_mismatch"


def test_pt_with_missing_tensor_or_bad_dims(tmp_path):
    sd = _ct2_to_named(tiny_ct2_vars(), "openai")
    del sd["decoder.blocks.2.cross_attn.key.weight"]
    torch.save({"dims": TINY_DIMS, "model_state_dict": sd}, tmp_path / "a.pt")
    with pytest.raises(ModelLoadError, match="cross_attn.key.weight"):
        load_whisper(tmp_path / "a.pt")
    torch.save({"weights": {}}, tmp_path / "b.pt")
    with pytest.raises(UnsupportedModelError):
        load_whisper(tmp_path / "b.pt")


# ---- errors ----------------------------------------------------------------------------------
def _ct2_copy(tmp_path, data: bytes):
    d = tmp_path / "ct2"
    d.mkdir()
    for f in ("config.json", "tokenizer.json"):
        shutil.copy(embedded_dir("tiny.en") / f, d / f)
    (d / "model.bin").write_bytes(data)
    return d


def test_missing_paths_error_clearly(tmp_path):
    with pytest.raises(ModelLoadError) as e:
        load_whisper(tmp_path / "nope")
    assert e.value.code == "model_not_found"
    with pytest.raises(UnsupportedModelError):
        load_whisper(tmp_path)  # an empty directory
    d = _ct2_copy(tmp_path, b"")
    (d / "tokenizer.json").unlink()
    (d / "model.bin").write_bytes((embedded_dir("tiny.en") / "model.bin").read_bytes())
    with pytest.raises(ModelLoadError, match="tokenizer"):
        load_whisper(d)


def test_truncated_model_bin(tmp_path):
    raw = (embedded_dir("tiny.en") / "model.bin").read_bytes()
    d = _ct2_copy(tmp_path, raw[: len(raw) // 3])
    with pytest.raises(ModelLoadError) as e:
        load_whisper(d)
    assert e.value.code == "model_truncated" and "truncated" in str(e.value)
    assert isinstance(e.value, FlashASRError)


def test_corrupt_and_unknown_spec(tmp_path):
    raw = bytearray((embedded_dir("tiny.en") / "model.bin").read_bytes()[:4096])
    # unknown spec name: a tiny but well-formed file
    spec = b"TransformerSpec\0"
    blob = struct.pack("<I", 6) + struct.pack("<H", len(spec)) + spec + struct.pack("<II", 1, 0) + struct.pack("<I", 0)
    d = _ct2_copy(tmp_path, blob)
    with pytest.raises(UnsupportedModelError, match="TransformerSpec"):
        load_whisper(d)
    # a future binary version
    (d / "model.bin").write_bytes(struct.pack("<I", 99) + bytes(raw[4:]))
    with pytest.raises(UnsupportedModelError, match="binary version 99"):
        load_whisper(d)
    # garbage after the header: a variable whose byte count disagrees with its shape
    bad = bytearray(raw)
    off = 4 + 2 + len(b"WhisperSpec\0") + 8  # first variable record
    n = struct.unpack_from("<H", bad, off)[0]
    rank_at = off + 2 + n
    struct.pack_into("<B", bad, rank_at, 1)
    struct.pack_into("<I", bad, rank_at + 1, 12345)  # shape [12345] for a 1-byte scalar
    (d / "model.bin").write_bytes(bytes(bad))
    with pytest.raises(ModelLoadError):
        load_whisper(d)


def test_dtype_argument():
    from flashasr.models.whisper.loaders import resolve_dtype

    assert resolve_dtype(None, "cpu") == torch.float32 and resolve_dtype(None, "cuda") == torch.float16
    assert resolve_dtype("bf16", "cpu") == torch.bfloat16
    with pytest.raises(UnsupportedModelError):
        resolve_dtype("int4", "cpu")
    m = load_embedded("tiny.en", dtype="bfloat16")
    assert next(m.model.parameters()).dtype == torch.bfloat16
    mel = torch.zeros(1, 80, 3000)
    assert m.model.encode(mel).dtype == torch.bfloat16


@pytest.mark.gpu
def test_cuda_fp16_matches_cpu(audio_dir):
    m = load_embedded("tiny.en", device="cuda", dtype="float16")
    w = _jfk(audio_dir)
    t = m.transcribe_waveform(w)
    assert t.text == tiny().transcribe_waveform(w).text


def test_static_decode_step_matches_dynamic():
    """The fixed-shape (CUDA-graph-friendly) decoder step equals the sliced one, also with rows
    at different positions."""
    m = tiny().model
    torch.manual_seed(0)
    with torch.inference_mode():
        feats = m.encode(torch.randn(1, 80, 3000) * 0.5).repeat(2, 1, 1)
        tok = tiny().tokenizer
        seq = [tok.sot, tok.timestamp_begin, 843, 523, 616]
        a = m.new_cache(feats, 16)
        b = m.new_cache(feats, 16)
        prompt = torch.tensor([seq[:1]] * 2)
        m.decode_step(prompt, a, 0)
        m.decode_step(prompt, b, 0)
        for pos in range(1, len(seq)):
            t = torch.tensor([[seq[pos]]] * 2)
            la = m.decode_step(t, a, pos)[:, -1]
            lb = m.decode_step_static(t, b, torch.tensor([pos, pos]))
            torch.testing.assert_close(la, lb, atol=1e-4, rtol=1e-4)
        # row 1 lags one step behind row 0: its logits equal a fresh single-row run
        c = m.new_cache(feats[:1].repeat(2, 1, 1), 16)
        m.decode_step(torch.tensor([seq[:3], seq[:3]]), c, 0)
        out = m.decode_step_static(torch.tensor([[seq[3]], [seq[2]]]), c, torch.tensor([3, 2]))
        ref = m.decode_step(torch.tensor([seq[:4]]), m.new_cache(feats[:1], 16), 0)[:, -1]
        ref2 = m.decode_step(torch.tensor([seq[:3]]), m.new_cache(feats[:1], 16), 0)[:, -1]
        torch.testing.assert_close(out[0], ref[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out[1], ref2[0], atol=1e-4, rtol=1e-4)


def test_model_names_that_need_weights_and_the_local_catalog(tmp_path, monkeypatch, capsys):
    """A Whisper size that is not embedded says what to download and pass; `flashasr models` lists the
    embedded models and the repos of the Hugging Face cache; a cached Whisper repo id loads offline."""
    import shutil

    import flashasr
    from flashasr.cli import main
    from flashasr.errors import ModelLoadError
    from flashasr.models.whisper.packages import embedded_dir

    for name in ("large-v3", "turbo", "whisper-small", "Medium.en"):
        with pytest.raises(ModelLoadError) as e:
            flashasr.load_model(name)
        assert e.value.code == "model_not_found" and "not embedded here" in str(e.value)
        assert "CTranslate2 folder" in str(e.value) and ".pt" in str(e.value)
    with pytest.raises(ModelLoadError, match="flashasr models"):
        flashasr.load_model(str(tmp_path / "nothing-here"))
    # a Hugging Face cache holding a CTranslate2 Whisper repo and a Parakeet repo
    cache = tmp_path / "hub"
    rev = "0123456789abcdef0123456789abcdef01234567"
    snap = cache / "models--Systran--faster-whisper-tiny.en" / "snapshots" / rev
    shutil.copytree(embedded_dir("tiny.en"), snap)
    (cache / "models--Systran--faster-whisper-tiny.en" / "refs").mkdir()
    (cache / "models--Systran--faster-whisper-tiny.en" / "refs" / "main").write_text(rev)
    pk = cache / "models--nvidia--parakeet-tdt-0.6b-v3" / "snapshots" / rev
    pk.mkdir(parents=True)
    (pk / "parakeet-tdt-0.6b-v3.nemo").write_bytes(b"")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "tiny.en" in out and "base" in out and "Systran/faster-whisper-tiny.en" in out
    assert "nvidia/parakeet-tdt-0.6b-v3" in out
    m = flashasr.load_model("Systran/faster-whisper-tiny.en")
    assert m.family == "whisper" and not m.multilingual
