"""Job report additions: model/GPU busy fraction, per-stage CPU accounting, the stage that
bounds throughput, per-call batch sizes, and the NVML utilisation sampler (with a fake NVML
module: the CPU CI has no GPU and no pynvml)."""

from __future__ import annotations

import threading
import time
import types
import wave
from pathlib import Path

import numpy as np
import pytest

from flashasr.jobs import JobReport, run_job
from flashasr.jobs import gpumon, runner
from flashasr.jobs.gpumon import NvmlSampler
from flashasr.models.base import ASRModel
from flashasr.types import Segment, Transcript

SR = 16000


class SleepModel(ASRModel):
    """Sleeps ``delay`` seconds per call (stands in for a busy accelerator); text = length."""

    name = "sleep-model"
    family = "parakeet"
    max_segment_seconds = 30.0

    def __init__(self, delay: float = 0.0, device: str = "cpu"):
        self.delay = delay
        self.device = device
        self.calls: list[int] = []
        self.starts: list[float] = []  # time.perf_counter() at each call's start

    def _transcribe(self, ws, options):
        self.calls.append(len(ws))
        self.starts.append(time.perf_counter())
        time.sleep(self.delay)
        out = []
        for w in ws:
            d = len(w) / SR
            out.append(Transcript(text=f" n{len(w)}", language=None, duration=d,
                                  segments=[Segment(0, 0.0, d, f" n{len(w)}")]))
        return out


def fixed_split(samples, sr, max_s, method):
    n = int(max_s * sr)
    return [(a, min(a + n, len(samples))) for a in range(0, len(samples), n)]


def _write_wav(path: Path, seconds: float, seed: int) -> None:
    x = (np.random.default_rng(seed).standard_normal(int(seconds * SR)) * 0.1).clip(-1, 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SR)
        w.writeframes((x * 32767).astype("<i2").tobytes())


@pytest.fixture()
def wavs(tmp_path) -> Path:
    d = tmp_path / "in"
    for i, s in enumerate([2.0, 3.0, 7.5, 12.0]):
        _write_wav(d / f"c{i}.wav", s, i)
    return d


class FakeNvml(types.SimpleNamespace):
    """Minimal pynvml stand-in: utilisation values from a list, then the last one forever."""

    def __init__(self, utils, fail_init: bool = False):
        super().__init__()
        self.utils = list(utils)
        self.fail_init = fail_init
        self.inited = 0
        self.shut = 0
        self.handles: list = []
        self.lock = threading.Lock()

    def nvmlInit(self):
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")
        self.inited += 1

    def nvmlShutdown(self):
        self.shut += 1

    def nvmlDeviceGetHandleByIndex(self, i):
        self.handles.append(("index", i))
        return ("h", i)

    def nvmlDeviceGetHandleByUUID(self, u):
        self.handles.append(("uuid", u))
        return ("h", u)

    def nvmlDeviceGetName(self, h):
        return b"Fake GPU"

    def nvmlDeviceGetUtilizationRates(self, h):
        with self.lock:
            v = self.utils.pop(0) if len(self.utils) > 1 else self.utils[0]
        return types.SimpleNamespace(gpu=v, memory=0)

    def nvmlDeviceGetMemoryInfo(self, h):
        return types.SimpleNamespace(used=123 * 2**20, total=2**30, free=2**30 - 123 * 2**20)


def test_nvml_sampler_mean_max_and_shutdown():
    nv = FakeNvml([10, 30, 50, 50])
    s = NvmlSampler("cuda:0", interval_s=0.01, nvml=nv).start()
    time.sleep(0.2)
    r = s.stop()
    assert r["available"] and r["name"] == "Fake GPU"
    assert r["samples"] >= 5 and r["max_util_pct"] == 50.0
    # the first samples are 10 and 30, then 50 forever: the mean lies strictly between
    assert 30.0 < r["mean_util_pct"] < 50.0
    assert r["max_memory_used_bytes"] == 123 * 2**20
    assert nv.inited == 1 and nv.shut == 1
    n = r["samples"]
    time.sleep(0.05)
    assert s.result()["samples"] == n  # the thread really stopped


def test_nvml_sampler_unavailable_says_why(monkeypatch):
    r = NvmlSampler("cuda", nvml=FakeNvml([0], fail_init=True)).start().stop()
    assert r == {"available": False, "reason": r["reason"]} and "NVML Shared Library Not Found" in r["reason"]

    def no_pynvml():
        raise ImportError("No module named 'pynvml'")

    monkeypatch.setattr(gpumon, "_import_nvml", no_pynvml)
    r = NvmlSampler("cuda").start().stop()
    assert not r["available"] and "pynvml" in r["reason"] and "nvidia-ml-py" in r["reason"]


def test_nvml_index_follows_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert gpumon._nvml_index_for(1) == 5 and gpumon._nvml_index_for(0) == 3
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpumon._nvml_index_for(1) == 1


def test_busy_fraction_and_batch_record_from_a_slow_model(wavs):
    m = SleepModel(delay=0.25, device="cuda:0")  # a "CUDA" model; torch.cuda is absent here
    r = run_job([wavs], m, None, "text", batch_size=2, split_fn=fixed_split, max_segment_s=5,
                workers=2, batch_wait_s=5, gpu_monitor=False)
    assert r.exit_code == 0 and len(r.ok) == 4
    # pieces: 2 s, 3 s, 7.5 s -> 5 + 2.5, 12 s -> 5 + 5 + 2: 7 pieces in batches of <= 2
    assert r.n_pieces == 7 and sum(r.batch_pieces) == 7 and len(r.batch_pieces) == r.n_batches
    assert max(r.batch_pieces) == 2 and r.batch_pieces == m.calls
    assert r.model_busy_s >= 0.25 * r.n_batches * 0.95
    # the timeline of model calls: one [start, seconds, pieces, audio s] per batch, in order, inside the job
    assert [c[2] for c in r.model_calls] == r.batch_pieces
    # ... and its audio seconds: the four files, 2 + 3 + 7.5 + 12 s, every sample in one piece
    assert sum(c[3] for c in r.model_calls) == pytest.approx(24.5, abs=0.05)
    assert r.engine_timings is None  # not the GPU engine
    starts = [c[0] for c in r.model_calls]
    assert starts == sorted(starts) and all(c[1] >= 0.25 * 0.95 for c in r.model_calls)
    assert 0 <= starts[0] and starts[-1] + r.model_calls[-1][1] <= r.wall_s
    assert all(b[0] >= a[0] + a[1] * 0.99 for a, b in zip(r.model_calls, r.model_calls[1:]))  # one at a time
    assert 0 < r.last_decode_s <= r.wall_s
    assert 0 < r.model_busy_fraction <= 1 and r.gpu_busy_fraction == r.model_busy_fraction
    assert r.model_busy_fraction > 0.5  # sleeping dominates decoding four short WAVs
    assert r.nvml is None  # not asked for
    d = r.to_dict()
    assert d["gpu_busy_fraction"] == round(r.model_busy_fraction, 3) and d["workers"] == 2
    assert d["model_calls"] == r.model_calls and d["last_decode_s"] == round(r.last_decode_s, 4)
    assert d["batch_size"] == 2 and d["cpu_s"]["decode"] >= 0 and d["bound_by"] in ("model", "input")
    assert "GPU busy" in r.table() and "bound by" in r.table()


def test_interrupt_from_on_result_counts_only_the_model_calls_that_ran(wavs):
    """A KeyboardInterrupt raised in on_result (the writer thread) interrupts the job like Ctrl-C;
    a batch queued and dropped is in neither ``batch_pieces`` nor ``model_calls``."""
    m = SleepModel(delay=0.2)
    stopped: list[float] = []

    def stop(res):
        stopped.append(time.perf_counter())
        raise KeyboardInterrupt

    r = run_job([wavs], m, None, "text", batch_size=1, split_fn=fixed_split, max_segment_s=5, workers=2,
                batch_wait_s=0.01, on_result=stop, progress=False)
    assert r.interrupted and r.exit_code != 0 and len(stopped) == 1
    # no model call starts once on_result has raised (the one running finishes; the queued one is dropped)
    assert all(s < stopped[0] for s in m.starts), (m.starts, stopped)
    assert r.batch_pieces == m.calls == [c[2] for c in r.model_calls] and r.n_batches == len(m.calls) < 7
    assert r.n_pieces == sum(m.calls) and "interrupted" in r.table()


def test_last_decode_counts_decoded_files_not_failures(tmp_path, wavs):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "notes.wav").write_bytes(b"this is not audio at all")
    r = run_job([bad], SleepModel(), None, "text", workers=1, progress=False)
    assert len(r.failed) == 1 and r.last_decode_s == 0.0 and r.model_calls == [] and r.batch_pieces == []
    r = run_job([bad, wavs / "c0.wav"], SleepModel(), None, "text", workers=1, progress=False,
                split_fn=fixed_split, max_segment_s=5)
    assert len(r.failed) == 1 and len(r.ok) == 1 and 0 < r.last_decode_s <= r.wall_s
    assert "in 1 piece, 1 batch" in r.table() and "1 decode thread " in r.table()


def test_cpu_device_has_no_gpu_fraction_and_stage_cpu_is_counted(wavs):
    burn = 0.15

    def slow_decode(path, rate):  # burns CPU like a costly codec
        from flashasr.audio import load_audio

        t = time.thread_time()
        while time.thread_time() - t < burn:
            sum(range(1000))
        return load_audio(path, target_rate=rate)

    r = run_job([wavs], SleepModel(), None, "text", batch_size=4, split_fn=fixed_split,
                workers=1, decode_fn=slow_decode)
    assert r.gpu_busy_fraction is None and r.nvml is None and "GPU busy" not in r.table()
    assert r.decode_cpu_s >= 4 * burn * 0.99  # per-thread CPU clocks see every burnt second
    want = (r.decode_cpu_s + r.vad_cpu_s) / (1 * r.wall_s)
    assert r.cpu_stage_utilisation == pytest.approx(want)
    # a thread's CPU clock never runs ahead of the wall clock around the same work
    assert r.prepare_wall_s >= (r.decode_cpu_s + r.vad_cpu_s) * 0.99
    assert 0 < r.cpu_stage_cpu_efficiency <= 1.01 and 0 < r.cpu_pool_busy_fraction <= 1
    assert r.cpu_pool_busy_fraction == pytest.approx(min(1.0, r.prepare_wall_s / r.wall_s))
    c = r.cpu_per_audio_hour()
    assert c["decode"] == pytest.approx(r.decode_cpu_s / (r.audio_s / 3600))
    assert r.to_dict()["cpu_s_per_audio_hour"]["decode"] == round(c["decode"], 1)


def test_bound_by_rules():
    def rep(**kw):
        return JobReport(wall_s=10.0, workers=4, device="cuda", **kw)

    assert rep(model_busy_s=9.0).bound_by() == "model"
    assert rep(model_busy_s=2.0, decode_cpu_s=30.0, vad_cpu_s=5.0).bound_by() == "cpu_stage"
    # model calls and output writing run in threads of their own (the model and writer threads)
    assert rep(model_busy_s=5.0, finish_s=4.0, decode_cpu_s=4.0).bound_by() == "input"
    assert rep(model_busy_s=5.0, finish_s=8.5, decode_cpu_s=4.0).bound_by() == "writer"
    assert rep(model_busy_s=1.0, decode_cpu_s=4.0).bound_by() == "input"
    # threads occupied but mostly waiting (GIL / no free core): still the CPU stage
    slow = rep(model_busy_s=1.0, decode_cpu_s=8.0, prepare_wall_s=36.0)
    assert slow.bound_by() == "cpu_stage" and slow.cpu_stage_cpu_efficiency == pytest.approx(8 / 36)
    assert slow.cpu_pool_busy_fraction == pytest.approx(0.9)
    assert rep(model_busy_s=1.0, decode_cpu_s=4.0).cpu_stage_utilisation == pytest.approx(0.1)
    assert JobReport().bound_by() == "input" and JobReport().model_busy_fraction == 0.0


def test_bound_by_is_too_small_to_say_for_one_file_or_one_model_call(wavs):
    """One short clip at 79 % model time is not "bound by input": a run of fewer than two
    transcribed files or two model calls ran its stages one after the other (skipped inputs do no
    work); real jobs keep the 80 % rules."""
    from flashasr.jobs import FileResult, InputItem

    def rep(n_ok, n_batches=4, n_skipped=0, **kw):
        res = [FileResult(item=InputItem(path=Path(f"/x{k}.wav"), key=f"x{k}", display=f"x{k}.wav"),
                          status="ok" if k < n_ok else "skipped") for k in range(n_ok + n_skipped)]
        return JobReport(results=res, wall_s=10.0, workers=1, n_batches=n_batches, **kw)

    assert rep(1, 1, model_busy_s=7.9).bound_by() == "too_small"
    assert rep(1, 3, model_busy_s=9.0).bound_by() == "too_small"  # one long file: many calls, still one file
    assert rep(1, 4, n_skipped=5, model_busy_s=7.9).bound_by() == "too_small"
    assert rep(5, 1, model_busy_s=7.9).bound_by() == "too_small"  # five clips, one model call
    assert rep(4, model_busy_s=7.9).bound_by() == "input" and rep(4, model_busy_s=8.0).bound_by() == "model"
    one = run_job([wavs / "c0.wav"], SleepModel(delay=0.05), None, "text", workers=1, progress=False,
                  split_fn=fixed_split, max_segment_s=5)
    assert one.bound_by() == "too_small" and one.to_dict()["bound_by"] == "too_small"
    assert "bound by: too small to say (1 file, 1 model call)" in one.table()


def test_run_job_samples_nvml_on_cuda(wavs, monkeypatch):
    nv = FakeNvml([80, 90])
    monkeypatch.setattr(runner, "_cuda_available", lambda: True)
    monkeypatch.setattr(gpumon, "_import_nvml", lambda: nv)
    r = run_job([wavs], SleepModel(delay=0.1, device="cuda"), None, "text", batch_size=8,
                split_fn=fixed_split, workers=2)
    assert r.nvml is not None and r.nvml["available"] and r.nvml["samples"] >= 2
    assert 80.0 <= r.nvml["mean_util_pct"] <= 90.0 and nv.shut == 1
    assert "NVML utilisation mean" in r.table()
    assert r.to_dict()["nvml"]["max_util_pct"] == 90.0


def test_run_job_nvml_missing_is_reported_not_fatal(wavs, monkeypatch):
    def no_pynvml():
        raise ImportError("No module named 'pynvml'")

    monkeypatch.setattr(runner, "_cuda_available", lambda: True)
    monkeypatch.setattr(gpumon, "_import_nvml", no_pynvml)
    r = run_job([wavs], SleepModel(device="cuda"), None, "text", split_fn=fixed_split, workers=1)
    assert r.exit_code == 0 and r.nvml["available"] is False and "pynvml" in r.nvml["reason"]
    assert "NVML: pynvml not importable" in r.table()
    # explicitly asked on a CPU model: unavailable with the reason
    r2 = run_job([wavs], SleepModel(), None, "text", split_fn=fixed_split, workers=1, gpu_monitor=True)
    assert r2.nvml["available"] is False and "cpu" in r2.nvml["reason"]


# ------------------------------------------------ the end-to-end benchmark's assumptions

def _bench_module():
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "bench" / "bench_offline_e2e.py"
    spec = importlib.util.spec_from_file_location("bench_offline_e2e", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_copies_are_distinct_inputs_and_pieces_match_the_runner(wavs, tmp_path):
    """bench_offline_e2e lists every file several times (symlinks): the runner must keep every
    copy (decoded again, own output), and the bench's in-memory pieces must be the runner's."""
    b = _bench_module()
    files = [{"path": p.name, "abspath": str(p.resolve())} for p in sorted(wavs.glob("*.wav"))]
    root = tmp_path / "copies"
    links = b.build_inputs(files, root, 3)
    assert len(links) == 12 and all(p.is_symlink() or p.is_file() for p in links)
    m = SleepModel()
    seen: list[int] = []
    orig = m.transcribe_batch

    def record(ws, *a, **kw):
        seen.extend(len(w) for w in ws)
        return orig(ws, *a, **kw)

    m.transcribe_batch = record
    r = run_job([root], m, tmp_path / "out", "json", batch_size=1, split_fn=fixed_split, max_segment_s=5,
                workers=2)
    assert r.exit_code == 0 and len(r.ok) == 12 and len(list((tmp_path / "out").rglob("*.json"))) == 12
    from flashasr.audio import load_audio

    want = []
    for f in files:
        x = load_audio(f["abspath"]).samples
        want += [bb - a for a, bb in b.runner_pieces(x, SR, 5.0, fixed_split, "fixed")]
    assert sorted(seen) == sorted(want * 3)


def _ctrl_c(sig: str = "SIGINT") -> None:
    """SIGINT (or ``sig``) to this process (from the main thread its handler runs before the next line)."""
    import os
    import signal

    os.kill(os.getpid(), getattr(signal, sig))


def _wound_down(r, out: Path) -> bool:
    """Whether the job's wind-down ran to its end: figures taken, journal compacted, threads ended."""
    names = {t.name for t in threading.enumerate()}
    return (r.wall_s > 0 and (out / "summary.jsonl").exists()
            and not names & {"flashasr-writer", "flashasr-model", "flashasr-model-answers"})


class HeldModel(SleepModel):
    """A SleepModel whose calls say they started (``started``) and then wait for ``release`` (60 s
    at most): a test acts while a model call runs, whatever the machine's pace."""

    def __init__(self, delay: float = 0.0):
        super().__init__(delay)
        self.started, self.release = threading.Event(), threading.Event()

    def _transcribe(self, ws, options):
        self.started.set()
        self.release.wait(60)
        return super()._transcribe(ws, options)


def test_a_second_ctrl_c_while_the_job_winds_down_is_noted_not_raised(wavs, tmp_path, sigint_raises):
    """Ctrl-C twice (a terminal's timeout, an impatient user): the first, once a model call runs,
    stops the job; the second lands while that call still runs (the job waits for it); the wind-down
    still ends (journal compacted, shared memory released), run_job returns ``interrupted`` instead
    of raising. The Ctrl-Cs wait for the call and the call for them: no sleep decides the outcome
    (sent at fixed times, a loaded machine could see the job finish or not yet begin)."""
    m = HeldModel()
    fired = []

    def twice():
        if m.started.wait(60):
            for _ in range(2):
                fired.append(time.perf_counter())
                _ctrl_c()
                time.sleep(0.3)
        m.release.set()

    threading.Thread(target=twice, daemon=True).start()
    r = run_job([wavs], m, tmp_path / "out", "text", batch_size=1, split_fn=fixed_split, max_segment_s=5,
                workers=2, progress=False)
    assert len(fired) == 2 and r.interrupted and r.exit_code != 0
    assert _wound_down(r, tmp_path / "out") and len(r.ok) < 4


@pytest.fixture()
def sigterm_as_the_cli_has_it():
    """SIGTERM with ``flashasr transcribe``'s handler during the test (put back afterwards)."""
    import signal

    from flashasr import cli

    before = signal.getsignal(signal.SIGTERM)
    cli._install_sigterm()
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


@pytest.mark.parametrize("second", ["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("where", ["as the decoding stops", "as the wind-down begins"])
def test_a_ctrl_c_right_after_the_first_is_noted_not_raised(wavs, tmp_path, monkeypatch, sigint_raises,
                                                             sigterm_as_the_cli_has_it, where, second):
    """The second Ctrl-C (or SIGTERM, with ``flashasr transcribe``'s handler) landing right after the
    first was caught -- while the job stops its decoding, or before the wind-down had taken the
    signals over -- escaped run_job: no wind-down (journal not compacted, threads left running). Now
    every signal after the first is noted. Each moment is made exact here: the second signal is sent
    from inside the job's own step."""
    from flashasr.jobs import feeder as feeder_mod

    if where == "as the decoding stops":
        stop = feeder_mod.DecodeFeeder.stop
        monkeypatch.setattr(feeder_mod.DecodeFeeder, "stop", lambda self: (stop(self), _ctrl_c(second)))
    else:
        unblock = runner.unblock_sigint
        monkeypatch.setattr(runner, "unblock_sigint", lambda: (_ctrl_c(second), unblock()))
    m = HeldModel()

    def first():
        m.started.wait(60)
        _ctrl_c()
        time.sleep(0.2)
        m.release.set()

    threading.Thread(target=first, daemon=True).start()
    try:
        r = run_job([wavs], m, tmp_path / "out", "text", batch_size=1, split_fn=fixed_split, max_segment_s=5,
                    workers=2, progress=False)
    except KeyboardInterrupt:
        pytest.fail(f"the second signal ({second}) escaped run_job")
    assert r.interrupted and _wound_down(r, tmp_path / "out")


@pytest.mark.parametrize("handler", ["Python's", "the caller's own"])
def test_a_ctrl_c_while_the_main_thread_runs_a_decode_callback_interrupts_the_job(wavs, tmp_path, monkeypatch,
                                                                                 sigint_raises, handler):
    """A decode done before its completion callback was attached: the main thread runs that callback
    itself. A Ctrl-C landing there was taken for the file's failure (``KeyboardInterrupt: ``) and the
    job ran on to its end, ``interrupted`` False. With Python's handler the job notes the signal and
    stops at its next turn; a caller's own handler that raises KeyboardInterrupt (left in place) gets
    it passed on by the callback. Made exact: every decode is awaited before its callback is attached,
    and the SIGINT is sent from the callback's ``result()`` call."""
    import concurrent.futures as cf
    import signal

    from flashasr.jobs import feeder as feeder_mod

    class DoneFirst(set):  # the pool's futures: each added once its decode is done
        def add(self, f):
            f.exception(timeout=60)
            super().add(f)

    init = feeder_mod._ThreadWorkers.__init__

    def patched_init(self, *args, **kw):
        init(self, *args, **kw)
        self._futures = DoneFirst()

    monkeypatch.setattr(feeder_mod._ThreadWorkers, "__init__", patched_init)
    result, sent = cf.Future.result, []

    def result_with_ctrl_c(self, timeout=None):
        if threading.current_thread() is threading.main_thread() and not sent:
            sent.append(True)
            _ctrl_c()
        return result(self, timeout)

    monkeypatch.setattr(cf.Future, "result", result_with_ctrl_c)
    if handler == "the caller's own":
        def own(signum, frame):
            raise KeyboardInterrupt

        signal.signal(signal.SIGINT, own)  # the fixture puts Python's back
    try:
        r = run_job([wavs], SleepModel(), tmp_path / "out", "text", batch_size=1, split_fn=fixed_split,
                    max_segment_s=5, workers=2, progress=False)
    except KeyboardInterrupt:
        pytest.fail("the Ctrl-C escaped run_job")
    assert sent and r.interrupted and not r.failed, [x.error_message for x in r.failed]
    assert _wound_down(r, tmp_path / "out")
