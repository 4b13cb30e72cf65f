"""Decode ONE long file on several cores: split it at seek points into time ranges, decode,
downmix and resample each range in a worker, and join them without a lost or doubled sample.

Data flow (K ranges; sample indices count the samples the sequential decode would produce,
from its first decoded sample; ``L = in_rate / gcd(in_rate, out_rate)``, ``M = out_rate / gcd``)::

    path --plan (main thread: open, decode the first frame: rate, channels, first pts)-->
         boundaries s_0 = 0 < s_1 < ... < s_K-1 (input samples, multiples of L, so that
         s_k maps to the exact output index s_k * M / L)
    range k (worker thread, its own PyAV container, in parallel):
         seek (backward, stream time base) to s_k - C - D; decode; each frame's position is its
         pts in samples (pts * time_base * in_rate - first pts), checked to be whole and
         contiguous; samples before p_k = s_k - C dropped (D: decoder pre-roll)
         --> float32 [C, n] blocks --> Downmixer --> soxr HQ stream started at p_k
             (C: resampler context, a multiple of L) --> decoded on to s_k+1 + C (last: EOF + flush)
         --> output samples [s_k * M / L, s_k+1 * M / L) written straight into their slice
             of one preallocated float32 [N_out] array
    join: nothing to copy; every range's checks passed, else the whole file is decoded by
         :func:`flashasr.audio.load_audio` (sequential) instead

Positions come from packet timestamps after FFmpeg's own seek, never from the requested time:
``av_seek_frame`` with ``AVSEEK_FLAG_BACKWARD`` lands on a frame at or before the target
(FFmpeg's seeking semantics), the frames' pts say where. For mp3, current FFmpeg seeks by its
generic index (it demuxes from the start up to the target in C, so the pts are exact whether
the file is CBR or VBR, with or without a Xing TOC; the TOC is only used with ``usetoc``, which
we never set); ogg bisects on granule positions; mp4/m4a and flac use their sample tables /
frame headers; wav computes from the byte offset. Where a range cannot prove its position --
pts missing, not a whole number of samples (Matroska/WebM: millisecond timestamps), a gap or
overlap between frames, a seek that lands after its target three times, the file ending before
a middle range does -- the whole file is decoded sequentially, so a doubtful join is never
returned. The same happens for anything the sequential decode would report or treat
statefully: undecodable packets, demuxer errors, a sample-rate or channel-count change,
non-finite samples or samples clipped at the limit, and a downmix that is not the plain channel mean throughout with margin
(the energy-keeping downmixer's state depends on history; a range is trusted only when its
cancellation ratio stays >= 0.5, twice the switching threshold). Errors and warnings
therefore equal :func:`~flashasr.audio.load_audio`'s: on a damaged file the sequential path
raises or warns, exactly as before.

Exactness (max |parallel - sequential| over whole files, equal lengths; measured on real speech
re-encoded with PyAV, ``tests/test_decode_parallel.py``):

* wav, flac: decoded samples bit-exact; the join error is soxr's float rounding (<= 2e-7;
  0 when the file is already at ``target_rate``).
* mp3 (CBR, VBR): after the pre-roll the decoder produces bit-exact samples (bit reservoir
  and 576-sample overlap settle within ~5 frames), so again only float rounding (<= 2e-7).
* m4a/aac: the same after one 1024-sample frame, except bands coded with perceptual noise
  substitution: their noise comes from a decoder-side random generator whose state depends on
  where decoding started (as between any two AAC decoders), so a few samples differ far from
  any join (measured: 419 of 1.6 M samples, at most 2.3e-4, -71 dB below the peak).
* ogg/opus decoded by libopus at the output rate (the default, :mod:`flashasr.audio.opus`): a
  decoder started mid-stream converges slowly in SILK and hybrid modes (its synthesis filters'
  and energy predictors' state): measured up to 2e-3 (-54 dB) for seconds after a join, on a
  few % of the samples, bit-exact only from a point the content decides (3 s into a 32 kb/s
  hybrid stream, not within 5 s in another). The joins are sample-exact; the samples near them
  are close, not equal, like AAC's noise bands.
* ogg/opus decoded by FFmpeg (``FLASHASR_OPUS_DECODER=ffmpeg``, and webm/opus): the decoder
  converges after the recommended 80 ms pre-roll but is not bit-exact (its float state keeps
  ~1e-7 differences); with D = 1 s the join error is <= 1e-6.

The test bound is 1e-5 (AAC: 1e-3 on at most 0.5 % of samples; libopus: 1e-2, the difference's
energy at most 1e-3 of the signal's). ``D`` (1 s) is over ten times any codec's need (opus: 80 ms
pre-roll, 312-sample pre-skip; mp3: bit reservoir of up to 511 bytes, 576-sample overlap; AAC:
1024-sample overlap); ``C`` (0.25 s) is far beyond soxr HQ's filter length (a 10 ms context
already joins 44.1 -> 16 kHz within rounding). Both cost < 1 % of a range of >= 10 s.

Processes by default (:func:`default_pool_kind`): the ranges run in a forkserver pool and write
into one shared-memory array. Threads (``FLASHASR_DECODE_POOL=thread``) write into an ordinary
array, but PyAV's per-frame Python contends for the GIL: on the H200 machine an hour of mp3 took
15.5 s in 16 threads, 6.4 s sequentially and 0.80 s in 16 processes
(``bench/results/long_file_h200.json``). A daemonic process (the server's front ends in multi
mode, the job runner's decode workers) may not start processes: there the decode is sequential.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import math
import os
import threading
import time
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any

import numpy as np

from .decode import (
    SOURCE_RATES,
    DecodedAudio,
    _ContainerSource,
    _frame_info,
    _frame_into,
    _kept_channels,
    _label,
    _Pipeline,
    load_audio,
    plain_pcm_wav,
)
from .errors import AudioArgumentError, AudioError, AudioTooLongError

#: Files declaring less than this (seconds) are decoded sequentially.
MIN_PARALLEL_S = 60.0
#: Shortest range (seconds): more workers than ``duration / MIN_RANGE_S`` are not used.
MIN_RANGE_S = 10.0
#: Decoder pre-roll D (seconds) decoded before a range's resampler context and dropped.
PREROLL_S = 1.0
#: Resampler context C (seconds, rounded up to a multiple of L) fed before and after a range.
CONTEXT_S = 0.25
#: A range's downmix is trusted while its channel-cancellation ratio stays at or above this.
MIN_DOWNMIX_RATIO = 0.5
_MAX_WORKERS = 16
_SEEK_TRIES = 3

log = logging.getLogger(__name__)


def default_workers() -> int:
    """Decode workers for one file: ``$FLASHASR_DECODE_WORKERS`` if set, else the CPU count,
    capped at 16."""
    env = os.environ.get("FLASHASR_DECODE_WORKERS", "").strip()
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            raise AudioArgumentError(f"FLASHASR_DECODE_WORKERS must be an integer, got {env!r}") from None
    return max(1, min(os.cpu_count() or 1, _MAX_WORKERS))


def default_pool_kind() -> str:
    """``$FLASHASR_DECODE_POOL`` (``thread`` or ``process``) if set, else ``process``.

    Processes by default: on the H200 machine (16 cores) an hour of 44.1 kHz stereo mp3 took 6.4 s
    decoded sequentially, 15.5 s in 16 threads (PyAV's per-frame calls give the GIL up and wait up
    to the 5 ms switch interval to get it back) and 0.80 s in 16 processes
    (``bench/results/long_file_h200.json``)."""
    kind = os.environ.get("FLASHASR_DECODE_POOL", "").strip().lower() or "process"
    if kind not in ("thread", "process"):
        raise AudioArgumentError(f"FLASHASR_DECODE_POOL must be 'thread' or 'process', got {kind!r}")
    return kind


_pool_lock = threading.Lock()
_pools: dict[str, tuple[int, int, cf.Executor]] = {}  # kind -> (pid, size, executor)


def _shared_pool(n: int, kind: str = "thread") -> cf.Executor:
    """The module's range pool of ``kind``: at least ``n`` and at least :func:`default_workers`
    workers, re-created after a fork or when a call asks for more (the old one is dropped, not
    shut down: a concurrent call may still be submitting to it; idle threads end when it is
    collected). Threads start on demand. Processes come from a forkserver (a clean process
    that preloads this module, PyAV and soxr; never a fork of a caller that may hold other
    threads' locks), started on first use (about a second) and kept. Range tasks never wait on
    other tasks, so callers running in any other pool can share it without deadlock."""
    with _pool_lock:
        got = _pools.get(kind)
        # a process pool is never replaced for size (its processes would linger): tasks queue
        if got is None or got[0] != os.getpid() or (got[1] < n and kind == "thread"):
            size = max(n, default_workers())
            if kind == "process":
                import multiprocessing as mp

                ctx = mp.get_context("forkserver")
                ctx.set_forkserver_preload(["flashasr.audio.parallel", "av", "soxr"])
                ex: cf.Executor = cf.ProcessPoolExecutor(max_workers=size, mp_context=ctx,
                                                         initializer=_start_worker, initargs=(os.getpid(),))
            else:
                ex = cf.ThreadPoolExecutor(max_workers=size, thread_name_prefix="flashasr-range")
            got = _pools[kind] = (os.getpid(), size, ex)
        return got[2]


def _start_worker(owner: int) -> None:
    """Initializer of a range pool's worker process: SIGINT at its default action, so Ctrl-C (which
    reaches every process of the terminal's group) ends the worker at once without a word -- each
    printed a KeyboardInterrupt traceback -- and its owner decodes sequentially (a broken pool);
    and the worker ends once its owner is gone (:func:`exit_with_parent`)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
    exit_with_parent(owner)


def exit_with_parent(pid: int, poll_s: float = 1.0) -> None:
    """In a pool worker: end this process (``os._exit(0)``) once process ``pid`` is gone.

    A :class:`~concurrent.futures.ProcessPoolExecutor` worker waits on a queue whose writing end
    it holds itself, so when its owner dies without shutting the pool down (SIGKILL, or a server
    stopped by a signal) it waits for ever, and keeps the forkserver and the resource tracker
    alive with it (a killed server left 4 processes, ~170 MB; the test suite 24). A daemon
    thread polls ``pid`` every ``poll_s`` seconds (signal 0, and ``/proc``: a zombie counts as gone).
    """
    import threading

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            try:
                os.kill(pid, 0)
                with open(f"/proc/{pid}/stat", "rb") as f:  # a dead owner not yet reaped: a zombie
                    if f.read().rsplit(b")", 1)[-1].split()[0] == b"Z":
                        os._exit(0)
            except ProcessLookupError:
                os._exit(0)
            except OSError:
                pass  # no /proc (not Linux) or not ours to signal: existence is all we can tell

    threading.Thread(target=watch, name="flashasr-parent-watch", daemon=True).start()


def mp_daemonic() -> bool:
    """Whether this is a daemonic :mod:`multiprocessing` process (it may not start processes)."""
    import multiprocessing as mp

    return bool(mp.current_process().daemon)


def _drop_pool(ex: cf.Executor) -> None:
    """Forget ``ex`` if it is a shared pool (broken: the next call starts a fresh one)."""
    with _pool_lock:
        for kind, got in list(_pools.items()):
            if got[2] is ex:
                del _pools[kind]


class _Fallback(Exception):
    """A range could not prove a sample-exact join: decode the whole file sequentially."""


@dataclass(frozen=True)
class _Plan:
    path: str
    label: str
    in_rate: int
    out_rate: int
    channels: int          # channel count of the first decoded frame
    tb: Fraction           # stream time base (seconds per pts unit)
    first: int             # first decoded frame's pts, in input samples (the sequential index 0)
    L: int
    M: int
    bounds: tuple[int, ...]  # s_0 = 0 < s_1 < ... < s_K-1, input samples
    context: int           # C, input samples (multiple of L)
    preroll: int           # D, input samples
    max_duration: float | None
    libopus: bool = False  # Ogg/Opus decoded by libopus at out_rate (every range decodes the same way)

    def out_index(self, s: int) -> int:
        return s // self.L * self.M


def _plan(path: str, label: str, target_rate: int | None, workers: int, max_duration: float | None,
          min_duration: float) -> tuple[_Plan | None, _ContainerSource | None]:
    """Open the file once (main thread), decode its first frame and choose the ranges; None
    when the file should be decoded sequentially. Raises what :func:`load_audio` raises for a
    file that cannot be opened."""
    src = _ContainerSource(path, label, target_rate)
    try:
        import av

        declared = src.declared
        if declared is None or declared < max(min_duration, 2 * MIN_RANGE_S):
            return None, src
        if max_duration is not None and declared > max_duration:
            return None, src  # the sequential decode raises AudioTooLongError after max_duration s
        st = src.stream
        if st.time_base is None:
            return None, src
        first_frame = None
        try:
            for frame in src._frames(av):
                if frame.samples:
                    first_frame = frame
                    break
        except Exception:  # noqa: BLE001 - whatever it is, the sequential decode reports it
            return None, src
        if first_frame is None or first_frame.pts is None or src.bad_packets or src.demux_errors:
            return None, src
        try:
            _, _, c, _ = _frame_info(first_frame)
        except KeyError:
            return None, src
        in_rate = int(first_frame.sample_rate)
        tb = Fraction(st.time_base.numerator, st.time_base.denominator)
        first = first_frame.pts * tb * in_rate
        if not SOURCE_RATES[0] <= in_rate <= SOURCE_RATES[1] or first.denominator != 1:
            return None, src
        out_rate = int(target_rate or in_rate)
        g = math.gcd(in_rate, out_rate)
        L, M = in_rate // g, out_rate // g
        n_est = int(declared * in_rate)
        k = max(1, min(int(workers), int(declared // MIN_RANGE_S)))
        if k < 2:
            return None, src
        bounds = [0]
        for i in range(1, k):
            s = round(i * n_est / k / L) * L
            if s > bounds[-1]:
                bounds.append(s)
        context = math.ceil(CONTEXT_S * in_rate / L) * L
        preroll = int(PREROLL_S * in_rate)
        plan = _Plan(path=path, label=label, in_rate=in_rate, out_rate=out_rate, channels=int(c), tb=tb,
                     first=int(first), L=L, M=M, bounds=tuple(bounds), context=context, preroll=preroll,
                     max_duration=max_duration, libopus=src.opus is not None)
        return plan, src
    except BaseException:
        src.close()
        raise


class _RangeOut:
    """Where one range's output goes: ``out[start:stop]`` of the shared array; the last range
    (``stop`` None) writes on to the array's end and keeps any excess in ``tail``."""

    def __init__(self, out: np.ndarray, start: int, stop: int | None):
        self.out, self.start, self.stop = out, start, stop
        self.pos = start          # next global output index to write
        self.tail: list[np.ndarray] = []

    def write(self, y: np.ndarray, at: int) -> None:
        """``y`` holds global output samples ``[at, at + len(y))``; keep those in range."""
        lo = max(at, self.start)
        hi = at + y.shape[0] if self.stop is None else min(at + y.shape[0], self.stop)
        if hi <= lo:
            return
        if lo != self.pos:
            raise _Fallback(f"output gap at {lo} (expected {self.pos})")
        part = y[lo - at:hi - at]
        room = max(0, min(hi, self.out.shape[0]) - lo)
        if room:
            self.out[lo:lo + room] = part[:room]
        if room < part.shape[0]:
            if self.stop is not None:
                raise _Fallback("output array too short for a middle range")
            self.tail.append(part[room:].copy())
        self.pos = hi


def _decode_range(plan: _Plan, k: int, out: np.ndarray, abort: threading.Event):
    """Decode range ``k`` of ``plan`` into ``out``; returns (its output end index, excess
    samples of the last range, this thread's CPU seconds for it, of which in soxr). Raises _Fallback when the join cannot be proven (or ``abort``
    is set: another range failed), AudioTooLongError past ``max_duration``."""
    import av

    c0 = time.thread_time()
    try:
        end, tail, resample_s = _decode_range_tries(plan, k, out, abort, av)
    except BaseException:
        abort.set()
        raise
    return end, tail, time.thread_time() - c0, resample_s


def _decode_range_tries(plan: _Plan, k: int, out: np.ndarray, abort: threading.Event, av):
    last = k == len(plan.bounds) - 1
    s = plan.bounds[k]
    e = None if last else plan.bounds[k + 1]
    p0 = max(0, s - plan.context)                        # first sample fed to the resampler
    feed_end = None if e is None else e + plan.context   # first sample not needed
    sink = _RangeOut(out, plan.out_index(s), None if e is None else plan.out_index(e))
    back = plan.preroll
    for _attempt in range(_SEEK_TRIES):
        src = _ContainerSource(plan.path, plan.label, plan.out_rate, libopus=plan.libopus)
        try:
            got = _decode_span(plan, src, av, k, p0, feed_end, back, sink, last, abort)
        finally:
            src.close()
        if got is not None:
            return got[0], sink.tail, got[1]
        back *= 4  # the seek landed after p0: start earlier
    raise _Fallback(f"range {k}: seek did not land before its start")


def _decode_span(plan: _Plan, src: _ContainerSource, av, k: int, p0: int, feed_end: int | None, back: int,
                 sink: _RangeOut, last: bool, abort: threading.Event) -> int | None:
    """One attempt at range ``k``: (the output end index, soxr CPU seconds), or None when the
    seek landed too close to ``p0`` (less than half the pre-roll before it) or after it."""
    rate, tb = plan.in_rate, plan.tb
    tb_num, tb_den, first = tb.numerator * rate, tb.denominator, plan.first  # integer math per frame
    if k > 0:
        target = plan.first + p0 - back  # input samples
        ts = math.floor(Fraction(target) / (tb * rate)) if target > 0 else 0
        try:
            src.container.seek(int(ts), stream=src.stream, backward=True, any_frame=False)
        except av.error.FFmpegError as e:
            raise _Fallback(f"range {k}: seek failed ({e})") from None
    pipe = _Pipeline(plan.out_rate, None, plan.label, check_finite=True)
    out_at = plan.out_index(p0)  # global output index of the resampler's next output sample
    expected: int | None = None  # sequential index of the next frame's first sample
    acc: np.ndarray | None = None
    fill = 0
    block = max(1, rate // 2)
    limit = None if plan.max_duration is None else plan.max_duration * rate

    def flush_block():
        nonlocal acc, fill, out_at
        if acc is not None and fill:
            for y in pipe.push(acc[:, :fill], rate):
                sink.write(y, out_at)
                out_at += y.shape[0]
        acc, fill = None, 0

    done = False
    for frame in src._frames(av):
        n = frame.samples
        if n == 0:
            continue
        if abort.is_set():
            raise _Fallback(f"range {k}: another range failed")
        pts = frame.pts
        if pts is not None:
            g, rem = divmod(pts * tb_num, tb_den)
            if rem:
                raise _Fallback(f"range {k}: pts {pts} is not a whole sample")
            g -= first
            if expected is None:
                if g > max(0, p0 - back // 2):
                    return None
            elif g != expected:
                raise _Fallback(f"range {k}: frames not contiguous ({g} != {expected})")
        elif expected is None:
            continue  # position unknown yet: decoder pre-roll
        else:
            g = expected
        expected = g + n
        if frame.sample_rate != rate:
            raise _Fallback(f"range {k}: sample rate changes")
        try:
            _, _, c, _ = _frame_info(frame)
        except KeyError:
            raise _Fallback(f"range {k}: unknown sample format") from None
        if c != plan.channels:
            raise _Fallback(f"range {k}: channel count changes")
        if limit is not None and expected > limit:
            raise AudioTooLongError(
                f"{plan.label}: audio is longer than the limit of {plan.max_duration:g} s "
                f"(decoding passed {expected / rate:.1f} s)")
        lo = max(g, p0)
        hi = expected if feed_end is None else min(expected, feed_end)
        if hi <= lo:
            if feed_end is not None and g >= feed_end:
                done = True
                break
            continue
        keep = _kept_channels(frame, c)
        ck = c if keep is None else len(keep)
        if acc is not None and fill + n > acc.shape[1]:
            flush_block()
        if acc is None:
            acc = np.empty((ck, max(n, block)), np.float32)
        if lo == g and hi == expected:
            _frame_into(frame, acc[:, fill:fill + n], c, n, keep)
        else:  # a frame cut at the range's edges
            tmp = np.empty((ck, n), np.float32)
            _frame_into(frame, tmp, c, n, keep)
            acc[:, fill:fill + hi - lo] = tmp[:, lo - g:hi - g]
        fill += hi - lo
        if feed_end is not None and expected >= feed_end:
            done = True
            break
    if expected is None:
        raise _Fallback(f"range {k}: no frame decoded")
    if feed_end is not None and not done:
        raise _Fallback(f"range {k}: the file ended before the range did")
    flush_block()
    if last:
        for y in pipe.flush():
            sink.write(y, out_at)
            out_at += y.shape[0]
    if src.bad_packets or src.bad_frames or src.demux_errors:
        raise _Fallback(f"range {k}: damaged packets")
    if pipe.rate_changes or pipe.nonfinite or pipe.clipped or pipe.overshoot or pipe.downmix.fallback_samples:
        # (anything the sequential decode warns about: its warnings are the file's; a trial found
        # samples clipped beyond the limit with no warning on this path)
        raise _Fallback(f"range {k}: rate change, non-finite or clipped samples, or downmix fallback")
    if plan.channels > 1 and pipe.downmix.min_ratio < MIN_DOWNMIX_RATIO:
        raise _Fallback(f"range {k}: channels partly cancel; the downmix depends on history")
    if sink.stop is not None and sink.pos != sink.stop:
        raise _Fallback(f"range {k}: wrote {sink.pos - sink.start} of {sink.stop - sink.start} samples")
    return sink.pos, pipe.resample_cpu_s


def load_audio_parallel(source: Any, *, target_rate: int | None = 16000, max_duration: float | None = None,
                        workers: int | None = None, pool: cf.Executor | str | None = None,
                        min_duration: float = MIN_PARALLEL_S, sample_rate: int | None = None,
                        raw_format: str | None = None, channels: int | None = None,
                        keep_segment: bool = False) -> DecodedAudio:
    """:func:`~flashasr.audio.load_audio`, with one long file decoded by several workers.

    Args:
        source: a path to a seekable container file is decoded in parallel when it declares at
            least ``min_duration`` seconds (and ``workers`` > 1); everything else (bytes, file
            objects, arrays, raw PCM, short or undeclared files) goes to :func:`load_audio`
            unchanged, as do files whose ranges cannot prove a sample-exact join (see the
            module docstring: Matroska/WebM millisecond timestamps, missing or jumping pts,
            damage, a downmix that leaves the channel mean).
        target_rate: output Hz (None: the source's).
        max_duration: seconds; a file declaring more is decoded sequentially (which raises
            :class:`~flashasr.errors.AudioTooLongError` once decoding passes the limit); the
            last range raises it too when the file holds more than it declared.
        workers: ranges decoded at once (default :func:`default_workers`: the CPU count, at
            most 16, or ``$FLASHASR_DECODE_WORKERS``); at most one range per 10 s of audio.
        pool: an executor to run the ranges in, or ``"thread"`` / ``"process"`` for this
            module's shared pool of that kind (default: :func:`default_pool_kind`). A process
            pool writes into a shared-memory segment that the result maps (no copy). Never pass
            the pool this call itself runs in: a range task that waits for a free worker of its
            own pool can deadlock it.
        min_duration: seconds below which the sequential path is used. A PCM WAV that
            :func:`load_audio` reads with numpy (:func:`~flashasr.audio.decode.plain_pcm_wav`) is
            also sequential when it is already at ``target_rate`` (an hour of 16 kHz PCM16 reads
            in tens of milliseconds), unless ``keep_segment`` asks for the ranges' segment.
        sample_rate, raw_format, channels: as :func:`load_audio` (those inputs are sequential).
        keep_segment: when the ranges ran in processes (the samples then live in a shared-memory
            segment), keep the segment's name and give it as ``DecodedAudio.segment`` so that
            another process can map the same pages (the server hands an upload to its engine
            without a copy); the caller then owns the name and unlinks it
            (:func:`flashasr.shm.unlink_segment`; a crashed process's segments go with
            :func:`flashasr.shm.cleanup_stale_segments`). Otherwise ``segment`` is None.
    Returns:
        :class:`DecodedAudio`: ``samples`` float32 [N] at ``target_rate``, equal in length to
        the sequential decode's and within 1e-5 of it (measured: <= 2e-7 for wav, flac, mp3;
        <= 1e-6 for ogg/opus through FFmpeg; AAC's noise-substituted bands up to 8.5e-4; ogg/opus
        through libopus up to 2e-3 for seconds after a join), with the same metadata and warnings.
    Raises:
        What :func:`load_audio` raises, for the same inputs.
    """
    if workers is None:
        workers = default_workers()
    if (raw_format is not None or not isinstance(source, (str, os.PathLike)) or int(workers) < 2
            or (target_rate is not None and target_rate <= 0) or (max_duration is not None and max_duration <= 0)):
        return load_audio(source, sample_rate=sample_rate, target_rate=target_rate, raw_format=raw_format,
                          channels=channels, max_duration=max_duration)
    if pool is None or isinstance(pool, str):
        pool = pool or default_pool_kind()
        if pool == "process" and mp_daemonic():  # may not start processes: sequential
            return load_audio(source, target_rate=target_rate, max_duration=max_duration)
    path = os.fspath(source)
    wav = plain_pcm_wav(path)  # numpy reads it: ranges only pay where it is long and needs resampling
    if wav is not None and (wav[1] < max(min_duration, 2 * MIN_RANGE_S) or (wav[0] == target_rate and not keep_segment)):
        return load_audio(source, target_rate=target_rate, max_duration=max_duration)
    label = _label(source)
    plan, src = _plan(path, label, target_rate, int(workers), max_duration, min_duration)
    try:
        if plan is None:
            return load_audio(source, target_rate=target_rate, max_duration=max_duration)
        try:
            return _run(plan, src, pool, keep_segment)
        except _Fallback as e:
            log.debug("%s: decoding sequentially: %s", label, e)
        return load_audio(source, target_rate=target_rate, max_duration=max_duration)
    finally:
        if src is not None:
            src.close()


def _decode_range_shm(plan: _Plan, k: int, name: str, size: int):
    """:func:`_decode_range` in a worker process: the output array is the shared-memory segment
    ``name`` of ``size`` float32 samples, made by the caller (no abort across processes)."""
    import mmap

    import _posixshmem

    fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    try:
        m = mmap.mmap(fd, size * 4)
    finally:
        os.close(fd)
    out = np.frombuffer(m, np.float32, count=size)
    try:
        return _decode_range(plan, k, out, threading.Event())
    except BaseException as e:
        e.__traceback__ = None  # its frames hold views of the mapping (m.close() would raise BufferError)
        raise
    finally:
        del out
        try:
            m.close()
        except BufferError:  # a view still alive somewhere: the mapping goes when it does
            pass


def _shm_output(size: int) -> tuple[str, np.ndarray]:
    """A new shared-memory segment of ``size`` float32 samples, mapped here: (name, array)."""
    import mmap

    import _posixshmem

    from ..shm import new_name

    name = new_name()
    fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
    try:
        os.ftruncate(fd, size * 4)
        m = mmap.mmap(fd, size * 4)
    finally:
        os.close(fd)
    return name, np.frombuffer(m, np.float32, count=size)


def _run(plan: _Plan, src: _ContainerSource, pool: cf.Executor | str | None, keep_segment: bool = False) -> DecodedAudio:
    """Decode every range of ``plan`` in ``pool`` and join them; raises _Fallback. ``keep_segment``:
    a process pool's output segment keeps its name when the samples are its start (see
    :func:`load_audio_parallel`)."""
    k = len(plan.bounds)
    declared = src.declared or 0.0
    size = max(int(declared * plan.out_rate * 1.01) + 4096, plan.out_index(plan.bounds[-1]) + 4096)
    ex = pool if isinstance(pool, cf.Executor) else _shared_pool(k, pool or default_pool_kind())
    shm_name = None
    abort: threading.Event | None = None
    if isinstance(ex, cf.ProcessPoolExecutor):
        shm_name, out = _shm_output(size)
        if plan.path.startswith("/proc/self/"):  # another process's /proc/self is its own
            plan = replace(plan, path=f"/proc/{os.getpid()}/" + plan.path[len("/proc/self/"):])
        try:
            futures = [ex.submit(_decode_range_shm, plan, i, shm_name, size) for i in range(k)]
        except (cf.BrokenExecutor, OSError, EOFError):  # a worker died earlier, or none can start (the
            # forkserver is gone: a signal to the process group): a fresh shared pool next time
            from ..shm import unlink_segment

            unlink_segment(shm_name)
            _drop_pool(ex)
            raise _Fallback("the process pool is broken") from None
    else:
        out = np.empty(size, np.float32)
        abort = threading.Event()
        futures = [ex.submit(_decode_range, plan, i, out, abort) for i in range(k)]
    fallback = False
    error: BaseException | None = None
    end, tail = 0, []
    cpu_s = resample_s = 0.0
    waited = False
    try:
        for i, f in enumerate(futures):
            try:
                got = f.result()
            except _Fallback:
                fallback = True  # a range that cannot prove its join
                continue
            except cf.BrokenExecutor:  # a worker process died: a fresh shared pool next time
                _drop_pool(ex)
                fallback = True
                continue
            except AudioTooLongError as e:
                error = error or e
                continue
            except AudioError:
                fallback = True  # a range that cannot even open: let the sequential decode say why
                continue
            except Exception:  # noqa: BLE001 - never a wrong result: the sequential decode decides
                log.warning("%s: parallel decode of range %d failed; decoding sequentially", plan.label, i,
                            exc_info=True)
                fallback = True
                continue
            cpu_s += got[2]
            resample_s += got[3]
            if i == k - 1:
                end, tail = got[0], got[1]
        waited = True
    except BaseException:  # interrupted while waiting: stop the other ranges
        if abort is not None:
            abort.set()
        raise
    finally:
        if shm_name is not None and not (keep_segment and waited):
            _unlink(shm_name)  # the mapping here keeps the memory as long as the array lives
    segment = shm_name if keep_segment else None
    try:
        if error is not None:
            raise error
        if fallback:
            raise _Fallback("a range could not be joined exactly")
        if tail:
            samples = np.concatenate([out, *tail])
            _unlink(segment)  # a copy: not the segment's pages
            segment = None
        elif shm_name is None:
            out.resize(end, refcheck=False)
            samples = out
        else:
            samples = out[:end]
        if samples.shape[0] == 0:
            raise _Fallback("nothing decoded")
    except BaseException:
        _unlink(segment)
        raise
    dur = samples.shape[0] / plan.out_rate
    return DecodedAudio(samples=samples, sample_rate=plan.out_rate, duration=dur,
                        source_sample_rate=src.source_rate(plan.in_rate), source_channels=plan.channels,
                        source_format=src.format, warnings=src.warnings(dur), declared_duration=src.declared,
                        resample_cpu_s=resample_s, other_threads_cpu_s=cpu_s,
                        segment=segment)


def _unlink(name: str | None) -> None:
    if name is not None:
        from ..shm import unlink_segment

        unlink_segment(name)


__all__ = ["load_audio_parallel", "default_workers", "default_pool_kind", "MIN_PARALLEL_S"]
