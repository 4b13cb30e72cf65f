"""The model in a process of its own (flashasr.pipeline.model_process): same transcripts as the
model in this process, samples crossing by mapping the job's kept segments (or one copy), one bad
piece failing alone, a dead or unloadable model process reported, nothing left in /dev/shm."""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest

from conftest import AUDIO
from flashasr import shm
from flashasr.audio import load_audio
from flashasr.errors import AudioError, FlashASRError
from flashasr.options import TranscribeOptions
from flashasr.pipeline import cached_model, transcribe_pieces
from flashasr.pipeline.model_process import ModelProcess, ModelProcessError

CLIPS = [AUDIO / "en/en-ls-61-70968-0002.wav", AUDIO / "hard/hard-short-cards-ten-of-clubs.wav",
         AUDIO / "en/en-vctk-p225-001.wav"]


@pytest.fixture(scope="module")
def remote():
    m = ModelProcess("tiny.en", device="cpu")
    yield m
    m.close()


@pytest.fixture(scope="module")
def local():
    return cached_model(None, "cpu")


@pytest.fixture(scope="module")
def waves():
    return [load_audio(p, target_rate=16000).samples for p in CLIPS]


def test_same_transcripts_and_capabilities_as_in_process(remote, local, waves):
    assert remote.capabilities == local.capabilities and remote.pid != os.getpid() and remote.alive
    opts = TranscribeOptions().resolve(local.capabilities)
    here = local.transcribe_batch(waves, opts)
    before = remote.copied_bytes
    there = remote.transcribe_batch(waves, opts)
    assert [t.text for t in there] == [t.text for t in here] and "golden fortune" in there[0].text.lower()
    assert [[s.tokens for s in t.segments] for t in there] == [[s.tokens for s in t.segments] for t in here]
    assert remote.copied_bytes - before == sum(w.nbytes for w in waves)  # private memory: one copy
    assert remote.remote_cpu_s > 0


def test_kept_segments_are_mapped_not_copied_and_released(remote, local, waves):
    owner = object()
    name, dt, n = shm.put_array(np.concatenate(waves))
    whole = shm.take_array(name, dt, n, keep_for=owner)
    assert name in os.listdir("/dev/shm")  # kept for the model process
    cut = np.cumsum([0] + [len(w) for w in waves])
    views = [whole[a:b] for a, b in zip(cut[:-1], cut[1:])]
    assert shm.shared_location(views[1]) == (name, int(cut[1]) * 4)
    assert shm.shared_location(waves[0]) is None and shm.shared_location(whole[::2]) is None
    opts = TranscribeOptions().resolve(local.capabilities)
    c0, s0 = remote.copied_bytes, remote.shared_bytes
    got = remote.run_pieces(views, opts)
    assert remote.copied_bytes == c0 and remote.shared_bytes - s0 == whole.nbytes
    assert [t.text for t in got] == [t.text for t in local.transcribe_batch(waves, opts)]
    assert shm.release_owner(owner) == 1 and name not in os.listdir("/dev/shm")
    assert shm.shared_location(views[0]) is None
    assert float(np.abs(views[2]).sum()) > 0  # the memory lives as long as the array


def test_one_bad_piece_fails_alone(remote, local, waves):
    opts = TranscribeOptions().resolve(local.capabilities)
    bad = np.full(1600, np.nan, np.float32)
    got = transcribe_pieces(remote, [waves[0], bad, np.zeros((2, 2, 2), np.float32), waves[2]], opts)
    assert got[0].text and got[3].text
    assert isinstance(got[1], AudioError) and got[1].code == "invalid_audio"
    assert isinstance(got[2], FlashASRError)
    with pytest.raises(AudioError, match="NaN"):
        remote.transcribe_batch([waves[0], bad], opts)
    assert remote.run_pieces([], opts) == []


@pytest.mark.parametrize("make", [lambda d: d / "no-such-model.nemo",
                                  lambda d: (d / "junk.nemo").write_bytes(b"not a tar file") and d / "junk.nemo"])
def test_unloadable_model_raises_what_loading_here_raises(tmp_path, make):
    from flashasr.pipeline import load_model

    spec = str(make(tmp_path))
    with pytest.raises(FlashASRError) as here:
        load_model(spec, device="cpu")
    with pytest.raises(FlashASRError) as there:
        ModelProcess(spec, device="cpu")
    assert type(there.value) is type(here.value) and there.value.code == here.value.code
    assert str(there.value) == str(here.value)


def test_a_dead_model_process_is_an_error_not_a_hang(local, waves):
    m = ModelProcess("tiny.en", device="cpu")
    opts = TranscribeOptions().resolve(local.capabilities)
    os.kill(m.pid, signal.SIGKILL)
    with pytest.raises(ModelProcessError, match="died"):
        m.run_pieces(waves[:1], opts)
    assert not m.alive
    with pytest.raises(ModelProcessError, match="closed"):
        m.run_pieces(waves[:1], opts)
    m.close()
    assert m._transfer == [None, None]  # the transfer segments are freed


def test_a_job_with_the_model_process_equals_the_job_in_process(remote, local, tmp_path):
    """run_job with decode processes: the model process maps each decoded file's segment (nothing
    copied), outputs equal the in-process job's, and no segment name outlives the job."""
    from flashasr.jobs import run_job

    items = CLIPS + [AUDIO / "en/en-ls-2412-153948-0000.flac"]

    def ours() -> set:  # segments of this process and of the processes it started (another job on the
        # machine has its own: found by a new user running a job beside the tests)
        me = os.getpid()
        return {n for n in os.listdir("/dev/shm")
                if n.startswith(f"{shm.SHM_PREFIX}{me}_") or (n.startswith(shm.SHM_PREFIX) and f"_p{me}_" in n)}

    before = ours()
    ra = run_job(items, local, tmp_path / "here", "verbose_json", batch_size=4, workers=2, cpu_pool="process",
                 progress=False)
    rb = run_job(items, remote, tmp_path / "there", "verbose_json", batch_size=4, workers=2, cpu_pool="process",
                 progress=False)
    assert ra.exit_code == 0 and rb.exit_code == 0 and len(rb.ok) == 4
    for p in sorted((tmp_path / "here").glob("*.json")):
        a, b = json.loads(p.read_text()), json.loads((tmp_path / "there" / p.name).read_text())
        assert a["text"] == b["text"] and a["text"]
        assert [s["tokens"] for s in a["segments"]] == [s["tokens"] for s in b["segments"]]
    mp = rb.model_process
    assert mp["pid"] == remote.pid and mp["copied_mb"] == 0 and mp["shared_mb"] > 0
    assert "in its own process" in rb.table() and ra.model_process is None
    assert rb.stage_cpu_s["model"] > 0
    assert not shm._kept  # every kept name released...
    assert ours() <= before  # ... and unlinked


@pytest.mark.gpu
def test_parakeet_on_cuda_in_a_model_process_equals_in_process(waves):
    """On the GPU engine (the CUDA default of flashasr transcribe): the same tokens from the model
    process as from the engine in this process, and the parent never needs the model's CUDA memory."""
    from conftest import PARAKEET_FIXTURES
    from flashasr.pipeline import load_model

    nemo = PARAKEET_FIXTURES / "tiny-tdt/model.nemo"
    if not nemo.exists():
        pytest.skip("Parakeet fixture missing")
    here = load_model(str(nemo), device="cuda")
    opts = TranscribeOptions().resolve(here.capabilities)
    with ModelProcess(str(nemo), device="cuda") as m:
        assert m.device.startswith("cuda") and m.capabilities == here.capabilities
        a, b = here.transcribe_batch(waves, opts), m.transcribe_batch(waves, opts)
        # calls sent ahead (two in flight): the process queues each behind the one before on the
        # device (ParakeetGPUASR.submit_batch); every call still gets its own transcripts
        calls = [waves[k:] + waves[:k] for k in range(len(waves))] * 2
        want = [[t.text for t in here.transcribe_batch(c, opts)] for c in calls]
        got, pend = [], []
        for c in calls:
            if len(pend) == 2:
                got.append([t.text for t in pend.pop(0).result()])
            pend.append(m.start_pieces(c, opts))
        got += [[t.text for t in p.result()] for p in pend]
    assert [[s.tokens for s in t.segments] for t in a] == [[s.tokens for s in t.segments] for t in b]
    assert [t.text for t in a] == [t.text for t in b]
    assert got == want


def test_a_call_that_runs_at_once_is_answered_before_the_next_one_runs(remote, local, waves):
    """Found by a new user: with the calls sent ahead, a model that runs each call at once (the
    CPU, Whisper) had its answer to call 1 wait until call 2 had run too (both answered after the
    same 4.5 s). The model process now answers call 1 before it starts call 2 (its own clock)."""
    opts = TranscribeOptions().resolve(local.capabilities)
    batch = (waves * 2)[:4]
    first, second = remote.start_pieces(batch, opts), remote.start_pieces(batch, opts)
    a, b = first.result(), second.result()
    assert [t.text for t in a] == [t.text for t in b] and a[0].text
    (start1, answer1), (start2, answer2) = first.child_times, second.child_times
    assert start1 <= answer1 <= start2 <= answer2, (first.child_times, second.child_times)
    # results read out of order (found by a new user: the earlier call then waited forever)
    first, second = remote.start_pieces(batch[:2], opts), remote.start_pieces(batch[2:], opts)
    assert [t.text for t in second.result()] == [t.text for t in a[2:]]
    assert [t.text for t in first.result()] == [t.text for t in a[:2]]


def test_a_piece_whose_samples_are_gone_fails_alone_and_its_error_crosses(remote, local, waves):
    """A segment removed under the job (another job's clean-up, a bug) fails only the pieces in it;
    the error is this package's class on the caller's side (it used to fail to unpickle there)."""
    owner = object()
    name, dt, n = shm.put_array(waves[0])
    gone = shm.take_array(name, dt, n, keep_for=owner)
    shm.unlink_segment(name)
    opts = TranscribeOptions().resolve(local.capabilities)
    got = remote.run_pieces([gone, waves[2]], opts)
    assert isinstance(got[0], ModelProcessError) and got[0].code == "model_process_error" and name in str(got[0])
    assert got[1].text == local.transcribe_batch([waves[2]], opts)[0].text
    shm.release_owner(owner)


def test_a_timeout_interrupting_a_wait_gives_up_that_call_only_and_errors_name_their_place(remote, local, waves):
    """Found by a new user: a TimeoutError (a signal-based time limit) interrupting ``result()`` was
    taken for the pipe dying (TimeoutError is an OSError): the process was closed for good. Now the
    call is given up like any interrupted wait and the next calls work. And a bad piece behind one
    refused before sending names its place in the caller's call (it said "waveform 1")."""
    import signal

    opts = TranscribeOptions().resolve(local.capabilities)

    def alarm(*_):
        raise TimeoutError("timed out")

    old = signal.signal(signal.SIGALRM, alarm)
    try:
        pend = remote.start_pieces(waves * 2, opts)
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(TimeoutError):
            pend.result()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    with pytest.raises(ModelProcessError, match="interrupted"):
        pend.result()
    assert remote.alive
    assert remote.run_pieces(waves[:1], opts)[0].text == local.transcribe_batch(waves[:1], opts)[0].text
    owner = object()
    good = shm.take_array(*shm.put_array(waves[0]), keep_for=owner)
    nan = shm.take_array(*shm.put_array(np.array([0.0, np.nan] * 800, np.float32)), keep_for=owner)
    got = remote.run_pieces([np.zeros((2, 10), np.float32), good, nan], opts)
    assert "waveform 0" in str(got[0]) and got[1].text and "waveform 2" in str(got[2]), got
    shm.release_owner(owner)


def test_a_call_still_pending_when_the_process_is_closed_says_so(local, waves):
    """Found by a new user: a result asked for after close() said the process "died (exit code 0)"."""
    opts = TranscribeOptions().resolve(local.capabilities)
    m = ModelProcess("tiny.en", device="cpu")
    pend = m.start_pieces(waves[:1], opts)
    m.close()
    with pytest.raises(ModelProcessError, match="closed before this call was answered"):
        pend.result()


def test_a_flashasr_module_in_the_current_folder_does_not_shadow_the_package(tmp_path, monkeypatch):
    (tmp_path / "flashasr.py").write_text("raise ImportError('the wrong flashasr')\n")
    monkeypatch.chdir(tmp_path)
    with ModelProcess("tiny.en", device="cpu") as m:
        assert m.name == "whisper-tiny.en" and m.alive


def test_stale_segments_of_a_dead_worker_of_a_live_job_are_kept():
    """cleanup_stale_segments (a new job's start) removes a segment when its maker and the maker's
    parent are both gone, never while the parent (a running job, whose model process may map the
    samples) lives."""
    import subprocess
    import sys
    import _posixshmem

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    names = {"live_parent": f"{shm.SHM_PREFIX}{dead}_p{os.getpid()}_1", "both_dead": f"{shm.SHM_PREFIX}{dead}_p{dead}_2",
             "old_style_dead": f"{shm.SHM_PREFIX}{dead}_3"}
    for n in names.values():
        os.close(_posixshmem.shm_open("/" + n, os.O_CREAT | os.O_RDWR, mode=0o600))
    try:
        shm.cleanup_stale_segments()
        left = set(os.listdir("/dev/shm"))
        assert names["live_parent"] in left
        assert names["both_dead"] not in left and names["old_style_dead"] not in left
    finally:
        for n in names.values():
            shm.unlink_segment(n)
    assert shm.new_name().startswith(f"{shm.SHM_PREFIX}{os.getpid()}_p{os.getppid()}_")


def test_a_hung_model_process_is_given_up_at_the_second_ctrl_c(local, tmp_path, monkeypatch, sigint_raises):
    """A model process that never answers (stopped here with SIGSTOP): the first Ctrl-C, once the job
    has sent it a batch, stops the job, which then waits for the call running; the second kills the
    model process, and run_job returns ``interrupted`` with its journal written, instead of waiting
    forever. The Ctrl-Cs wait for the batch (sent at fixed times, one could land before the job began
    under load), and a job still waiting a minute later is given up by the test: a failure, not a hang."""
    import threading
    import time

    from flashasr.jobs import run_job

    m = ModelProcess("tiny.en", device="cpu")
    os.kill(m.pid, signal.SIGSTOP)
    sent, returned, rescued = threading.Event(), threading.Event(), []
    start = m.start_pieces

    def start_pieces(*args, **kw):
        try:
            return start(*args, **kw)
        finally:
            sent.set()

    monkeypatch.setattr(m, "start_pieces", start_pieces)

    def twice():
        if sent.wait(60):
            for _ in range(2):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.3)
        if not returned.wait(60):
            rescued.append(time.perf_counter())
            m.kill()  # the job then ends with model_process_error

    threading.Thread(target=twice, daemon=True).start()
    try:
        r = run_job(CLIPS, m, tmp_path / "out", "text", batch_size=4, workers=1, progress=False)
    finally:
        returned.set()
        m.close(timeout_s=2.0)
    assert sent.is_set() and not rescued
    assert r.interrupted and not r.ok and not m.alive
    assert (tmp_path / "out" / "summary.jsonl").exists()


def test_calls_sent_ahead_answer_in_order_and_a_mapped_bad_piece_fails_alone(remote, local, waves):
    """start_pieces sends a batch while another is pending (the process maps and checks it
    meanwhile); answers come back to their own calls, each equal to run_pieces alone; a piece
    mapped from a kept segment is checked over there (not finite: it fails alone); a third call
    while two are pending is refused."""
    from flashasr.pipeline.model_process import IN_FLIGHT

    owner = object()
    bad = waves[1].copy()
    bad[100] = np.inf
    name, dt, n = shm.put_array(np.concatenate([waves[0], bad]))
    whole = shm.take_array(name, dt, n, keep_for=owner)
    mapped = [whole[: len(waves[0])], whole[len(waves[0]):]]
    opts = TranscribeOptions().resolve(local.capabilities)
    alone = [local.transcribe_batch([w], opts)[0].text for w in waves]
    first = remote.start_pieces(mapped, opts)
    second = remote.start_pieces([waves[2], waves[0]], opts)  # copied into the second transfer segment
    assert IN_FLIGHT == 2
    with pytest.raises(ModelProcessError, match="pending"):
        remote.start_pieces(waves[:1], opts)
    a, b = first.result(), second.result()
    assert a[0].text == alone[0] and isinstance(a[1], AudioError) and a[1].code == "invalid_audio"
    assert [t.text for t in b] == [alone[2], alone[0]]
    assert first.result() is a  # answered once, kept
    third = remote.start_pieces(waves[1:2], opts)  # room again
    assert third.result()[0].text == alone[1]
    shm.release_owner(owner)


def test_the_job_model_worker_sends_ahead_and_times_calls_back_to_back():
    """ModelWorker with a model process: each batch is sent as it is handed over (two in flight),
    results come back in order, and the recorded calls do not overlap (busy time counted once)."""
    import threading
    import time as _time

    from flashasr.jobs.model_worker import ModelWorker

    class Pending:
        def __init__(self, model, waves):
            self.model, self.waves, self.sent = model, waves, _time.perf_counter()

        def result(self):
            with self.model.gpu:  # one call at a time, 50 ms each, as a model process runs them
                _time.sleep(0.05)
                self.model.ran.append(len(self.waves))
            return [f"t{len(w)}" for w in self.waves]

    class FakeProcess:
        isolates_pieces = True
        sample_rate = 16000

        def __init__(self):
            self.gpu, self.ran, self.started = threading.Lock(), [], []

        def start_pieces(self, waves, options, speech=None):
            self.started.append((len(waves), _time.perf_counter()))
            return Pending(self, waves)

    model, wake = FakeProcess(), threading.Event()
    w = ModelWorker(model, wake=wake)
    w.submit("a", [np.zeros(16000, np.float32)] * 2, TranscribeOptions())
    w.submit("b", [np.zeros(8000, np.float32)] * 3, TranscribeOptions())
    _time.sleep(0.01)
    assert len(model.started) == 2  # both sent before the first answer
    got = []
    while len(got) < 2:
        wake.wait(2.0)
        wake.clear()
        got += w.take_done()
    w.stop()
    assert [t for t, _ in got] == ["a", "b"] and got[1][1] == ["t8000"] * 3
    (t0a, da, na, sa), (t0b, db, nb, sb) = w.calls
    assert (na, sa, nb, sb) == (2, 2.0, 3, 1.5)
    assert t0b >= t0a + da - 1e-6 and w.busy_s == pytest.approx(da + db)  # back to back, not overlapping
    assert 0.09 < w.busy_s < 0.5
