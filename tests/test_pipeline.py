"""The pipeline between the doors and the models: the one segmentation policy, the one merger,
per-piece failure isolation, the one engine choice; models transcribe exactly what they get."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import AUDIO, PARAKEET_FIXTURES
from flashasr.errors import FlashASRError
from flashasr.models.base import ASRModel
from flashasr.options import ModelCapabilities, TranscribeOptions
from flashasr.pipeline import engines, merge_pieces, plan_pieces, transcribe_pieces, transcribe_samples
from flashasr.types import Segment, Transcript, Word

SR = 16000
WHISPERISH = ModelCapabilities(name="w", family="whisper", window_s=30.0, long_form=True)
PARAKEETISH = ModelCapabilities(name="p", family="parakeet", window_s=60.0, long_form=False)


class Splitter:
    """Records its calls; cuts fixed 10 s ranges (or none: 'no speech')."""

    def __init__(self, speech: bool = True):
        self.calls = []
        self.speech = speech

    def __call__(self, samples, sr, max_s, method):
        self.calls.append((len(samples), sr, max_s, method))
        if not self.speech:
            return []
        n = 10 * sr
        return [(a, min(a + n + 5, len(samples) + 7)) for a in range(0, len(samples), n)]  # overshoots: clipped


def _plan(seconds: float, caps, speech=True, **opts):
    sp = Splitter(speech)
    o = TranscribeOptions(**opts).resolve(caps)
    return plan_pieces(np.zeros(int(seconds * SR), np.float32), o, caps, split=sp), sp.calls


def test_plan_policy_table():
    # vad: a recording that fits and holds speech goes whole; without speech: no piece at all
    assert _plan(20, WHISPERISH) == ([(0, 20 * SR)], [(20 * SR, SR, 30.0, "vad")])
    assert _plan(20, WHISPERISH, speech=False)[0] == []
    # longer than the window: the splitter's ranges, clipped to the recording
    pieces, calls = _plan(45, WHISPERISH)
    assert pieces == [(0, 10 * SR + 5), (10 * SR, 20 * SR + 5), (20 * SR, 30 * SR + 5), (30 * SR, 40 * SR + 5),
                      (40 * SR, 45 * SR)]
    # max_segment_s reaches the splitter, clamped to the window
    assert _plan(45, WHISPERISH, max_segment_s=12)[1][0][2] == 12.0
    assert _plan(45, WHISPERISH, max_segment_s=99)[1][0][2] == 30.0
    assert _plan(45, WHISPERISH, segmentation="fixed")[1][0][3] == "fixed"
    # none: the model's own long-form procedure (no cutting) ...
    assert _plan(300, WHISPERISH, segmentation="none") == ([(0, 300 * SR)], [])
    assert _plan(2, WHISPERISH, segmentation="none", speech=False) == ([(0, 2 * SR)], [])
    # ... and a model without one is still cut at pauses beyond its window
    assert _plan(50, PARAKEETISH, segmentation="none") == ([(0, 50 * SR)], [])
    pieces, calls = _plan(70, PARAKEETISH, segmentation="none")
    assert len(pieces) == 7 and calls == [(70 * SR, SR, 60.0, "vad")]
    assert plan_pieces(np.zeros(0, np.float32), TranscribeOptions(), WHISPERISH) == []


def test_a_model_without_a_speech_gate_runs_the_vad_only_to_cut():
    """caps.speech_gate=False (Parakeet): a recording that fits the window goes in whole with no
    VAD call, even without speech; a longer one is cut by the VAD as before; needs_vad agrees
    with what plan_pieces does (plan_many computes the probabilities of exactly those)."""
    from dataclasses import replace

    from flashasr.pipeline import needs_vad

    ungated = replace(PARAKEETISH, speech_gate=False)
    assert _plan(50, ungated, speech=False) == ([(0, 50 * SR)], [])
    pieces, calls = _plan(70, ungated)
    assert len(pieces) == 7 and calls == [(70 * SR, SR, 60.0, "vad")]
    assert _plan(70, ungated, speech=False)[0] == []  # cutting still leaves non-speech out
    assert _plan(50, PARAKEETISH, speech=False) == ([], [(50 * SR, SR, 60.0, "vad")])  # gated: as before
    o = TranscribeOptions().resolve(ungated)
    assert not needs_vad(50 * SR, o, ungated) and needs_vad(70 * SR, o, ungated)
    assert needs_vad(50 * SR, TranscribeOptions().resolve(PARAKEETISH), PARAKEETISH)
    from flashasr.models.parakeet.model import ParakeetASR
    from flashasr.models.whisper.asr import WhisperASR

    assert ParakeetASR.speech_gate is False and WhisperASR.speech_gate is True


def test_an_ungated_model_gets_no_vad_pass_unless_it_must_be_cut(monkeypatch):
    """Parakeet-TDT (no speech gate): a recording that fits its window gets no VAD pass in any
    segmentation and goes in whole without speech spans; ``fixed`` windows of a longer one cover
    it without the VAD; only a cut at pauses (vad, or none beyond the window) runs it, and its
    pieces carry the spans. A gated model (Whisper) runs it in every mode."""
    from dataclasses import replace

    import flashasr.audio.vad as vad
    from flashasr.pipeline import needs_vad

    calls = []
    real_spans, real_split = vad.asr_speech_spans, vad.split_for_asr

    def spans(*a, **k):
        calls.append("spans")
        return real_spans(*a, **k)

    def split(*a, **k):
        calls.append(k.get("method", "vad"))
        return real_split(*a, **k)

    monkeypatch.setattr(vad, "asr_speech_spans", spans)
    monkeypatch.setattr(vad, "split_for_asr", split)
    ungated = replace(PARAKEETISH, speech_gate=False)
    clip = __import__("flashasr.audio", fromlist=["load_audio"]).load_audio(AUDIO / "en" / "en-ls-61-70968-0002.wav").samples
    x = np.concatenate([clip, np.zeros(40 * SR, np.float32)])  # 43 s: fits the 60 s window
    for mode in ("vad", "none", "fixed"):
        o = TranscribeOptions(segmentation=mode).resolve(ungated)
        (p,) = plan_pieces(x, o, ungated)
        assert p == (0, len(x)) and p.speech is None and not needs_vad(len(x), o, ungated)
        (p,) = plan_pieces(np.zeros(50 * SR, np.float32), o, ungated)  # no speech: still whole, blanks decide
        assert p == (0, 50 * SR)
    long = np.zeros(150 * SR, np.float32)
    o = TranscribeOptions(segmentation="fixed").resolve(ungated)
    assert plan_pieces(long, o, ungated) == [(0, 60 * SR), (60 * SR, 120 * SR), (120 * SR, 150 * SR)]
    assert not needs_vad(long.size, o, ungated) and calls == []
    long[100 * SR: 100 * SR + clip.size] = clip
    for mode in ("vad", "none"):
        o = TranscribeOptions(segmentation=mode).resolve(ungated)
        assert needs_vad(long.size, o, ungated)
        (p,) = plan_pieces(long, o, ungated)
        assert p[0] <= 100.5 * SR and p[1] >= 100 * SR + clip.size - SR // 2 and p.speech
    assert calls == ["vad", "vad"]
    calls.clear()
    for mode in ("vad", "none", "fixed"):  # gated: the VAD every time
        plan_pieces(x[: 20 * SR], TranscribeOptions(segmentation=mode).resolve(WHISPERISH), WHISPERISH)
    assert calls.count("vad") == 1 and calls.count("spans") == 2


def test_plan_with_the_real_vad():
    """clip, 30 s of silence, clip: two pieces around the speech; 5 s of silence: none."""
    from flashasr.audio import load_audio

    a = load_audio(AUDIO / "en" / "en-ls-61-70968-0002.wav").samples
    x = np.concatenate([a, np.zeros(30 * SR, np.float32), a])
    pieces = plan_pieces(x, TranscribeOptions().resolve(WHISPERISH), WHISPERISH)
    assert len(pieces) == 2 and pieces[0][0] < 0.5 * SR and pieces[1][1] > len(x) - 0.5 * SR
    assert pieces[0][1] < len(a) + SR and pieces[1][0] > len(a) + 29 * SR
    assert plan_pieces(np.zeros(5 * SR, np.float32), TranscribeOptions(), WHISPERISH) == []
    assert plan_pieces(a, TranscribeOptions(), WHISPERISH) == [(0, len(a))]
    # every piece carries the VAD's speech spans inside it, counted from its start
    for p in pieces:
        assert p.speech and all(0 <= s < e <= p[1] - p[0] for s, e in p.speech)
    # none: one piece, its spans show the silence between the clips; fixed: windows without speech left out
    (whole,) = plan_pieces(x, TranscribeOptions(segmentation="none").resolve(WHISPERISH), WHISPERISH)
    assert whole == (0, len(x)) and len(whole.speech) == 2 and whole.speech[1][0] - whole.speech[0][1] > 29 * SR
    fixed = plan_pieces(x, TranscribeOptions(segmentation="fixed", max_segment_s=10).resolve(WHISPERISH), WHISPERISH)
    assert [p[0] for p in fixed] == [0, 30 * SR] and all(p.speech for p in fixed)
    # no speech: no piece in any mode; a custom splitter's pieces carry no spans
    for mode in ("none", "fixed"):
        assert plan_pieces(np.zeros(40 * SR, np.float32), TranscribeOptions(segmentation=mode), WHISPERISH) == []
    assert _plan(45, WHISPERISH)[0][0].speech is None
    # the batched PyTorch VAD's probabilities (the GPU path, here on the CPU) give the same spans
    from flashasr.audio.silero_torch import speech_probabilities_batch

    (probs,) = speech_probabilities_batch([x], device="cpu")
    for mode in ("vad", "none", "fixed"):
        o = TranscribeOptions(segmentation=mode).resolve(WHISPERISH)
        want, got = plan_pieces(x, o, WHISPERISH), plan_pieces(x, o, WHISPERISH, probs=probs)
        assert got == want and [p.speech for p in got] == [p.speech for p in want], mode


class Fake(ASRModel):
    """Text = the piece's length in samples; fails on one length; records what it is given."""

    name, family, max_segment_seconds, long_form = "fake", "parakeet", 60.0, False

    def __init__(self, fail_len=None):
        self.fail_len = fail_len
        self.calls = []

    def _transcribe(self, waves, options):
        self.calls.append(([len(w) for w in waves], options))
        if self.fail_len in [len(w) for w in waves]:
            raise RuntimeError("boom")
        out = []
        for w in waves:
            d = len(w) / SR
            words = [Word(" x", 0.1, d)] if options.word_timestamps else None
            out.append(Transcript(f" n{len(w)} ", options.language, d, [Segment(0, 0.1, d, f" n{len(w)}",
                                                                          words=list(words or []))], words))
        return out


def test_one_bad_piece_fails_alone():
    m = Fake(fail_len=300)
    waves = [np.zeros(n, np.float32) for n in (100, 300, 200)]
    got = transcribe_pieces(m, waves, TranscribeOptions())
    assert got[0].text.strip() == "n100" and got[2].text.strip() == "n200"
    assert isinstance(got[1], RuntimeError)
    assert [c[0] for c in m.calls] == [[100, 300, 200], [100], [300], [200]]
    assert transcribe_pieces(m, [], TranscribeOptions()) == []
    # a model returning the wrong number of results is caught and each piece retried alone

    class Short(Fake):
        def transcribe_batch(self, waves, options=None, **kw):
            got = super().transcribe_batch(waves, options, **kw)
            return got[:1] if len(waves) > 1 else got

    got = transcribe_pieces(Short(), waves[:2], TranscribeOptions())
    assert [t.text.strip() for t in got] == ["n100", "n300"]

    class Interrupt(Fake):
        def _transcribe(self, waves, options):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        transcribe_pieces(Interrupt(), waves, TranscribeOptions())
    # a bad piece's error names its own place in the call (found by a new user: "waveform 0" for any)
    bad = [np.zeros(100, np.float32), np.zeros(200, np.float32), np.array([0.0, np.nan], np.float32),
           np.zeros((2, 10), np.float32)]
    got = transcribe_pieces(Fake(), bad, TranscribeOptions())
    assert got[0].text.strip() == "n100" and got[1].text.strip() == "n200"
    assert "waveform 2" in str(got[2]) and "waveform 3" in str(got[3]), got


def test_started_pieces_equal_transcribe_pieces_and_a_failed_batch_is_redone_piece_by_piece():
    """start_pieces: a model with submit_batch gets the batch submitted (its result read later); the
    result equals transcribe_pieces', a batch whose result fails is redone piece by piece (one bad
    piece fails alone), a submit that raises runs the call at once, and a model without
    submit_batch runs the call at once."""
    from flashasr.pipeline.run import start_pieces

    class Submitting(Fake):
        def __init__(self, fail_len=None, refuse=False):
            super().__init__(fail_len)
            self.refuse, self.submitted = refuse, []

        def submit_batch(self, waves, options=None, *, checked=False):
            if self.refuse:
                raise RuntimeError("cannot submit")
            self.submitted.append([len(w) for w in waves])
            model = self

            class Sub:
                def encoded(self):
                    return False

                def result(self):
                    return model.transcribe_batch(waves, options, checked=checked)
            return Sub()

    waves = [np.zeros(n, np.float32) for n in (100, 300, 200)]
    opts = TranscribeOptions()
    want = [t.text for t in transcribe_pieces(Fake(), waves, opts)]
    m = Submitting()
    started = start_pieces(m, waves, opts)
    assert m.submitted == [[100, 300, 200]] and m.calls == [] and not started.encoded()  # nothing run yet
    assert [t.text for t in started.result()] == want and started.result() is started.result()
    m = Submitting(fail_len=300)
    got = start_pieces(m, waves, opts).result()
    assert isinstance(got[1], RuntimeError) and [got[0].text, got[2].text] == [want[0], want[2]]
    assert [c[0] for c in m.calls] == [[100, 300, 200], [100, 300, 200], [100], [300], [200]]
    m = Submitting(refuse=True)
    started = start_pieces(m, waves, opts)
    assert started.encoded() and [c[0] for c in m.calls] == [[100, 300, 200]]  # ran at once
    assert [t.text for t in started.result()] == want
    plain = Fake()
    started = start_pieces(plain, waves, opts)
    assert plain.calls and started.encoded() and [t.text for t in started.result()] == want
    assert start_pieces(Submitting(), [], opts).result() == []


def test_merge_sets_duration_language_task_and_global_times():
    opts = TranscribeOptions(language="de", word_timestamps=True)
    a = Transcript(" eins ", None, 2.0, [Segment(0, 0.5, 1.5, " eins", seek=10, words=[Word(" eins", 0.5, 1.5)])],
                   [Word(" eins", 0.5, 1.5)], "m")
    b = Transcript("zwei", None, 2.0, [Segment(0, 0.2, 2.0, " zwei", words=[Word(" zwei", 0.2, 2.0)])],
                   [Word(" zwei", 0.2, 2.0)], "m")
    t = merge_pieces([(0.0, a), (9.0, b)], 10.5, options=opts)
    assert (t.text, t.language, t.duration, t.model, t.task) == ("eins zwei", "de", 10.5, "m", "transcribe")
    assert [(s.id, s.start, s.end, s.seek) for s in t.segments] == [(0, 0.5, 1.5, 10), (1, 9.2, 10.5, 900)]
    assert [(w.start, w.end) for w in t.words] == [(0.5, 1.5), (9.2, 10.5)]  # clipped to the duration
    assert merge_pieces([(0.0, a)], 2.0, options=TranscribeOptions()).words is None
    tr = merge_pieces([], 3.0, options=TranscribeOptions(task="translate"), model="m")
    assert (tr.text, tr.language, tr.task, tr.duration, tr.segments) == ("", "en", "translate", 3.0, [])
    detected = Transcript("x", "fr", 1.0, [], None)
    assert merge_pieces([(0.0, detected)], 1.0, options=TranscribeOptions()).language == "fr"
    # no speech on a model of one language (English-only Whisper): its language, as its pieces would say
    english = ModelCapabilities(name="tiny", languages=frozenset({"en"}))
    empty = merge_pieces([], 8.0, options=TranscribeOptions(), caps=english)
    assert (empty.language, empty.model) == ("en", "tiny")
    assert merge_pieces([], 8.0, options=TranscribeOptions(), caps=WHISPERISH).language is None


def test_models_never_cut_and_the_pipeline_does(monkeypatch):
    """A 70 s recording: the Parakeet model given it directly encodes it as one piece; through the
    pipeline it gets pieces no longer than its window, and the merged duration is the recording's."""
    from flashasr.models.parakeet.decoder import Hypothesis
    from flashasr.models.parakeet.model import ParakeetASR

    m = ParakeetASR.from_nemo(PARAKEET_FIXTURES / "tiny-tdt" / "model.nemo")
    seen = []

    def fake_decode(pieces):
        seen.append([len(p) for p in pieces])
        return [Hypothesis([2], [0], [1]) for _ in pieces]

    monkeypatch.setattr(m, "_decode_pieces", fake_decode)
    from flashasr.audio import load_audio

    speech = load_audio(AUDIO / "long" / "long-en-voxpopuli-000.ogg").samples  # 69.2 s: speech in every window
    x = np.concatenate([speech, np.zeros(SR, np.float32)])[: 70 * SR]
    assert m.transcribe_waveform(x).duration == 70.0 and seen == [[70 * SR]]
    seen.clear()
    t = transcribe_samples(m, x, TranscribeOptions(segmentation="fixed", max_segment_s=30))
    assert seen == [[30 * SR, 30 * SR, 10 * SR]] and t.duration == 70.0 and t.text == "a a a"


def test_transcribe_samples_checks_options_and_audio_first():
    m = Fake()
    with pytest.raises(FlashASRError) as e:
        transcribe_samples(m, np.zeros(SR, np.float32), TranscribeOptions(task="translate"))
    assert e.value.code == "unsupported_task" and m.calls == []
    with pytest.raises(FlashASRError) as e:
        transcribe_samples(m, np.full(SR, np.nan, np.float32), TranscribeOptions(segmentation="none"))
    assert e.value.code == "invalid_audio" and m.calls == []
    # huge finite samples (a trial's 1e30; int16 PCM left unscaled) are refused the same way, naming
    # the peak; loud audio within the decoders' limit (1e4) passes
    for peak in (1e30, -3e4):
        x = np.zeros(SR, np.float32)
        x[SR // 2] = peak
        with pytest.raises(FlashASRError, match="samples reach") as e:
            transcribe_samples(m, x, TranscribeOptions(segmentation="none"))
        assert e.value.code == "invalid_audio" and m.calls == []
    # torch tensors that need grad or are bfloat16 are audio too (they raised RuntimeError / were
    # refused as "not an array of samples": a trial); a loud one is refused like an array
    import torch

    for tt in (torch.zeros(SR, requires_grad=True), torch.zeros(SR, dtype=torch.bfloat16)):
        t = transcribe_samples(m, tt, TranscribeOptions(segmentation="none", language="nl"))
        assert t.text == "" and m.calls == []
    with pytest.raises(FlashASRError, match="samples reach 19968") as e:  # 2e4 in bfloat16
        transcribe_samples(m, torch.full((SR,), 2e4, dtype=torch.bfloat16), TranscribeOptions(segmentation="none"))
    assert e.value.code == "invalid_audio"
    t = transcribe_samples(m, np.zeros(SR, np.float32), TranscribeOptions(segmentation="none", language="nl"))
    assert (t.text, t.language, t.duration) == ("", "nl", 1.0) and m.calls == []  # no speech: no model call
    from flashasr.audio import load_audio

    a = load_audio(AUDIO / "en" / "en-ls-61-70968-0002.wav").samples
    t = transcribe_samples(m, a, TranscribeOptions(segmentation="none", language="nl"))
    assert (t.text, t.language, t.language_probability) == (f"n{a.size}", "nl", 1.0)
    # a float memoryview (shared memory cast to 'f') is samples, as before; the top-level door takes
    # the same bfloat16 tensor the model door does (it raised numpy's TypeError: a trial)
    t = transcribe_samples(m, memoryview(a), TranscribeOptions(segmentation="none", language="nl"))
    assert t.text == f"n{a.size}"
    import flashasr

    t = flashasr.transcribe(torch.from_numpy(a).bfloat16(), model=m, sample_rate=SR, language="nl",
                            segmentation="none")
    assert t.text == f"n{a.size}"


def test_engine_choice_is_one_place(monkeypatch):
    m = Fake()
    assert engines.accelerate(m) is m  # a CPU model stays as it is
    m.device = "cuda:0"
    monkeypatch.setenv("FLASHASR_GPU_ENGINE", "0")
    assert not engines.gpu_engine_enabled("cuda:0") and engines.accelerate(m) is m
    monkeypatch.delenv("FLASHASR_GPU_ENGINE")
    assert not engines.gpu_engine_enabled("cuda:0", "plain") and not engines.gpu_engine_enabled("cpu")
    with pytest.raises(FlashASRError, match="engine must be one of"):
        engines.accelerate(m, engine="turbo")
    with pytest.raises(FlashASRError, match="engine must be one of"):
        engines.load_model("tiny.en", engine="fast")
    from flashasr.models.whisper.asr import WhisperASR

    assert type(engines.load_model("tiny.en", engine="plain")) is WhisperASR


def test_a_cuda_model_device_becomes_the_current_device_and_one_process_uses_one_gpu(monkeypatch):
    """cuda:N makes N current (the engines' streams, events and graphs use the current device); a
    second GPU in the same process is refused with invalid_device; cpu changes nothing."""
    import torch

    current, calls = [0], []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: (calls.append(i), current.__setitem__(0, i)))
    monkeypatch.setattr(engines, "_CUDA_INDEX_IN_USE", None)
    for bad in ("", "CPU", "gpu"):  # torch's own errors become invalid_device
        with pytest.raises(FlashASRError, match="not a torch device") as e:
            engines.use_cuda_device(bad)
        assert e.value.code == "invalid_device"
    monkeypatch.setattr(engines, "check_device", lambda d: None)  # no GPU here: pretend cuda:0-1 exist
    engines.use_cuda_device("cpu")
    assert calls == [] and engines._CUDA_INDEX_IN_USE is None
    engines.use_cuda_device("cuda:1")
    assert calls == [1] and current[0] == 1
    engines.use_cuda_device("cuda")  # the current device: the same GPU
    engines.use_cuda_device("cuda:1")
    assert calls == [1]
    with pytest.raises(FlashASRError, match=r"already runs a model on cuda:1; one process uses one GPU") as e:
        engines.use_cuda_device("cuda:0")
    assert e.value.code == "invalid_device" and current[0] == 1


def test_check_device_is_the_one_device_rule():
    """cpu (the CPU takes no index), cuda, cuda:N; anything else is invalid_device, also with
    ``here=False`` (the form only: a Ray cluster's GPUs are checked there)."""
    for bad in ("cpu:1", "cpu:0", "CPU", "cuda:01", "cuda:", "meta", "mps", "gpu"):
        for here in (True, False):
            with pytest.raises(FlashASRError) as e:
                engines.check_device(bad, here=here)
            assert e.value.code == "invalid_device", bad
    engines.check_device("cpu")
    engines.check_device("cuda:3", here=False)


def test_a_failed_load_leaves_no_gpu_claimed(monkeypatch, tmp_path):
    import torch

    current = [0]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: current.__setitem__(0, i))
    monkeypatch.setattr(engines, "check_device", lambda d: None)  # no GPU here: pretend cuda:2 exists
    monkeypatch.setattr(engines, "_CUDA_INDEX_IN_USE", None)
    with pytest.raises(FlashASRError):
        engines.load_model(str(tmp_path / "no-such-model.nemo"), device="cuda:2")
    assert engines._CUDA_INDEX_IN_USE is None  # a later model may still go to another GPU
    engines.use_cuda_device("cuda:0")
    assert current[0] == 0 and engines._CUDA_INDEX_IN_USE == 0
