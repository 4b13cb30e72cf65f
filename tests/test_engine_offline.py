"""Offline engine: batched, profiled, graph-decoded results equal the model's own path.

CPU (eager encoder, torch decoder) on the NeMo tiny fixture and real clips; the ``gpu`` test
runs the CUDA-graph path on the device machine.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import PARAKEET_FIXTURES
from flashasr.engine.offline import OfflineParakeetEngine
from flashasr.engine.profiles import Profile
from flashasr.models.parakeet.decoder import greedy_tdt_reference


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py


TINY = PARAKEET_FIXTURES / "tiny-tdt"


def _model(device="cpu"):
    from flashasr.models.parakeet.model import ParakeetASR

    return ParakeetASR.from_nemo(TINY / "model.nemo", device=device)


def _inputs():
    z = np.load(TINY / "reference.npz")
    waves = [z["audio"][b, : z["audio_lengths"][b]] for b in range(4)]
    rng = np.random.default_rng(1)
    waves += [waves[3][:40000], waves[2][5000:9000], np.zeros(0, np.float32), waves[1][:1000],
              (rng.standard_normal(50000) * 0.05).astype(np.float32)]
    return z, waves


def _reference(model, waves):
    out = []
    for w in waves:
        if len(w) < 1280:
            out.append(([], [], []))
            continue
        audio = torch.from_numpy(w)[None]
        feats, flen = model.preprocessor(audio, torch.tensor([len(w)]))
        enc, elen = model.encoder(feats, flen, channels_last=True)
        h = greedy_tdt_reference(enc, elen, model.predictor, model.joint, model.durations, model.blank_id, 10)[0]
        out.append((h.token_ids, h.token_frames, h.token_durations))
    return out


def test_offline_engine_cpu_equals_per_input_reference():
    z, waves = _inputs()
    model = _model()
    ref = _reference(model, waves)
    eng = OfflineParakeetEngine(model, profiles=[Profile(2, 1.0), Profile(4, 4.0), Profile(3, 6.0)])
    out = eng.transcribe_arrays(waves)
    got = [(it.token_ids, it.token_frames, it.token_durations) for it in out.items]
    assert got == ref
    for b in range(4):  # and NeMo's own decoding of the fixture
        assert got[b][0] == z[f"item{b}_token_ids"].tolist()
    assert out.items[6].token_ids == [] and out.items[0].text == str(z["texts"][0])
    assert out.audio_seconds == pytest.approx(sum(map(len, waves)) / 16000)
    assert set(out.timings) >= {"host_prep", "upload", "encoder", "decoder", "total"}
    # 9.1 s input is longer than every profile -> eager batch of its own
    assert (None, None, 1) in out.batches
    assert sum(n for *_, n in out.batches) == len(waves) - 2  # empty and 1000-sample inputs skipped
    # nothing to capture on the CPU: the start-up breakdown says so
    assert eng.warmup() == {"encoder_graphs": 0.0, "decoder_graphs": 0.0, "profiles": 0}
    assert eng.warmup_report == []


def test_offline_engine_rejects_bad_input():
    from flashasr.errors import AudioError

    eng = OfflineParakeetEngine(_model(), profiles=[Profile(2, 2.0)])
    with pytest.raises(AudioError):
        eng.transcribe_arrays([np.zeros((2, 100), np.float32)])
    with pytest.raises(AudioError):
        eng.transcribe_arrays([np.zeros(100, np.int16)])


@pytest.mark.gpu
def test_offline_engine_gpu_graphs_equal_reference():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    z, waves = _inputs()
    ref = _reference(_model(), waves)
    model = _model("cuda")
    eng = OfflineParakeetEngine(model, profiles=[Profile(2, 1.0), Profile(4, 4.0), Profile(8, 10.0)],
                                dtype=torch.float32)
    took = eng.warmup()  # every profile's graphs captured, the time split between encoders and decoders
    assert took["profiles"] == 3 and took["encoder_graphs"] > 0 and took["decoder_graphs"] > 0
    assert [(r["batch"], r["seconds"]) for r in eng.warmup_report] == [(2, 1.0), (4, 4.0), (8, 10.0)]
    assert all(r["captured"] for r in eng.encoder.memory_report())
    for pipelined, group_rows in ((False, 1), (True, 1), (True, 1), (True, 256), (True, 6)):
        eng.decode_group_rows = group_rows
        out = eng.transcribe_arrays(waves, pipelined=pipelined)
        got = [(it.token_ids, it.token_frames, it.token_durations) for it in out.items]
        assert got == ref
        assert out.decoder_modes == {"full_graph": out.timings.get("decoder_launches", len(out.batches))}
    # many batches of one profile and of several: the pipeline must not overwrite encoder outputs
    # in use, and decoding profile batches together gives each row the tokens it gets alone
    many = [w for w in waves if len(w) >= 1280] * 5
    eng.decode_group_rows = 1
    a = eng.transcribe_arrays(many, pipelined=False)
    for group_rows, launches in ((1, 7), (12, 3), (256, 1)):  # the plan: 2 x 8 rows of 10 s, 5 x <= 4 of 4 s
        eng.decode_group_rows = group_rows
        b = eng.transcribe_arrays(many, pipelined=True)
        assert [i.token_ids for i in a.items] == [i.token_ids for i in b.items]
        assert [i.token_frames for i in a.items] == [i.token_frames for i in b.items]
        assert len(b.batches) == 7 and b.timings["decoder_launches"] == launches
        assert b.decoder_modes == {"full_graph": launches}


@pytest.mark.gpu
def test_submitted_calls_overlap_and_give_each_call_its_own_results():
    """Calls submitted while earlier ones are still on the device (the next call's encoders behind
    this one's, its decoder after this one's results are read; one profile shared by all, so the
    static encoder outputs and decoder buffers are reused across calls) give exactly what each call
    gives alone, also with a synchronous call between them and results read out of order. Through
    the model: ParakeetGPUASR.submit_batch equals transcribe_batch."""
    from flashasr.engine.parakeet_gpu import ParakeetGPUASR

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    _z, waves = _inputs()
    waves = [w for w in waves if len(w) >= 1280]
    rng = np.random.default_rng(7)
    calls = [[waves[i] for i in rng.permutation(len(waves))[: 2 + k % 4]] for k in range(8)]
    model = _model("cuda")
    eng = OfflineParakeetEngine(model, profiles=[Profile(8, 10.0)], dtype=torch.float32)
    alone = [[it.token_ids for it in eng.transcribe_arrays(c).items] for c in calls]
    tickets = []
    for k, c in enumerate(calls):
        tickets.append(eng.submit(c))
        if k % 2:
            tickets[-2].wait_encoded()
            assert [it.token_ids for it in tickets[-2].result().items] == alone[k - 1]
        if k == 4:  # a synchronous call while one is open
            assert [it.token_ids for it in eng.transcribe_arrays(calls[0]).items] == alone[0]
    for k, tk in enumerate(tickets):
        assert [it.token_ids for it in tk.result().items] == alone[k], k

    fast = ParakeetGPUASR(_model("cuda"), dtype=torch.float32)
    want = [t.text for t in fast.transcribe_batch(calls[1], word_timestamps=True)]
    a = fast.submit_batch(calls[1], None)
    b = fast.submit_batch(calls[2], None)
    a.wait_encoded()
    assert [t.text for t in a.result()] == want
    assert [t.text for t in b.result()] == [t.text for t in fast.transcribe_batch(calls[2])]


def test_decode_groups_keep_plan_order_and_bound_their_rows():
    eng = OfflineParakeetEngine.__new__(OfflineParakeetEngine)  # decode_groups reads only the setting
    p64, p32 = Profile(64, 30.0), Profile(32, 4.0)
    rng = np.random.default_rng(3)
    for _ in range(200):
        plan = [(None if rng.random() < 0.1 else (p64 if rng.random() < 0.5 else p32),
                 list(range(int(rng.integers(1, 65))))) for _ in range(int(rng.integers(1, 30)))]
        plan = [(p, idx[:1] if p is None else idx) for p, idx in plan]
        for G in (1, 16, 100, 256):
            eng.decode_group_rows = G
            groups = eng.decode_groups(plan)
            assert [k for g in groups for k in g] == list(range(len(plan)))  # every entry once, in order
            for g in groups:
                rows = [len(plan[k][1]) for k in g]
                if len(g) > 1:
                    assert G > 1 and all(plan[k][0] is not None for k in g)  # eager entries decode alone
                    assert sum(rows) <= 2 * G and sum(rows[:-1]) < G  # it closed once it held G rows
            for a, b in zip(groups, groups[1:]):  # a group was closed only when b could not join it
                rows_a = sum(len(plan[k][1]) for k in a)
                joinable = (G > 1 and plan[b[0]][0] is not None and plan[a[-1]][0] is not None
                            and rows_a < G and rows_a + len(plan[b[0]][1]) <= 2 * G)
                assert not joinable


def test_plan_is_the_cheapest_partition_and_covers_every_input():
    """plan(): every input once, batches fit their profile, and the cost (padded samples +
    launch cost) equals the brute-force optimum over contiguous partitions of the sorted order."""
    import itertools

    model = _model()
    profiles = [Profile(b, s) for s in (1.0, 2.0, 4.0) for b in (1, 2, 4, 8)] + [Profile(16, 1.0)]
    eng = OfflineParakeetEngine(model, profiles=profiles, launch_cost_s=0.5)
    sel = eng.encoder.select
    rng = np.random.default_rng(7)
    for trial in range(30):
        n = int(rng.integers(1, 11))
        lengths = [int(x) for x in rng.integers(0, 70000, n)]  # some < 1 frame, some > 4 s (eager)
        plan = eng.plan(lengths)
        seen = sorted(i for _, idx in plan for i in idx)
        assert seen == sorted(i for i in range(n) if lengths[i] >= eng.min_samples)
        for p, idx in plan:
            if p is None:
                assert len(idx) == 1 and lengths[idx[0]] > 64000
            else:
                assert len(idx) <= p.batch and max(lengths[i] for i in idx) <= p.samples

        def cost(batches):
            return sum(p.batch * p.samples + 0.5 * 16000 for p, _ in batches)

        got = cost([(p, idx) for p, idx in plan if p is not None])
        rest = sorted((i for i in range(n) if eng.min_samples <= lengths[i] <= 64000), key=lambda i: -lengths[i])
        best = float("inf")
        for cuts in itertools.product((0, 1), repeat=max(0, len(rest) - 1)):
            groups, cur = [], [rest[0]] if rest else []
            for c, i in zip(cuts, rest[1:]):
                if c:
                    groups.append(cur)
                    cur = []
                cur.append(i)
            if cur:
                groups.append(cur)
            try:
                best = min(best, cost([(sel(len(g), lengths[g[0]]), g) for g in groups]))
            except Exception:  # a group no profile holds
                continue
        assert got == pytest.approx(best if rest else 0.0), (lengths, plan)


def test_offline_engine_guards_and_threads():
    """NaN/inf inputs and samples beyond 1e4 are refused by name (engine and plain model); [1, N] is accepted; a model in
    training mode is put in eval mode; bad profile settings give invalid_profiles; concurrent
    calls on one engine each get their own results."""
    import threading

    from flashasr.engine.profiles import choose_profiles
    from flashasr.errors import AudioError, FlashASRError

    model = _model()
    model.encoder.train()
    model.joint.train()
    eng = OfflineParakeetEngine(model, profiles=[Profile(2, 2.0), Profile(4, 4.0)])
    assert not any(m.training for p in (model.encoder, model.joint) for m in p.modules())
    _, waves = _inputs()
    bad = waves[0].copy()
    bad[100] = np.nan
    with pytest.raises(AudioError, match="input 1: contains NaN or infinite"):
        eng.transcribe_arrays([waves[1], bad])
    inf = waves[0].copy()
    inf[5] = np.inf
    with pytest.raises(FlashASRError, match="NaN or infinite"):
        _model().transcribe_batch([inf])
    big = np.full(16000, 1e20, np.float32)  # finite, but not audio (squares overflow): refused, naming the peak
    with pytest.raises(AudioError, match="input 0: samples reach 1e\\+20"):
        eng.transcribe_arrays([big])
    loud = np.full(16000, 9e3, np.float32)  # loud, within the decoders' limit (1e4): accepted
    assert len(eng.transcribe_arrays([loud]).items) == 1
    one_row = eng.transcribe_arrays([waves[2][None, :]]).items[0].token_ids
    assert one_row == eng.transcribe_arrays([waves[2]]).items[0].token_ids
    for kwargs in (dict(profiles=[]), dict(launch_cost_s=float("nan"))):
        with pytest.raises(FlashASRError, match="profiles|launch_cost_s") as e:
            OfflineParakeetEngine(_model(), **kwargs)
        assert e.value.code == "invalid_profiles"
    for args in ((0, 2.0), (1, -2.0), (1, float("nan")), (1.5, 2.0)):
        with pytest.raises(FlashASRError, match="invalid profile"):
            Profile(*args)
    for kwargs in (dict(max_seconds=0), dict(n_profiles=0), dict(seconds_per_batch=-1), dict(max_batch=0),
                   dict(durations_s="12")):
        with pytest.raises(FlashASRError) as e:
            choose_profiles(**kwargs)
        assert e.value.code == "invalid_profiles"
    # threads: every call must get its own input's tokens
    want = [eng.transcribe_arrays([w]).items[0].token_ids for w in waves[:5]]
    got, errors = [None] * 5, []

    def work(k):
        try:
            got[k] = eng.transcribe_arrays([waves[k]]).items[0].token_ids
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    for _ in range(3):
        ts = [threading.Thread(target=work, args=(k,)) for k in range(5)]
        [t.start() for t in ts]
        [t.join() for t in ts]
        assert errors == [] and got == want
