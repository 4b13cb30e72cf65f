"""One long file decoded by several workers (``flashasr.audio.parallel``) equals the sequential
``load_audio``: same length, max |difference| within the bound the module docstring states, no
lost or doubled sample at any join; damaged, short, bytes and other inputs take (or fall back
to) the sequential path and give its result or its error class.

Test files: ~100 s of real speech (../shared/audio, read in place) re-encoded with PyAV once per
session: mp3 44.1 kHz stereo CBR 128 kb/s, mp3 16 kHz mono VBR with and without its Xing header,
ogg/opus 48 kHz, m4a/aac 44.1 kHz, flac 44.1 kHz stereo, wav 16 kHz 24-bit, webm/opus.
"""

from __future__ import annotations

import numpy as np
import pytest

import flashasr.audio.parallel as par
from flashasr.audio import encode_audio, load_audio, load_audio_parallel
from flashasr.audio.opus import enabled as opus_enabled
from flashasr.errors import AudioError, AudioTooLongError

from conftest import AUDIO

SECONDS = 100.0
BOUND = 1e-5  # stated in flashasr/audio/parallel.py: measured <= 2e-7 (opus <= 1e-6)
# AAC's perceptual noise substitution draws from a decoder-side random generator whose state
# depends on where decoding started: those bands differ (measured <= 8.5e-4 on 419-2,186 of 1.6 M
# samples, depending on the input)
AAC_BOUND, AAC_SHARE = 1e-3, 5e-3
# ogg/opus through libopus (flashasr/audio/opus.py): a decoder started mid-stream converges slowly
# in hybrid/SILK modes (measured <= 2e-3 for seconds after a join); bound its size and energy
OPUS_BOUND, OPUS_REL_RMS = 1e-2, 1e-3

# name: (container, codec, rate, channels, encode_audio keywords)
FILES = {
    "mp3_cbr_44k_stereo": ("mp3", "libmp3lame", 44100, 2, {"bit_rate": 128000}),
    "mp3_vbr_16k": ("mp3", "libmp3lame", 16000, 1, {"quality": 4}),
    "mp3_vbr_16k_no_xing": ("mp3", "libmp3lame", 16000, 1, {"quality": 4, "container_options": {"write_xing": "0"}}),
    "opus_48k": ("ogg", "libopus", 48000, 1, {"bit_rate": 32000}),
    "aac_44k": ("ipod", "aac", 44100, 1, {"bit_rate": 96000}),
    "flac_44k_stereo": ("flac", "flac", 44100, 2, {}),
    "wav24_16k": ("wav", "pcm_s24le", 16000, 1, {}),  # 24-bit: FFmpeg reads it (PCM16 WAVs need no ranges: sequential_suffices)
}
EXT = {"ipod": "m4a", "ogg": "opus"}


def _speech(rate: int, channels: int) -> np.ndarray:
    parts = [load_audio(AUDIO / p, target_rate=rate).samples
             for p in ("long/long-en-voxpopuli-000.ogg", "long/long-en-ted-60s.m4a")]
    x = np.concatenate(parts)[: int(SECONDS * rate)]
    if channels == 1:
        return x
    # half the same speech, half speech 7 s away (uncorrelated): never anti-correlated, so the
    # energy-keeping downmix stays the plain mean (a 1 ms lag was not: it inverts ~500 Hz)
    right = 0.5 * x + 0.5 * np.roll(x, 7 * rate)
    return np.stack([x, right], axis=1)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("parallel")
    cache: dict = {}
    out = {}
    for name, (fmt, codec, rate, ch, kw) in FILES.items():
        key = (rate, ch)
        if key not in cache:
            cache[key] = _speech(rate, ch)
        p = d / f"{name}.{EXT.get(fmt, fmt)}"
        encode_audio(cache[key], rate, p, format=fmt, codec=codec, **kw)
        out[name] = p
    return out


@pytest.fixture
def spy(monkeypatch):
    """Records each parallel attempt: its plan and whether it fell back."""
    calls = []
    real = par._run

    def run(plan, src, pool, *keep):
        rec = {"plan": plan, "fallback": None}
        calls.append(rec)
        try:
            return real(plan, src, pool, *keep)
        except par._Fallback as e:
            rec["fallback"] = str(e)
            raise

    monkeypatch.setattr(par, "_run", run)
    return calls


def _join_lags(a: np.ndarray, b: np.ndarray, at: int, rate: int, max_lag: int = 8) -> int:
    """Lag (samples) of best cross-correlation of ``a`` against ``b`` in a 1 s window at ``at``."""
    w = rate
    lo, hi = max(max_lag, at - w // 2), min(len(a) - max_lag, at + w // 2)
    seg = a[lo:hi].astype(np.float64)
    scores = [float(np.dot(seg, b[lo + lag:hi + lag])) for lag in range(-max_lag, max_lag + 1)]
    return int(np.argmax(scores)) - max_lag


@pytest.mark.parametrize("name", list(FILES))
def test_parallel_equals_sequential(files, spy, name):
    path = files[name]
    ref = load_audio(path)
    for workers in (1, 2, 3, 7):
        spy.clear()
        got = load_audio_parallel(path, workers=workers)
        assert got.samples.dtype == np.float32
        assert len(got) == len(ref), (workers, len(got), len(ref))
        err = np.abs(got.samples - ref.samples)
        diff = float(err.max())
        if name.startswith("aac"):
            assert diff <= AAC_BOUND and np.count_nonzero(err > BOUND) <= AAC_SHARE * err.size, (workers, diff)
        elif name.startswith("opus") and opus_enabled():
            rel = float(np.sqrt(np.mean(err.astype(np.float64) ** 2) / np.mean(ref.samples.astype(np.float64) ** 2)))
            assert diff <= OPUS_BOUND and rel <= OPUS_REL_RMS, (workers, diff, rel)
        else:
            assert diff <= BOUND, (workers, diff)
        assert (got.sample_rate, got.source_sample_rate, got.source_channels, got.source_format, got.warnings) == \
               (ref.sample_rate, ref.source_sample_rate, ref.source_channels, ref.source_format, ref.warnings)
        if workers == 1:
            assert spy == []  # one worker: the sequential path itself
            continue
        assert len(spy) == 1 and spy[0]["fallback"] is None, spy  # really joined in parallel
        plan = spy[0]["plan"]
        assert len(plan.bounds) == workers
        for s in plan.bounds[1:]:
            at = plan.out_index(s)
            j = slice(max(0, at - 800), at + 800)
            bound = AAC_BOUND if name.startswith("aac") else OPUS_BOUND if name.startswith("opus") and opus_enabled() \
                else BOUND
            assert float(np.abs(got.samples[j] - ref.samples[j]).max()) <= bound
            if float(np.abs(ref.samples[j]).max()) > 0.01:  # speech here: no lost or doubled sample
                assert _join_lags(got.samples, ref.samples, at, 16000) == 0


def test_opus_through_ffmpeg_equals_sequential(files, spy, monkeypatch):
    """With ``FLASHASR_OPUS_DECODER=ffmpeg`` Ogg/Opus decodes with FFmpeg at 48 kHz, and its ranges
    join within the tight bound (FFmpeg's decoder converges within the 1 s pre-roll)."""
    monkeypatch.setenv("FLASHASR_OPUS_DECODER", "ffmpeg")
    assert not opus_enabled()
    ref = load_audio(files["opus_48k"])
    got = load_audio_parallel(files["opus_48k"], workers=3)
    assert len(spy) == 1 and spy[0]["fallback"] is None and spy[0]["plan"].in_rate == 48000
    assert len(got) == len(ref) and float(np.abs(got.samples - ref.samples).max()) <= BOUND
    assert got.source_sample_rate == ref.source_sample_rate == 48000


def test_webm_equals_sequential(tmp_path, spy):
    """WebM timestamps are milliseconds: joined in parallel only where every frame position is
    a whole sample (20 ms opus frames are), else decoded sequentially; equal either way."""
    p = tmp_path / "x.webm"
    encode_audio(_speech(48000, 1)[: 48000 * 70], 48000, p, format="webm", codec="libopus", bit_rate=32000)
    ref = load_audio(p)
    got = load_audio_parallel(p, workers=3)
    assert len(got) == len(ref) and float(np.abs(got.samples - ref.samples).max()) <= BOUND


def test_target_rate_none_and_other_rates(files):
    ref = load_audio(files["aac_44k"], target_rate=None)
    got = load_audio_parallel(files["aac_44k"], target_rate=None, workers=3)
    assert got.sample_rate == 44100 and len(got) == len(ref)
    assert float(np.abs(got.samples - ref.samples).max()) <= AAC_BOUND  # no resampler; AAC's noise bands
    ref = load_audio(files["flac_44k_stereo"], target_rate=None)
    got = load_audio_parallel(files["flac_44k_stereo"], target_rate=None, workers=3)
    assert np.array_equal(got.samples, ref.samples)  # lossless, no resampler: bit-exact
    ref = load_audio(files["opus_48k"], target_rate=8000)  # libopus decodes at 8 kHz itself
    got = load_audio_parallel(files["opus_48k"], target_rate=8000, workers=3)
    assert got.sample_rate == 8000 and got.source_sample_rate == 48000
    assert len(got) == len(ref) and float(np.abs(got.samples - ref.samples).max()) <= (
        OPUS_BOUND if opus_enabled() else BOUND)


def test_short_files_bytes_and_streams_are_sequential(files, spy, tmp_path):
    short = tmp_path / "short.mp3"
    encode_audio(_speech(16000, 1)[: 16000 * 30], 16000, short, format="mp3", codec="libmp3lame", bit_rate=64000)
    ref = load_audio(short)
    assert np.array_equal(load_audio_parallel(short, workers=4).samples, ref.samples)
    path = files["mp3_vbr_16k"]
    ref = load_audio(path)
    assert np.array_equal(load_audio_parallel(path.read_bytes(), workers=4).samples, ref.samples)
    with open(path, "rb") as f:
        assert np.array_equal(load_audio_parallel(f, workers=4).samples, ref.samples)
    assert spy == []
    x = np.zeros(16000 * 120, np.float32)
    assert len(load_audio_parallel(x, sample_rate=16000, workers=4)) == 16000 * 120
    assert spy == []


def test_cancelling_stereo_falls_back(tmp_path, spy):
    """Right channel inverted from 50 s on: the energy-keeping downmix switches to one channel
    (stateful): the parallel path must not guess, the result is the sequential one."""
    x = _speech(16000, 1)[: 16000 * 80]
    r = x.copy()
    r[16000 * 50:] *= -1
    p = tmp_path / "inv.flac"
    encode_audio(np.stack([x, r], axis=1), 16000, p, format="flac")
    ref = load_audio(p)
    got = load_audio_parallel(p, workers=4)
    assert any("strongest channel" in w for w in ref.warnings)
    assert spy and spy[0]["fallback"]
    assert np.array_equal(got.samples, ref.samples) and got.warnings == ref.warnings


def test_clipped_and_limited_samples_fall_back_with_the_sequential_warnings(tmp_path, spy):
    """A trial found a long float WAV hard-limited at +-9,500 (its resampling rings past the +-1e4
    limit and is held there) and samples of 1e30 (clipped) decoded in ranges with no warning at all:
    the ranges counted them and nobody read the counts. Such a file now decodes sequentially, with
    the sequential decode's samples and warnings."""
    import struct

    x = np.clip(_speech(44100, 1)[: 44100 * 70] * 40000, -9500, 9500).astype(np.float32)
    x[44100 * 33] = 1e30
    data = x.astype("<f4").tobytes()
    fmt = struct.pack("<HHIIHH", 3, 1, 44100, 44100 * 4, 4, 32)
    p = tmp_path / "loud.wav"
    p.write_bytes(b"RIFF" + struct.pack("<I", 4 + 8 + len(fmt) + 8 + len(data)) + b"WAVE" + b"fmt "
                  + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data)
    ref, got = load_audio(p), load_audio_parallel(p, workers=3)
    assert any("limited" in w for w in ref.warnings) and any("clipped 1 samples" in w for w in ref.warnings)
    assert spy and spy[0]["fallback"]
    assert np.array_equal(got.samples, ref.samples) and got.warnings == ref.warnings


def test_damaged_files_match_sequential(files, spy, tmp_path):
    data = files["mp3_cbr_44k_stereo"].read_bytes()
    # truncated: the decodable prefix, with the header's warning
    cut = tmp_path / "cut.mp3"
    cut.write_bytes(data[: int(len(data) * 0.6)])
    ref, got = load_audio(cut), load_audio_parallel(cut, workers=3)
    assert len(got) == len(ref) and float(np.abs(got.samples - ref.samples).max()) <= BOUND
    assert got.warnings == ref.warnings
    # garbage in the middle: packets skipped (sample positions shift), so sequential
    bad = bytearray(data)
    mid = len(bad) // 2
    bad[mid:mid + 20000] = np.random.default_rng(0).integers(0, 256, 20000, dtype=np.uint8).tobytes()
    p = tmp_path / "bad.mp3"
    p.write_bytes(bytes(bad))
    ref, got = load_audio(p), load_audio_parallel(p, workers=3)
    assert np.array_equal(got.samples, ref.samples) and got.warnings == ref.warnings
    # m4a with its index at the end, truncated: no index, the same error class
    m4a = files["aac_44k"].read_bytes()
    p = tmp_path / "cut.m4a"
    p.write_bytes(m4a[: len(m4a) // 2])
    with pytest.raises(AudioError) as e_seq:
        load_audio(p)
    with pytest.raises(AudioError) as e_par:
        load_audio_parallel(p, workers=3)
    assert type(e_par.value) is type(e_seq.value) and e_par.value.code == e_seq.value.code


def test_max_duration(files):
    with pytest.raises(AudioTooLongError):
        load_audio_parallel(files["opus_48k"], workers=3, max_duration=50)
    got = load_audio_parallel(files["opus_48k"], workers=3, max_duration=SECONDS + 5)
    assert abs(got.duration - SECONDS) < 0.1
    # a header that declares less than the file holds (VBR mp3 without Xing): the last range stops
    no_xing = files["mp3_vbr_16k_no_xing"]
    declared = par._ContainerSource(str(no_xing), "x").declared
    if declared < SECONDS - 2:
        with pytest.raises(AudioTooLongError):
            load_audio_parallel(no_xing, workers=3, max_duration=declared + 1)


def test_worker_pool_argument(files):
    import concurrent.futures as cf

    ref = load_audio(files["wav24_16k"])
    with cf.ThreadPoolExecutor(2) as ex:
        got = load_audio_parallel(files["wav24_16k"], workers=4, pool=ex)
    assert np.array_equal(got.samples, ref.samples)


def test_default_workers(monkeypatch):
    monkeypatch.setenv("FLASHASR_DECODE_WORKERS", "3")
    assert par.default_workers() == 3
    monkeypatch.delenv("FLASHASR_DECODE_WORKERS")
    assert 1 <= par.default_workers() <= 16


def _decode_in_daemon(path, q):
    x = load_audio_parallel(path, workers=4).samples
    q.put((len(x), float(x[:1000].sum())))


def test_a_daemonic_process_decodes_sequentially(files, spy):
    """A daemonic multiprocessing process (the server's front ends, the job's decode workers) may
    not start the range processes: the decode is sequential there, with the same samples."""
    import multiprocessing as mp

    ref = load_audio(files["wav24_16k"]).samples
    q = mp.get_context("fork").Queue()
    p = mp.get_context("fork").Process(target=_decode_in_daemon, args=(files["wav24_16k"], q), daemon=True)
    p.start()
    n, head = q.get(timeout=120)
    p.join(30)
    assert p.exitcode == 0 and n == len(ref) and abs(head - float(ref[:1000].sum())) < 1e-4
    assert spy == []  # the parent's spy is not the child's; and in this process nothing ran in parallel


def test_a_job_of_one_long_file_decodes_its_ranges_in_processes(files, spy, tmp_path):
    """run_job with fewer files than workers: the files in threads of the job's process, each file's
    time ranges in load_audio_parallel's processes (a worker process may not start them); the same
    output as a one-worker job (16 kHz 24-bit WAV: bit-exact samples, so the hash model's text agrees)."""
    from flashasr.jobs import run_job
    from test_jobs import HashModel, _outputs

    r4 = run_job([files["wav24_16k"]], HashModel(), tmp_path / "o4", "json", workers=4, cpu_pool="process",
                 segmentation="fixed")
    assert r4.exit_code == 0 and r4.cpu_pool == "thread"
    assert len(spy) == 1 and spy[0]["fallback"] is None and len(spy[0]["plan"].bounds) == 4
    r1 = run_job([files["wav24_16k"]], HashModel(), tmp_path / "o1", "json", workers=1, segmentation="fixed")
    assert len(spy) == 1 and _outputs(tmp_path / "o4") == _outputs(tmp_path / "o1")


_KILLED_OWNER = """
import sys, time
import flashasr.audio.parallel as par
if __name__ == "__main__":
    x = par.load_audio_parallel(sys.argv[1], workers=2, pool="process").samples
    ex = par._pools["process"][2]
    print(" ".join(str(p) for p in ex._processes), flush=True)
    time.sleep(600)
"""


def test_range_processes_end_when_their_owner_is_killed(files, tmp_path):
    """SIGKILL of the process owning the range pool (a server stopped hard) leaves no worker behind
    (ProcessPoolExecutor workers hold their own queue's writing end and used to wait for ever,
    keeping the forkserver and the resource tracker alive: 24 orphans after one test-suite run)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "owner.py"
    script.write_text(_KILLED_OWNER)
    p = subprocess.Popen([sys.executable, str(script), str(files["wav24_16k"])], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(x) for x in p.stdout.readline().split()]
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(30)
    assert pids

    def alive(pid):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"

    deadline = time.monotonic() + 20
    while any(alive(q) for q in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(q) for q in pids)


@pytest.mark.parametrize("pool", ["thread", "process"])
def test_a_truncated_long_file_falls_back_without_a_traceback(tmp_path, caplog, pool):
    """Found by a new user: the first 1,048,000 bytes of a 169 s WAV through the server logged a
    traceback per range (``BufferError: cannot close exported pointers exist`` from the range process,
    masking the expected fallback); the result itself was right."""
    import logging

    cut = tmp_path / "cut.wav"
    cut.write_bytes((AUDIO / "long" / "long-8k-aepyx-169s.wav").read_bytes()[:1_048_000])
    with caplog.at_level(logging.WARNING, logger="flashasr"):
        got = load_audio_parallel(cut, workers=3, pool=pool)
    want = load_audio(cut)
    assert got.samples.shape == want.samples.shape and np.array_equal(got.samples, want.samples)
    assert 60 < got.duration < 70 and any("trunc" in w or "declare" in w for w in got.warnings), got.warnings
    assert not [r for r in caplog.records if "parallel decode" in r.getMessage()], caplog.text


_SIGNALLED_GROUP = """
import signal, sys
import numpy as np
import flashasr.audio.parallel as par
if __name__ == "__main__":
    for sig in (signal.SIGINT, signal.SIGTERM):  # the owner carries on, as a server does (its own handlers)
        signal.signal(sig, lambda *_: None)
    ref = par.load_audio_parallel(sys.argv[1], workers=2, pool="process").samples
    print("decoded", flush=True)
    sys.stdin.readline()  # the test signals the whole process group meanwhile
    for _ in range(2):  # the pool's workers may be gone: sequential, then a fresh pool
        again = par.load_audio_parallel(sys.argv[1], workers=2, pool="process").samples
        print(len(again) == len(ref) and float(np.abs(again - ref).max()) <= 1e-5, flush=True)
"""


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_to_the_process_group_leaves_the_decode_working_and_quiet(files, tmp_path, sig):
    """Ctrl-C in a terminal (SIGINT) or ``kill -TERM -PGID`` reaches the range pool's processes too
    (same process group as their owner, a server that stops gracefully): the workers end without a
    word -- on Ctrl-C each printed a KeyboardInterrupt traceback -- and the owner's next decodes
    still give the samples (sequentially while the pool is broken, then in a fresh pool)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from conftest import sigint_default

    script = tmp_path / "owner.py"
    script.write_text(_SIGNALLED_GROUP)
    p = subprocess.Popen([sys.executable, str(script), str(files["wav24_16k"])], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         preexec_fn=sigint_default)
    try:
        assert p.stdout.readline().strip() == "decoded"
        os.killpg(p.pid, getattr(signal, sig))
        time.sleep(1.0)
        out, err = p.communicate("\n", timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err
    assert out.split() == ["True", "True"], (out, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
