"""The chunked streaming encoder (flashasr.models.parakeet.streaming) against exact references.

Where the maths says the chunked step must equal something, it is checked on the NeMo-made tiny
fixture, on another architecture with random weights (x4 subsampling, xscaling, biases, LayerNorm
conv, kernel 5: nothing tuned to one model) and on real speech:

* a whole utterance flushed as one chunk (the stream's first step, ``C`` >= its encoder frames) =
  the offline encoder and NeMo's own tokens; with more frames than ``C``, or after earlier steps,
  a flushed step is the block-masked encoder below instead;
* feature frames and the windowed subsampling = the offline ones of the whole stream;
* the first chunk = the offline encoder on the same (normalised) features;
* every later chunk = a block-masked offline encoder (the chunk's frames attend to
  ``[chunk start - L, chunk end)``, the depthwise conv sees zeros past the chunk), written here
  independently with full-sequence tensors and no caches;
* streams at different positions in one batched step = each stream alone;
* the TDT decoder carried across chunks = decoding the same frames whole.

What is not exact (later chunks vs the offline encoder) is measured, not asserted:
``bench/bench_stream_scale.py --drift``.
"""

from __future__ import annotations

import copy
import math

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import PARAKEET_FIXTURES
from flashasr.models.parakeet.decoder import (DecoderCarry, greedy_tdt_label_looping, label_looping_chunk)
from flashasr.models.parakeet.encoder import _rel_shift, relative_positions
from flashasr.models.parakeet.model import ParakeetASR, load_parakeet
from flashasr.models.parakeet.nemo_format import read_nemo
from flashasr.models.parakeet.preprocessor import MelPreprocessor
from flashasr.models.parakeet.streaming import ParakeetStreamer, StreamError, StreamingConfig

TINY = PARAKEET_FIXTURES / "tiny-tdt"
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py


@pytest.fixture(scope="module")
def tiny():
    return load_parakeet(TINY / "model.nemo")


@pytest.fixture(scope="module")
def other():
    """x4 subsampling (2 stages), xscaling, biases, LayerNorm conv module, kernel 5, 3 layers."""
    cfg = copy.deepcopy(read_nemo(TINY / "model.nemo").config)
    cfg["encoder"].update(d_model=64, n_layers=3, n_heads=2, subsampling_factor=4, subsampling_conv_channels=16,
                          xscaling=True, use_bias=True, conv_kernel_size=5, conv_norm_type="layer_norm")
    cfg["joint"]["jointnet"]["encoder_hidden"] = 64
    cfg["model_defaults"] = {}
    return ParakeetASR.from_config(cfg, seed=3)


@pytest.fixture(scope="module")
def ref():
    return np.load(TINY / "reference.npz")


@pytest.fixture(scope="module")
def speech(ref):
    """9.1 s of real speech (LibriSpeech dev-clean, the fixture's 4th clip)."""
    return ref["audio"][3, : ref["audio_lengths"][3]].astype(np.float32)


def _capture(streamer):
    """Record each step's projected encoder frames ``[n, J]`` per stream key."""
    got: dict[str, list] = {}
    orig = streamer.device_step

    def step(seg, n_new, first, feat_valid, slots):
        keys = {st.slot: k for k, st in streamer.streams.items()}
        f, n = streamer.encode_step(*(torch.from_numpy(a) for a in (seg, n_new, first, feat_valid, slots)))
        for b, s in enumerate(slots):
            got.setdefault(keys[int(s)], []).append(f[b, : int(n_new[b])].clone())
        return streamer.decode_step(f, n, torch.from_numpy(slots))

    streamer.device_step = step
    return got


def _raw_logmel(model, audio: np.ndarray) -> torch.Tensor:
    """The offline log-mel of the whole audio before normalisation, ``[M, T]`` float64."""
    cfg = copy.copy(model.preprocessor.cfg)
    cfg.normalize = None
    pre = MelPreprocessor(cfg)
    pre.load_state_dict(model.preprocessor.state_dict())
    x = torch.from_numpy(audio)[None]
    feats, flen = pre(x, torch.tensor([len(audio)]))
    return feats[0, :, : int(flen[0])].double()


def _normalise(raw: torch.Tensor, n: int) -> torch.Tensor:
    """NeMo per_feature normalisation with the statistics of frames ``[0, n)`` (two-pass, unbiased)."""
    mean = raw[:, :n].mean(1, keepdim=True)
    std = raw[:, :n].std(1, keepdim=True) if n > 1 else torch.zeros_like(mean)
    return ((raw - mean) / (std + 1e-5)).float()


def _reference(model, audio: np.ndarray, bounds: list[tuple[int, int]], L: int) -> torch.Tensor:
    """The block-masked offline encoder the chunked step must equal: chunk ``[v0, v1)``'s frames come
    from the offline subsampling of their window of features normalised with the statistics of
    frames ``[0, sub*v1)``; every layer runs on the whole sequence with attention limited to
    ``[v0 - L, v1)`` and the depthwise conv zero-padded at ``v1``. Returns ``joint.project_encoder``."""
    enc, sub = model.encoder, model.encoder.cfg.subsampling_factor
    raw = _raw_logmel(model, audio)
    xs = []
    with torch.no_grad():
        for v0, v1 in bounds:
            feats = _normalise(raw, sub * v1)
            w0 = max(0, sub * (v0 - 1))
            win = feats[:, w0: sub * v1].T[None]
            x, _ = enc.pre_encode(win, torch.tensor([win.shape[1]]))
            xs.append(x[0] if v0 == 0 else x[0, 1:])
        x = torch.cat(xs)[None]
        if enc.xscale is not None:
            x = x * enc.xscale
        T = x.shape[1]
        start = torch.cat([torch.full((b - a,), a) for a, b in bounds])
        end = torch.cat([torch.full((b - a,), b) for a, b in bounds])
        s = torch.arange(T)
        allowed = (s[None, :] < end[:, None]) & (s[None, :] >= start[:, None] - L)  # [T, T]
        pos = relative_positions(T, enc.d_model)
        for layer in enc.layers:
            r = x + 0.5 * layer.feed_forward1(layer.norm_feed_forward1(x))
            r = r + _masked_attention(layer.self_attn, layer.norm_self_att(r), pos, allowed)
            r = r + _chunked_conv(layer.conv, layer.norm_conv(r), bounds)
            r = r + 0.5 * layer.feed_forward2(layer.norm_feed_forward2(r))
            x = layer.norm_out(r)
        if enc.out_proj is not None:
            x = enc.out_proj(x)
        return model.joint.project_encoder(x)[0]


def _masked_attention(att, h, pos, allowed):
    T = h.shape[1]
    heads = lambda y: y.view(1, T, att.h, att.d_k).transpose(1, 2)  # noqa: E731
    q, k, v = heads(att.linear_q(h)), heads(att.linear_k(h)), heads(att.linear_v(h))
    p = att.linear_pos(pos).view(1, -1, att.h, att.d_k).transpose(1, 2)
    ac = torch.matmul(q + att.pos_bias_u[None, :, None], k.transpose(-2, -1))
    bd = _rel_shift(torch.matmul(q + att.pos_bias_v[None, :, None], p.transpose(-2, -1)))
    scores = ((ac + bd) / math.sqrt(att.d_k)).masked_fill(~allowed, -10000.0)
    out = torch.matmul(torch.softmax(scores, -1), v)
    return att.linear_out(out.transpose(1, 2).reshape(1, T, -1))


def _chunked_conv(mod, h, bounds):
    x = F.glu(mod.pointwise_conv1(h.transpose(1, 2)), dim=1)  # [1, d, T]
    ys = [mod.depthwise_conv(F.pad(x[:, :, :b], mod.padding))[:, :, a:b] for a, b in bounds]
    y = torch.cat(ys, dim=2)
    y = mod.batch_norm(y.transpose(1, 2)).transpose(1, 2) if mod.norm_type == "layer_norm" else mod.batch_norm(y)
    return mod.pointwise_conv2(F.silu(y)).transpose(1, 2)


def _stream(streamer, key, audio, sizes, flush=False):
    """Feed ``audio`` in requests of the given sizes (cycled); returns the chunk bounds and results."""
    bounds, results, i, k = [], [], 0, 0
    while i < len(audio):
        n = sizes[k % len(sizes)]
        before = streamer.streams[key].frames if key in streamer.streams else 0
        r = streamer.step([(key, audio[i:i + n])])[0]
        if r.frames > before:  # sub-steps of at most C frames
            a = before
            while a < r.frames:
                bounds.append((a, min(r.frames, a + streamer.C)))
                a = bounds[-1][1]
        results.append(r)
        i, k = i + n, k + 1
    return bounds, results


# ------------------------------------------------------------------------------ exact claims
def test_flushed_whole_utterances_equal_offline_and_nemo(tiny, ref):
    """Four clips (0.7-9.1 s) as four streams of one flushed step: NeMo's encoder output and tokens."""
    s = ParakeetStreamer(tiny, StreamingConfig(chunk_frames=128, left_frames=16))
    got = _capture(s)
    clips = [ref["audio"][b, : ref["audio_lengths"][b]].astype(np.float32) for b in range(4)]
    res = s.step([(f"c{b}", c) for b, c in enumerate(clips)], flush=True)
    for b, r in enumerate(res):
        n = int(ref["num_tokens"][b])
        assert r.frames == int(ref["encoded_lengths"][b])
        assert s.streams[f"c{b}"].tokens == ref["token_ids"][b, :n].tolist()
        assert r.text == str(ref["texts"][b])
        nemo = torch.from_numpy(ref["encoder_output"][b, :, : r.frames].T.copy())
        want = tiny.joint.project_encoder(nemo)
        torch.testing.assert_close(got[f"c{b}"][0], want, rtol=1e-3, atol=1e-3)


def test_a_flushed_step_equals_offline_exactly_when_it_is_one_chunk(tiny, ref):
    """The boundary of the claim above, per clip of T encoder frames (9-114): flushed as the
    stream's first step with C = T (one chunk) it equals NeMo's encoder output and tokens; with
    C = T - 1 (two chunks), or after an earlier step, it is the block-masked encoder instead (exact)
    and no longer the offline one."""
    for b in range(4):
        T = int(ref["encoded_lengths"][b])
        clip = ref["audio"][b, : ref["audio_lengths"][b]].astype(np.float32)
        nemo = tiny.joint.project_encoder(torch.from_numpy(ref["encoder_output"][b, :, :T].T.copy()))
        tokens = ref["token_ids"][b, : int(ref["num_tokens"][b])].tolist()
        for C, first in ((T, T), (T - 1, T), (T, 4000)):  # first: samples of the first (flushed or not) step
            s = ParakeetStreamer(tiny, StreamingConfig(chunk_frames=C, left_frames=T))
            got = _capture(s)
            if first < len(clip):
                s.step([("a", clip[:first])])
            r = s.step([("a", clip[first:])], flush=True)[0]
            f = torch.cat(got["a"])
            assert r.frames == T and f.shape[0] == T
            bounds, a = [], 0
            for n in [len(x) for x in got["a"]]:
                bounds.append((a, a + n))
                a += n
            with torch.no_grad():
                rel = float((f - nemo).norm() / nemo.norm())
                torch.testing.assert_close(f, _reference(tiny, clip, bounds, T), rtol=1e-4, atol=1e-4)
            if len(bounds) == 1:
                assert rel < 1e-5 and s.streams["a"].tokens == tokens, (b, C, rel)
            else:
                assert rel > 1e-3, (b, C, bounds, rel)


def test_feature_frames_and_windowed_subsampling_equal_the_whole_stream(tiny, other, speech):
    for model in (tiny, other):
        s = ParakeetStreamer(model, StreamingConfig(chunk_frames=6, left_frames=8))
        sub, x = s.sub, speech[:80000]
        raw = _raw_logmel(model, x)
        feats = _normalise(raw, raw.shape[1])  # one set of statistics for the whole check
        whole, _ = model.encoder.pre_encode(feats.T[None], torch.tensor([feats.shape[1]]))
        if model.encoder.xscale is not None:  # the streamer's subsampling output includes xscaling
            whole = whole * model.encoder.xscale
        st = s._open("w", True)
        s._append(st, s._check("w", x))
        done = 0
        for k in (5, 6, 1, 6, 3):  # chunks of encoder frames, first chunk included
            seg = np.zeros((1, s.window_samples), np.float32)
            s._segment(st, seg[0])
            s.normalize = False
            fw = s._features(torch.from_numpy(seg), torch.tensor([sub * (k + 1)]), torch.tensor([st.slot]))[0]
            s.normalize = True
            w0 = sub * (done - 1)
            lo = max(0, -w0)
            torch.testing.assert_close(fw[lo: sub * (k + 1)].T.double(), raw[:, w0 + lo: sub * (done + k)],
                                       rtol=1e-5, atol=1e-4)
            win = torch.zeros(1, s.window_frames, raw.shape[0])
            win[0, lo: sub * (k + 1)] = feats[:, w0 + lo: sub * (done + k)].T
            y = s._subsample(win, torch.tensor([done == 0]), torch.tensor([sub * (k + 1)]))
            torch.testing.assert_close(y[0, :k], whole[0, done: done + k], rtol=1e-5, atol=1e-5)
            s._advance(st, k)
            done += k


@pytest.mark.parametrize("which", ["tiny", "other"])
def test_chunks_equal_the_block_masked_offline_encoder(request, which, speech):
    model = request.getfixturevalue(which)
    L = 7
    s = ParakeetStreamer(model, StreamingConfig(chunk_frames=5, left_frames=L))
    got = _capture(s)
    x = speech[:64000]
    bounds, _ = _stream(s, "a", x, [8000, 3000, 13000, 160])
    f = torch.cat(got["a"])
    want = _reference(model, x, bounds, L)
    assert f.shape == want.shape and len(bounds) > 6
    torch.testing.assert_close(f, want, rtol=1e-4, atol=1e-4)
    # the first chunk is the offline encoder on its own (normalised) features
    v1, sub = bounds[0][1], s.sub
    feats = _normalise(_raw_logmel(model, x), sub * v1)[:, : sub * v1]
    enc, _ = model.encoder(feats[None], torch.tensor([sub * v1]), channels_last=True)
    torch.testing.assert_close(got["a"][0], model.joint.project_encoder(enc)[0], rtol=1e-4, atol=1e-4)
    # the TDT decoder carried over the chunks = decoding the same frames whole
    hyp = greedy_tdt_label_looping(want[None].clone(), torch.tensor([want.shape[0]]), model.predictor,
                                   _Projected(model.joint), model.durations, model.blank_id,
                                   model.max_symbols_per_step)[0]
    assert s.streams["a"].tokens == hyp.token_ids


class _Projected(torch.nn.Module):
    """The model's joint with an identity encoder projection (frames given already projected)."""

    def __init__(self, joint):
        super().__init__()
        self.j = joint
        self.enc = joint.enc

    def project_encoder(self, f):
        return f

    def project_predictor(self, g):
        return self.j.project_predictor(g)

    def joint_after_projection(self, f, g):
        return self.j.joint_after_projection(f, g)


def test_streams_at_different_positions_batched_equal_each_alone(tiny, speech):
    cfg = StreamingConfig(chunk_frames=6, left_frames=10, slots=2)  # the pool grows while streams are live
    clips = {"a": speech[:40000], "b": speech[20000:70000], "c": speech[5000:30000]}
    sizes = {"a": [8000], "b": [3200, 12800], "c": [4000, 900]}
    alone = {}
    for k, x in clips.items():
        s = ParakeetStreamer(tiny, cfg)
        got = _capture(s)
        _stream(s, k, x, sizes[k])
        alone[k] = (torch.cat(got[k]), list(s.streams[k].tokens))
    s = ParakeetStreamer(tiny, cfg)
    got = _capture(s)
    pos = {k: 0 for k in clips}
    turn = {k: 0 for k in clips}
    while any(pos[k] < len(clips[k]) for k in clips):
        reqs = []
        for k, x in clips.items():
            if pos[k] < len(x):
                n = sizes[k][turn[k] % len(sizes[k])]
                reqs.append((k, x[pos[k]: pos[k] + n]))
                pos[k] += n
                turn[k] += 1
        s.step(reqs)
    assert s.pool.capacity >= 3
    for k in clips:
        torch.testing.assert_close(torch.cat(got[k]), alone[k][0], rtol=1e-5, atol=1e-5)
        assert s.streams[k].tokens == alone[k][1]


def test_decoder_carry_equals_whole_decode(tiny, ref):
    """NeMo's encoder output of the 9.1 s clip, decoded in random chunks: NeMo's tokens."""
    rng = np.random.default_rng(0)
    n = int(ref["encoded_lengths"][3])
    f = tiny.joint.project_encoder(torch.from_numpy(ref["encoder_output"][3, :, :n].T.copy()))[None]
    for _ in range(3):
        cuts = sorted(set(rng.integers(1, n, 12).tolist())) + [n]
        carry, ids, frames, durs, a = None, [], [], [], 0
        for b in cuts:
            hyps, carry = label_looping_chunk(f[:, a:b], torch.tensor([b - a]), tiny.predictor, tiny.joint,
                                              tiny.durations, tiny.blank_id, tiny.max_symbols_per_step, carry=carry)
            ids += hyps[0].token_ids
            frames += [t + a for t in hyps[0].token_frames]
            durs += hyps[0].token_durations
            a = b
        k = int(ref["num_tokens"][3])
        assert ids == ref["token_ids"][3, :k].tolist() and frames == ref["token_frames"][3, :k].tolist()
        assert durs == ref["token_durations"][3, :k].tolist()
    start = DecoderCarry.start(2, tiny.predictor, tiny.joint, tiny.blank_id)
    assert start.time.tolist() == [0, 0] and start.gp.shape == (2, tiny.joint.enc.out_features)


# ------------------------------------------------------------------------------ the host side
def test_hypothesis_only_grows_and_frames_follow_the_audio(tiny, speech):
    s = ParakeetStreamer(tiny, StreamingConfig.for_cadence(500, left_frames=32))
    assert s.C == 7  # 500 ms = 6.25 frames of 80 ms
    prev_text, prev_stable, prev_tokens, n = "", "", 0, 0
    for i in range(0, len(speech), 8000):
        r = s.step([("a", speech[i:i + 8000])])[0]
        n += len(speech[i:i + 8000])
        assert r.frames == ((n - 256) // 160 + 1) // 8  # frames whose 512-sample windows all arrived
        assert r.text.startswith(prev_text.rstrip()) and r.stable_text.startswith(prev_stable)
        assert r.text.startswith(r.stable_text) and len(r.stable_text.split()) <= len(r.text.split())
        assert r.new_tokens == r.tokens - prev_tokens
        prev_text, prev_stable, prev_tokens = r.text, r.stable_text, r.tokens
        st = s.streams["a"]  # what the next window needs and the requests since: bounded memory
        assert st.kept <= len(st.buf) <= 2 * s.window_samples + 2 * 8000
    assert prev_tokens > 0 and len(prev_stable.split()) < len(prev_text.split())


def test_errors_are_per_request_and_streams_close(tiny, speech):
    s = ParakeetStreamer(tiny, StreamingConfig(chunk_frames=8, left_frames=4, slots=1, max_slots=2))
    bad = speech[:8000].copy()
    bad[5] = np.nan
    out = s.step([("a", speech[:8000]), ("b", bad), ("c", speech[:8000], False)])
    assert out[0].frames > 0
    assert getattr(out[1], "code", None) == "invalid_audio"
    assert isinstance(out[2], StreamError)  # unknown stream that is not new: its state was lost
    out = s.step([("d", speech[:100]), ("e", speech[:100])])
    assert not isinstance(out[0], Exception) and isinstance(out[1], StreamError)  # 2 slots: a and d
    s.close("a")
    s.close("a")
    assert isinstance(s.step([("a", speech[:100])])[0], StreamError)  # closed streams do not come back
    assert not isinstance(s.step([("e", speech[:100])])[0], Exception)  # its slot was given back
    assert s.live() == 2
    s.close("d")
    huge = speech[:8000].copy()
    huge[7] = 1e30  # finite, far beyond float audio: refused like NaN (the fast path's dot product overflows)
    loud = speech[:8000] * np.float32(2000)  # loud but within the decoders' limit: taken
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the fast check's overflow is expected: no RuntimeWarning escapes
        out = s.step([("f", huge), ("e", loud)])
    assert getattr(out[0], "code", None) == "invalid_audio" and "samples reach" in str(out[0])
    assert not isinstance(out[1], Exception)
    # a scalar or any non-array is that request's error, not the step's (it raised TypeError out of
    # step), as are a ragged list (numpy's ValueError) and float64 samples beyond float32's range
    # (the cast's overflow warning, raised out of step under -W error; then named as NaN/inf)
    f64 = np.zeros(8000)
    f64[7] = 1e39
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = s.step([("g", np.float32(1e30)), ("e", speech[:8000]), ("h", "not audio"),
                      ("i", [[0.1, 0.2], [0.3]]), ("j", f64)])
    assert getattr(out[0], "code", None) == "invalid_audio" and not isinstance(out[1], Exception)
    assert all(getattr(o, "code", None) == "invalid_audio" for o in out[2:]), out
    assert "samples reach 1e+39" in str(out[4])
    # an empty string, bytes or mapping is not "no audio" (only the length was asked before: they
    # passed silently as empty requests); empty arrays and lists of any dtype still are
    class Broken:  # its length fails: that request's error, not the step's (a RuntimeError sank it)
        def __len__(self):
            raise RuntimeError("no length")

    out = s.step([("k", ""), ("l", {}), ("m", b""), ("n", None), ("p", Broken()),
                  ("e", memoryview(speech[:800])), ("o", np.zeros(0, np.int16))])
    assert [getattr(o, "code", None) for o in out[:5]] == ["invalid_audio"] * 5, out
    assert "got str" in str(out[0]) and "got dict" in str(out[1]) and "decode raw PCM" in str(out[2])
    assert not any(isinstance(o, Exception) for o in out[5:]), out[5:]  # (a float32 memoryview is samples)
    assert not isinstance(s.step([("o", [])])[0], Exception)


def test_idle_streams_are_evicted_and_their_slots_reused(tiny, speech):
    """A stream not stepped for ``idle_s`` is dropped (its front end went away) within a step or
    two, although the scan over all streams no longer runs on every step: its slot serves a new
    stream and the key is refused as closed; a stream stepped meanwhile stays."""
    import time

    s = ParakeetStreamer(tiny, StreamingConfig(chunk_frames=8, left_frames=4, slots=2, max_slots=2, idle_s=0.2))
    s.step([("gone", speech[:4000]), ("live", speech[:4000])])
    t_end = time.monotonic() + 0.5
    while time.monotonic() < t_end:  # "live" keeps stepping, "gone" never again
        assert not isinstance(s.step([("live", speech[:160])])[0], Exception)
        time.sleep(0.02)
    assert "gone" not in s.streams and "live" in s.streams
    assert not isinstance(s.step([("new", speech[:4000])])[0], Exception)  # the freed slot (max_slots=2)
    assert isinstance(s.step([("gone", speech[:160])])[0], StreamError)


def test_a_flushed_stream_takes_no_more_audio(tiny, speech):
    """A flush ends the stream's audio (its last frames were encoded with zero padding): more audio
    for it is a StreamError naming the flush, the other requests of the step go on, and an empty
    request or a second flush returns the flushed result unchanged."""
    s = ParakeetStreamer(tiny, StreamingConfig(chunk_frames=8, left_frames=16))
    done = s.step([("a", speech[:16000]), ("b", speech[:16000])], flush=True)
    out = s.step([("a", speech[16000:16100]), ("b", speech[16000:16100]), ("c", speech[:8000])], flush=True)
    for r in out[:2]:
        assert isinstance(r, StreamError) and "flushed" in str(r), r
    assert not isinstance(out[2], Exception) and out[2].frames > 0
    for again in (s.step([("a", np.zeros(0, np.float32))])[0], s.step([("a", speech[:0])], flush=True)[0]):
        assert again.frames == done[0].frames and again.text == done[0].text and again.new_tokens == 0
    assert s.streams["a"].received == 16000  # the refused audio was not kept


def test_the_gpu_engines_encoder_variants(speech):
    """The streamer on the encoder as the GPU engine leaves it (exact-math fusions: BatchNorm folded
    into the depthwise conv, fused add+LayerNorm, fast attention; then bf16 with float32 norms):
    fused = unfused to float tolerance, bf16 close (decisions may differ in bf16)."""
    from flashasr.engine.fast_attention import install_fast_attention
    from flashasr.engine.fuse import fuse_encoder
    from flashasr.engine.profiles import prepare_encoder_precision

    x = speech[:48000]
    cfg = StreamingConfig(chunk_frames=7, left_frames=12)
    outs = {}
    for variant in ("plain", "fused", "bf16"):
        m = load_parakeet(TINY / "model.nemo")
        if variant != "plain":
            assert fuse_encoder(m.encoder)["bn_fold"] == 2 and install_fast_attention(m.encoder) == 2
        if variant == "bf16":
            prepare_encoder_precision(m.encoder, torch.bfloat16)
        s = ParakeetStreamer(m, cfg)
        assert s.dtype == (torch.bfloat16 if variant == "bf16" else torch.float32)
        got = _capture(s)
        _stream(s, "a", x, [8000])
        outs[variant] = torch.cat(got["a"]).float()
    torch.testing.assert_close(outs["fused"], outs["plain"], rtol=1e-4, atol=1e-4)
    rel = (outs["bf16"] - outs["plain"]).norm() / outs["plain"].norm()
    assert rel < 3e-2


def test_the_gpu_streamers_fused_projections_and_norms(speech):
    """The GPU streamer's hooks (``GraphedStreamer._qkv``: the engine's fused q/k/v weight with
    ``pos_bias_u`` in its bias; ``add_layer_norm``: its CPU fallback here) on the engine's encoder
    = the plain streamer on the unfused model, to float tolerance; the position terms are computed
    once, padded with zero columns to a multiple of 8."""
    import types

    from flashasr.engine.fast_attention import install_fast_attention
    from flashasr.engine.fuse import fuse_encoder
    from flashasr.engine.stream_graphs import GraphedStreamer
    from flashasr.engine.triton_norm import add_layer_norm

    x = speech[:56000]
    cfg = StreamingConfig(chunk_frames=6, left_frames=9)
    outs, toks = {}, {}
    for variant in ("plain", "hooks"):
        m = load_parakeet(TINY / "model.nemo")
        s = ParakeetStreamer(m, cfg)
        if variant == "hooks":
            fuse_encoder(m.encoder)
            assert install_fast_attention(m.encoder) == 2
            s._qkv = types.MethodType(GraphedStreamer._qkv, s)
            s._add_norm = add_layer_norm
            calls = []
            orig = m.encoder.layers[0].self_attn
            assert orig._buffers.get("_qkv_weight") is not None
            real_linear_q = orig.linear_q.forward
            orig.linear_q.forward = lambda *a: calls.append(1) or real_linear_q(*a)  # the fused path skips it
        got = _capture(s)
        _stream(s, "a", x, [8000, 2400])
        outs[variant] = torch.cat(got["a"])
        toks[variant] = list(s.streams["a"].tokens)
        if variant == "hooks":
            assert not calls
    torch.testing.assert_close(outs["hooks"], outs["plain"], rtol=1e-4, atol=1e-4)
    assert toks["hooks"] == toks["plain"]
    s = ParakeetStreamer(load_parakeet(TINY / "model.nemo"), cfg)
    att = s.model.encoder.layers[0].self_attn
    p32 = s._pos_terms(0, att, torch.float32)[2]
    P = 2 * cfg.chunk_frames - 1 + cfg.left_frames
    assert p32.shape == (att.h, att.d_k, -(-P // 8) * 8) and P % 8
    assert p32[..., P:].abs().max() == 0 and p32[..., :P].abs().max() > 0
    assert s._pos_terms(0, att, torch.float32)[2] is p32  # computed once
    with torch.no_grad():  # ... while the weights are unchanged: an in-place edit is seen
        att.linear_pos.weight.mul_(2.0)
    p2 = s._pos_terms(0, att, torch.float32)[2]
    assert p2 is not p32
    torch.testing.assert_close(p2, 2 * p32)


def test_a_model_loaded_in_inference_mode_streams(speech):
    """Inference tensors have no version counter (a trial's model loaded under
    ``torch.inference_mode()`` made the cached position terms' check raise)."""
    with torch.inference_mode():
        m = load_parakeet(TINY / "model.nemo")
    cfg = StreamingConfig(chunk_frames=6, left_frames=9)
    got = ParakeetStreamer(m, cfg).step([("a", speech[:16000])])[0]
    want = ParakeetStreamer(load_parakeet(TINY / "model.nemo"), cfg).step([("a", speech[:16000])])[0]
    assert not isinstance(got, Exception), got
    assert got.text == want.text and got.frames == want.frames > 0


def test_no_memory_for_more_slots_refuses_new_streams_only(tiny, speech, monkeypatch):
    s = ParakeetStreamer(tiny, StreamingConfig(chunk_frames=8, left_frames=4, slots=1, max_slots=64))
    assert not isinstance(s.step([("a", speech[:8000])])[0], Exception)

    def oom(capacity):
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setattr(s.pool, "_alloc", oom)
    out = s.step([("a", speech[8000:16000]), ("b", speech[:8000])])
    assert out[0].frames > 6 and isinstance(out[1], StreamError) and "memory" in str(out[1])
    assert s.pool.ceiling == 1 and isinstance(s.step([("c", speech[:100])])[0], StreamError)


def test_texts_grown_word_by_word_equal_decoding_every_token(tiny):
    """The stream's texts are extended by the words completed each step, not re-decoded whole: for
    random token sequences (the fixture's SentencePiece vocabulary, word-start pieces, the unknown
    piece, growing by a few tokens per step) they equal decode(tokens) and decode(tokens[:word
    start]) at every step, and stable_text only grows."""
    s = ParakeetStreamer(tiny, StreamingConfig(chunk_frames=4, left_frames=4))
    tok = tiny.tokenizer
    rng = np.random.default_rng(7)
    for trial in range(40):
        st = s._open(f"t{trial}", None)
        before = ""
        for _ in range(30):
            for t in rng.integers(0, tok.vocab_size, int(rng.integers(0, 4))).tolist():
                if s._starts_word(t):
                    st.word_start = len(st.tokens)
                st.tokens.append(t)
            r = s._result(st, 0)
            assert r.text == tok.decode(st.tokens)
            assert r.stable_text == (tok.decode(st.tokens[: st.word_start]) if st.word_start else "")
            assert r.stable_text.startswith(before)
            before = r.stable_text
        s.close(f"t{trial}")


def test_reset_many_equals_reset_one_by_one(tiny):
    """StatePool.reset_many (one operation per state tensor, used for the streams a step opens)
    leaves the same state as StatePool.reset slot by slot, and touches no other slot."""
    s = ParakeetStreamer(tiny, StreamingConfig(chunk_frames=6, left_frames=10, slots=4))
    pool = s.pool
    names = ("k", "v", "conv", "done", "stat_sum", "stat_sq", "stat_n", "dec_time", "dec_gp", "dec_h", "dec_c")
    g = torch.Generator().manual_seed(0)
    for n in names:  # garbage everywhere
        t = getattr(pool, n)
        t.copy_((torch.rand(t.shape, generator=g) * 100).to(t.dtype))
    before = {n: getattr(pool, n).clone() for n in names}
    for slot in (1, 3):
        pool.reset(slot)
    one_by_one = {n: getattr(pool, n).clone() for n in names}
    for n in names:
        getattr(pool, n).copy_(before[n])
    pool.reset_many([3, 1, 3])
    for n in names:
        assert torch.equal(getattr(pool, n), one_by_one[n]), n
    assert not torch.equal(one_by_one["conv"], before["conv"])  # the reset did something


def test_a_reused_slot_starts_clean(tiny, speech):
    """A stream opened in the slot of a closed one (its state left dirty) gives the tokens of the same
    audio on a fresh streamer, also when it opens in a step beside a live stream."""
    cfg = StreamingConfig(chunk_frames=6, left_frames=10, slots=2)
    x = speech[:32000]
    fresh = ParakeetStreamer(tiny, cfg)
    _stream(fresh, "b", x, [8000])
    s = ParakeetStreamer(tiny, cfg)
    _stream(s, "a", speech[40000:80000], [8000])
    s.step([("c", speech[:4000])])
    s.close("a")  # a's slot goes back dirty
    for i in range(0, len(x), 8000):
        s.step([("b", x[i:i + 8000]), ("c", speech[4000 + i: 12000 + i])])
    assert s.streams["b"].tokens == fresh.streams["b"].tokens
    assert s.streams["b"].frames == fresh.streams["b"].frames


def test_row_buckets_powers_of_two_then_even_steps_per_doubling():
    """The GPU's step buckets: powers of two to 64 rows, then ``buckets_per_octave`` per doubling,
    ending at ``max_batch``; 1 gives the powers of two; bad values are refused by name."""
    assert StreamingConfig(buckets_per_octave=4).row_buckets() == [1, 2, 4, 8, 16, 32, 64, 80, 96, 112, 128, 160,
                                                                   192, 224, 256, 320, 384, 448, 512]
    assert StreamingConfig().row_buckets() == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]  # the default: 1
    assert StreamingConfig(max_batch=300, buckets_per_octave=4).row_buckets()[-3:] == [224, 256, 300]
    assert StreamingConfig(max_batch=1).row_buckets() == [1]
    assert StreamingConfig(max_batch=48).row_buckets() == [1, 2, 4, 8, 16, 32, 48]
    for n in (1, 2, 3, 8, 17, 64):
        b = StreamingConfig(max_batch=1000, buckets_per_octave=n).row_buckets()
        assert b == sorted(set(b)) and b[-1] == 1000
        assert {64, 128, 256, 512} <= set(b)  # every doubling point, whatever n (3 drifted past 128 once)
        gaps = [y - x for x, y in zip(b, b[1:]) if x >= 64]
        assert max(gaps) <= -(-512 // n) + 1  # the largest octave below 1000 (512-1000) in n steps
    for bad in (0, -1, 2.5, True, 65):
        with pytest.raises(Exception, match="buckets_per_octave"):
            StreamingConfig(buckets_per_octave=bad)


def test_windows_from_the_buffer_equal_the_pre_emphasised_stream(tiny):
    """The host keeps a stream's samples pre-emphasised in one buffer (the head behind the next
    window dropped when room is needed, the buffer resized): every window a step copies out equals
    the slice of the whole pre-emphasised signal, for requests of any size (1 sample to several
    windows)."""
    s = ParakeetStreamer(tiny, StreamingConfig(chunk_frames=7, left_frames=4))
    rng = np.random.default_rng(7)
    x = rng.standard_normal(16000 * 12).astype(np.float32)
    p = s.preemph
    want = x.copy()
    if p is not None:
        want[1:] = x[1:] - np.float32(p) * x[:-1]
    st = s._open("a", True)
    at, out = 0, np.empty(s.window_samples, np.float32)
    sizes = [1, 7, 320, 3000, 8000, 25000] + [int(v) for v in rng.integers(1, 4000, 60)]
    for n in sizes:
        s._append(st, x[at: at + n])
        at = min(at + n, len(x))
        while True:
            k, _ = s._frames_to_do(st, False)
            if not k:
                break
            s._segment(st, out)
            p0 = s.hop * s.sub * (st.frames - 1) - s.n_fft // 2
            ref = np.zeros(s.window_samples, np.float32)
            lo, hi = max(p0, 0), min(p0 + s.window_samples, at)
            ref[lo - p0: hi - p0] = want[lo:hi]
            np.testing.assert_array_equal(out, ref)
            s._advance(st, min(k, s.C))
        assert st.kept <= len(st.buf) <= 3 * s.window_samples + 2 * n  # nothing unbounded kept
    assert at > 16000 * 9 and st.frames > 100  # 9 s and more went through


@pytest.mark.parametrize("size", [1, 16, 100, 161, 320, 8000, 48000])
def test_kept_samples_stay_bounded_for_requests_of_any_size(tiny, speech, size):
    """A trial found 100-sample requests keeping the whole utterance (joins of more than 16 pieces
    began at the oldest kept sample): whatever the request size, a stream keeps at most about two
    windows plus the newest request, and every complete frame is still encoded (the windows' contents
    are checked by the test above)."""
    s = ParakeetStreamer(tiny, StreamingConfig(chunk_frames=7, left_frames=4))
    x = np.tile(speech, 4)[: 16000 * 30]  # 30 s
    worst = 0
    for i in range(0, len(x), size):
        s.step([("a", x[i:i + size])])
        st = s.streams["a"]
        worst = max(worst, len(st.buf))  # the buffer's size: what the stream holds
    assert worst <= 3 * s.window_samples + 2 * size, (worst, s.window_samples)
    assert s.streams["a"].frames >= (len(x) - 512) // 1280 - 1  # every complete frame went through


def test_a_long_request_buffer_shrinks_once_its_audio_is_encoded(tiny, speech):
    """A trial found a 60 s request's buffer (3.9 MB) kept until more audio came: the buffer now
    shrinks as the request's frames are encoded, in the same step, and later requests keep it small;
    the windows stay exact (checked against the whole pre-emphasised signal)."""
    s = ParakeetStreamer(tiny, StreamingConfig(chunk_frames=7, left_frames=4))
    x = np.tile(speech, 12)[: 16000 * 60]
    s.step([("a", x)])
    st = s.streams["a"]
    assert st.frames >= (len(x) - 512) // 1280 - 1
    base = 2 * s.window_samples + 1280 * 7  # the buffer's size for 500 ms requests
    assert len(st.buf) <= 2 * base  # within twice its base size (240 KB here), not 60 s (3.8 MB)
    out = s.step([("a", x[:160])])[0]
    assert not isinstance(out, Exception) and len(st.buf) <= 2 * base
