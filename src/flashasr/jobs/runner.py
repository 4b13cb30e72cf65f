"""The offline job runner: decode -> resample -> VAD in a worker pool, cross-file batches on the model.

Pipeline (one job)::

    inputs --(``workers`` worker processes on CUDA / threads on CPU)--> decode + resample (PyAV/soxr)
           --> VAD segmentation into pieces <= model.max_segment_seconds
           --> pending-piece pool (bounded) --(main thread)--> model.transcribe_batch
           --> results routed back per file --> merge (global times) --> render
           --> atomic output write + summary.jsonl line

* Back-pressure: at most ``prefetch`` files are being decoded at once and new files
  are not started while the decoded-but-unfinished audio exceeds
  ``max_buffered_audio_s``; memory stays bounded whatever the number of inputs. New decodes
  start from the pool's completion callbacks too, so the workers keep going while the main
  thread is inside a model call.
* Worker processes (the CUDA default) avoid the GIL that PyAV's per-frame Python and the VAD
  framing hold; a worker that dies costs the files in flight one retry each, alone, in a fresh
  pool (so a second death names the culprit), never the job.
* Cross-file batching: a batch is the oldest pending piece plus the ``batch_size - 1``
  pending pieces (of any file, same language) closest to it in length, so batches are
  length-homogeneous (little padding) and no file waits behind later ones.
* A file completes as soon as its last piece is done (outputs appear in roughly input
  order, long before the job ends).
* Batched results equal per-file results because every piece is transcribed on its
  own by the model contract of :meth:`ASRModel.transcribe_batch`.
* A file no longer than one piece is sent whole (VAD only decides whether it holds
  speech; without speech it gets an empty transcript and no model call).
"""

from __future__ import annotations

import concurrent.futures as cf
from concurrent.futures.process import BrokenProcessPool
import os
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from ..errors import EmptyAudioError, FlashASRError, check_task
from ..formats import EXTENSIONS, FORMATS, render
from ..types import Transcript
from .inputs import InputItem, expand_inputs
from .merge import merge_transcripts
from .outputs import Summary, atomic_write_text, clean_stale_tmp, input_signature

SEGMENTATIONS = ("vad", "fixed", "none")


@dataclass
class FileResult:
    """The outcome for one input.

    ``status``: ``ok`` (transcribed now), ``skipped`` (complete output from an earlier
    run reused) or ``failed``. ``duration`` in audio seconds (None when decoding failed),
    ``processing_s`` wall seconds from the start of its decode to its output,
    ``output`` the written file (None without an output folder), ``transcript`` the
    result (None for skipped/failed), ``error_code``/``error_message`` for failures.
    """

    item: InputItem
    status: str
    duration: float | None = None
    processing_s: float = 0.0
    output: Path | None = None
    transcript: Transcript | None = None
    error_code: str | None = None
    error_message: str | None = None
    n_pieces: int = 0


@dataclass
class JobReport:
    """What a job did. Times in seconds; CPU figures are CPU seconds (all threads).

    Stage accounting (all measured by :func:`run_job`):

    * ``decode_cpu_s`` / ``vad_cpu_s``: per-thread CPU clocks (``time.thread_time``) of the
      worker threads around container decode + downmix + resample to the model rate, and
      around VAD segmentation.
    * ``model_cpu_s``: the rest of the process's CPU time (model calls, merging, rendering,
      writing, bookkeeping).
    * ``model_busy_s``: main-thread wall seconds inside ``model.transcribe_batch`` calls (on
      CUDA followed by ``torch.cuda.synchronize()``, so GPU work is included);
      ``model_busy_s / wall_s`` is the model-stage ("GPU busy") fraction.
    * ``finish_s``: main-thread wall seconds merging piece results, rendering and writing
      outputs and summary lines.
    * ``prepare_wall_s``: wall seconds the worker threads spent inside decode + VAD (summed
      over files); against ``workers x wall_s`` it says how occupied the pool was, against the
      CPU seconds how much of that time the threads actually ran (GIL or CPU contention).
    * ``workers``: decode/VAD workers (``cpu_pool``: threads or processes); ``batch_size``: the largest batch asked for;
      ``batch_pieces``: pieces per model call, in call order.
    * ``nvml``: :class:`~flashasr.jobs.gpumon.NvmlSampler` result (NVML GPU utilisation over
      the job) on CUDA, else ``{"available": False, "reason": ...}``; None when not asked.
    """

    results: list[FileResult] = field(default_factory=list)
    wall_s: float = 0.0
    audio_s: float = 0.0
    decode_cpu_s: float = 0.0
    vad_cpu_s: float = 0.0
    model_cpu_s: float = 0.0
    model_busy_s: float = 0.0
    finish_s: float = 0.0
    prepare_wall_s: float = 0.0
    n_batches: int = 0
    n_pieces: int = 0
    device: str = "cpu"
    model: str = ""
    interrupted: bool = False
    workers: int = 0
    cpu_pool: str = "thread"
    batch_size: int = 0
    batch_pieces: list[int] = field(default_factory=list)
    nvml: dict | None = None

    @property
    def ok(self) -> list[FileResult]:
        return [r for r in self.results if r.status == "ok"]

    @property
    def failed(self) -> list[FileResult]:
        return [r for r in self.results if r.status == "failed"]

    @property
    def skipped(self) -> list[FileResult]:
        return [r for r in self.results if r.status == "skipped"]

    @property
    def speed_factor(self) -> float:
        """Audio seconds transcribed in this run / wall seconds (RTFx)."""
        return self.audio_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def exit_code(self) -> int:
        """0 all done, 1 some input failed, 130 interrupted."""
        if self.interrupted:
            return 130
        return 1 if self.failed else 0

    def cpu_per_audio_hour(self) -> dict[str, float]:
        """CPU seconds per hour of audio for each stage (decode, vad, model incl. the rest)."""
        h = self.audio_s / 3600.0
        if h <= 0:
            return {"decode": 0.0, "vad": 0.0, "model": 0.0}
        return {"decode": self.decode_cpu_s / h, "vad": self.vad_cpu_s / h, "model": self.model_cpu_s / h}

    @property
    def model_busy_fraction(self) -> float:
        """Fraction of the job's wall time spent inside model calls (0..1)."""
        return min(1.0, self.model_busy_s / self.wall_s) if self.wall_s > 0 else 0.0

    @property
    def gpu_busy_fraction(self) -> float | None:
        """:attr:`model_busy_fraction` when the model runs on CUDA (its calls are synchronised,
        so this is the share of wall time the GPU stage held the pipeline), else None."""
        return self.model_busy_fraction if self.device.startswith("cuda") else None

    @property
    def cpu_stage_utilisation(self) -> float:
        """Decode + VAD CPU seconds / (workers x wall seconds): how much of the worker pool's
        capacity the CPU stage used (near 1: the CPU stage bounds throughput)."""
        cap = self.workers * self.wall_s
        return (self.decode_cpu_s + self.vad_cpu_s) / cap if cap > 0 else 0.0

    @property
    def cpu_pool_busy_fraction(self) -> float:
        """Wall seconds inside decode + VAD (all files) / (workers x wall seconds): how occupied
        the worker pool was, whether its threads ran or waited for the GIL / a core."""
        cap = self.workers * self.wall_s
        return min(1.0, self.prepare_wall_s / cap) if cap > 0 else 0.0

    @property
    def cpu_stage_cpu_efficiency(self) -> float:
        """Decode + VAD CPU seconds / wall seconds inside them (1: the threads ran all the time;
        well below 1: they waited for the GIL or for a core)."""
        return (self.decode_cpu_s + self.vad_cpu_s) / self.prepare_wall_s if self.prepare_wall_s > 0 else 0.0

    @property
    def main_thread_busy_fraction(self) -> float:
        """(model calls + merging/rendering/writing) wall seconds / job wall seconds."""
        return min(1.0, (self.model_busy_s + self.finish_s) / self.wall_s) if self.wall_s > 0 else 0.0

    def bound_by(self) -> str:
        """Which stage bounds throughput, from the fractions above: ``model`` (model calls
        >= 80 % of wall time), ``cpu_stage`` (the worker pool >= 80 % occupied or its CPU
        >= 80 % used), ``main_thread`` (model calls + output work >= 80 %), else ``input``
        (nothing saturated: too little work in flight, I/O, or start-up and tail effects)."""
        if self.model_busy_fraction >= 0.8:
            return "model"
        if max(self.cpu_stage_utilisation, self.cpu_pool_busy_fraction) >= 0.8:
            return "cpu_stage"
        if self.main_thread_busy_fraction >= 0.8:
            return "main_thread"
        return "input"

    def to_dict(self) -> dict:
        return {
            "files_ok": len(self.ok), "files_skipped": len(self.skipped), "files_failed": len(self.failed),
            "audio_s": round(self.audio_s, 3), "wall_s": round(self.wall_s, 3),
            "speed_factor": round(self.speed_factor, 2),
            "cpu_s_per_audio_hour": {k: round(v, 1) for k, v in self.cpu_per_audio_hour().items()},
            "model_busy_fraction": round(self.model_busy_fraction, 3),
            "gpu_busy_fraction": None if self.gpu_busy_fraction is None else round(self.gpu_busy_fraction, 3),
            "nvml": self.nvml,
            "model_busy_s": round(self.model_busy_s, 3), "finish_s": round(self.finish_s, 3),
            "cpu_s": {"decode": round(self.decode_cpu_s, 3), "vad": round(self.vad_cpu_s, 3),
                      "model": round(self.model_cpu_s, 3)},
            "workers": self.workers, "cpu_pool": self.cpu_pool, "batch_size": self.batch_size,
            "cpu_stage_utilisation": round(self.cpu_stage_utilisation, 3),
            "prepare_wall_s": round(self.prepare_wall_s, 3),
            "cpu_pool_busy_fraction": round(self.cpu_pool_busy_fraction, 3),
            "cpu_stage_cpu_efficiency": round(self.cpu_stage_cpu_efficiency, 3),
            "main_thread_busy_fraction": round(self.main_thread_busy_fraction, 3),
            "bound_by": self.bound_by(),
            "batches": self.n_batches, "pieces": self.n_pieces, "device": self.device, "model": self.model,
            "interrupted": self.interrupted,
        }

    def table(self) -> str:
        """The final human summary (several lines, no trailing newline)."""
        c = self.cpu_per_audio_hour()
        lines = [
            f"files      ok {len(self.ok)}   skipped (already done) {len(self.skipped)}   failed {len(self.failed)}"
            + ("   (interrupted)" if self.interrupted else ""),
            f"audio      {self.audio_s:.1f} s ({self.audio_s / 3600:.3f} h) in {self.n_pieces} pieces, "
            f"{self.n_batches} batches",
            f"wall       {self.wall_s:.2f} s   speed factor {self.speed_factor:.1f}x real time",
            f"CPU s per audio hour   decode {c['decode']:.1f}   vad {c['vad']:.1f}   model+other {c['model']:.1f}",
        ]
        if self.workers and self.wall_s > 0:
            lines.append(f"stages     {self.workers} decode {'processes' if self.cpu_pool == 'process' else 'threads'} {100 * self.cpu_pool_busy_fraction:.0f} % busy "
                         f"({100 * self.cpu_stage_utilisation:.0f} % on CPU), "
                         f"model calls {100 * self.model_busy_fraction:.0f} % of wall, "
                         f"outputs {100 * self.finish_s / self.wall_s:.0f} %; bound by {self.bound_by()}")
        if self.device.startswith("cuda") and self.wall_s > 0:
            line = f"GPU busy   {100 * self.model_busy_fraction:.1f} % of wall time (model calls)"
            if self.nvml is not None:
                if self.nvml.get("available"):
                    line += (f"; NVML utilisation mean {self.nvml['mean_util_pct']:.0f} % "
                             f"({self.nvml['samples']} samples)")
                else:
                    line += f"; NVML: {self.nvml.get('reason', 'unavailable')}"
            lines.append(line)
        return "\n".join(lines)


@dataclass
class _Prepared:
    item: InputItem
    samples: np.ndarray
    pieces: list[tuple[int, int]]
    t0: float
    decode_cpu: float
    vad_cpu: float
    wall: float = 0.0


@dataclass
class _FileState:
    idx: int
    item: InputItem
    samples: np.ndarray
    pieces: list[tuple[int, int]]
    t0: float
    results: list
    remaining: int
    language: str | None
    error: tuple[str, str] | None = None


def _error_of(e: BaseException, path: Path) -> tuple[str, str]:
    """(code, message) for a per-file failure."""
    if isinstance(e, FlashASRError):
        return e.code, str(e)
    if isinstance(e, PermissionError):
        return "unreadable_input", f"cannot read {path}: permission denied"
    if isinstance(e, FileNotFoundError):
        return "input_not_found", f"{path}: no such file"
    if isinstance(e, IsADirectoryError):
        return "invalid_input", f"{path} is a directory"
    if isinstance(e, OSError):
        return "unreadable_input", f"cannot read {path}: {e.strerror or e}"
    return "internal_error", f"{type(e).__name__}: {e}"


def _default_decode(path: str, target_rate: int):
    from ..audio import load_audio

    return load_audio(path, target_rate=target_rate)


def _default_split(samples: np.ndarray, sample_rate: int, max_segment_s: float, method: str):
    from ..audio.vad import split_for_asr

    return split_for_asr(samples, sample_rate, max_segment_s=max_segment_s, method=method)


def _prepare_file(path: str, sr: int, seg_max: float, segmentation: str, decode=None, split=None) -> tuple:
    """The CPU stage for one file: decode + resample (+ downmix) and VAD segmentation.

    Runs in a decode thread or, with ``cpu_pool="process"``, in a worker process (then it is
    called by name, with the default decode/split). Returns ``("ok", samples float32 [N],
    pieces [(start, end) samples], t0, decode CPU s, VAD CPU s, wall s)`` or ``("err", code,
    message)`` -- errors travel as plain strings, so any exception type crosses a process
    boundary. ``t0`` is ``time.perf_counter()`` (CLOCK_MONOTONIC: comparable across processes
    on Linux).
    """
    decode = decode or _default_decode
    split = split or _default_split
    t0 = time.perf_counter()
    try:
        c0 = time.thread_time()
        wav = decode(path, sr)
        samples = np.ascontiguousarray(np.asarray(wav.samples, dtype=np.float32).reshape(-1))
        if samples.size == 0:
            raise EmptyAudioError(f"{path}: the file holds no audio samples")
        c1 = time.thread_time()
        if segmentation == "none":
            pieces = [(0, int(samples.size))]
        else:
            pieces = [(int(a), int(b)) for a, b in split(samples, sr, seg_max, segmentation)]
            pieces = [(max(0, a), min(int(samples.size), b)) for a, b in pieces if b > a]
            if pieces and samples.size <= int(seg_max * sr):
                # A file that fits in one window goes in whole (as without segmentation):
                # VAD only decides whether it holds speech at all.
                pieces = [(0, int(samples.size))]
        c2 = time.thread_time()
    except KeyboardInterrupt:
        raise
    except Exception as e:  # noqa: BLE001 - reported per file
        return ("err", *_error_of(e, Path(path)))
    return ("ok", samples, pieces, t0, c1 - c0, c2 - c1, time.perf_counter() - t0)


def _worker_init() -> None:
    """Decode worker process: one thread per library (the pool is the parallelism); Ctrl-C is
    the parent's to handle."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the CLI's handler (a traceback when the pool stops us)
    for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[v] = "1"


def _block_sigint() -> bool:
    """Block SIGINT in this thread (main thread of a Unix process only); True if it did."""
    import signal
    import threading as _th

    if not hasattr(signal, "pthread_sigmask") or _th.current_thread() is not _th.main_thread():
        return False
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    return True


def _unblock_sigint() -> None:
    """Undo :func:`_block_sigint`; a SIGINT that arrived meanwhile is delivered now."""
    import signal
    import threading as _th

    if hasattr(signal, "pthread_sigmask") and _th.current_thread() is _th.main_thread():
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def default_cpu_pool(device: str = "cpu") -> str:
    """``process`` on CUDA (the GPU needs the whole CPU stage of many cores: PyAV's per-frame
    Python and the VAD's framing hold the GIL, so threads of one process stall each other --
    measured on the H200 machine: 15 threads ran on CPUs 16 % of their busy time), ``thread``
    on CPU (the model needs the remaining cores anyway; no start-up or copy cost)."""
    return "process" if str(device).startswith("cuda") else "thread"


def default_workers(device: str = "cpu") -> int:
    """Decode threads: half the cores on CPU (the model needs the rest), else cores - 1 (max 16)."""
    n = os.cpu_count() or 2
    if str(device).startswith("cuda"):
        return max(1, min(16, n - 1))
    return max(1, n // 2)


def default_batch_size(device: str = "cpu") -> int:
    """Pieces per model call: 1 on CPU (measured: batching 8 Whisper windows on 2 CPU threads
    was slower than one by one, 13.0x vs 15.4x, bench/results/whisper_cpu_vm.json), 128 on CUDA
    (the Parakeet GPU engine: 5,201x at 16 pieces per call, 7,423x at 128, 7,865x at 512 on the
    H200, bench/results/offline_e2e_h200.json)."""
    return 128 if str(device).startswith("cuda") else 1


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def _start_gpu_monitor(device: str, want: bool | None):
    """A started :class:`~flashasr.jobs.gpumon.NvmlSampler` for a CUDA job, else None."""
    if want is False or not device.startswith("cuda") or not _cuda_available():
        return None
    from .gpumon import NvmlSampler

    return NvmlSampler(device).start()


def run_job(
    inputs: Iterable[str | os.PathLike | InputItem],
    model,
    output_dir: str | os.PathLike | None = None,
    fmt: str = "text",
    *,
    language: str | None = None,
    word_timestamps: bool = False,
    batch_size: int | None = None,
    segmentation: str = "vad",
    max_segment_s: float | None = None,
    workers: int | None = None,
    resume: bool = True,
    progress: bool | None = None,
    on_result: Callable[[FileResult], None] | None = None,
    keep_transcripts: bool = True,
    max_buffered_audio_s: float = 1800.0,
    batch_wait_s: float = 0.05,
    decode_fn: Callable | None = None,
    split_fn: Callable | None = None,
    gpu_monitor: bool | None = None,
    cpu_pool: str | None = None,
    task: str = "transcribe",
) -> JobReport:
    """Transcribe many inputs with one model; the Python API behind ``flashasr transcribe``.

    Args:
        inputs: paths, directories, glob patterns, ``.jsonl`` manifests (see
            :func:`flashasr.jobs.inputs.expand_inputs`) or ready :class:`InputItem` objects.
        model: a loaded :class:`~flashasr.models.base.ASRModel`.
        output_dir: folder for one output per input plus ``summary.jsonl``; None writes
            nothing (results go to ``on_result`` and the report).
        fmt: ``text``, ``json``, ``srt``, ``vtt`` or ``verbose_json``.
        language: ISO 639-1 code for every input (overrides a manifest's ``language``);
            None uses the manifest's, else the model detects/uses its own.
        word_timestamps: ask the model for word times.
        task: ``"transcribe"`` (default) or ``"translate"`` (English text from speech in any
            language; models with ``translates``, i.e. multilingual Whisper; checked up front,
            :class:`~flashasr.errors.UnsupportedTaskError` otherwise).
        batch_size: pieces per ``model.transcribe_batch`` call (>= 1); None: :func:`default_batch_size`.
        segmentation: ``vad`` (cut at pauses), ``fixed`` (fixed windows) or ``none``
            (whole file in one call; the model handles long audio itself).
        max_segment_s: longest piece in seconds (default and upper bound:
            ``model.max_segment_seconds``).
        workers: decode/VAD workers (default :func:`default_workers`).
        cpu_pool: ``thread`` or ``process`` workers for the CPU stage (default
            :func:`default_cpu_pool`; always threads with a custom ``decode_fn``/``split_fn``).
            Processes return the decoded samples through a pipe (one copy).
        resume: skip inputs whose complete output an earlier run recorded in the summary.
        progress: tqdm bar on stderr; None shows it only when stderr is a terminal.
        on_result: called in the main thread with each :class:`FileResult` as it finishes.
        keep_transcripts: keep ``FileResult.transcript`` in the report (False frees memory).
        max_buffered_audio_s: decoded audio (seconds) held before new decodes wait.
        batch_wait_s: how long a partial batch waits for more decoded pieces.
        decode_fn, split_fn: replace :func:`flashasr.audio.load_audio` /
            :func:`flashasr.audio.vad.split_for_asr` (tests, benchmarks with pre-decoded audio).
        gpu_monitor: sample NVML GPU utilisation in a background thread during the job
            (:class:`~flashasr.jobs.gpumon.NvmlSampler`, result in ``report.nvml``); None: on
            when the model's device is CUDA and ``torch.cuda`` is available.
    Returns:
        :class:`JobReport`; ``report.exit_code`` is non-zero when any input failed.
        On KeyboardInterrupt the job stops starting work, keeps the finished outputs
        (never a half-written file) and returns with ``interrupted=True``.
    Raises:
        FlashASRError: bad ``fmt``/``segmentation``/``batch_size`` (code ``invalid_request``)
            or inputs that cannot be expanded (:class:`~flashasr.jobs.inputs.InputError`).
    """
    if fmt not in FORMATS:
        raise FlashASRError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}", code="invalid_request")
    if segmentation not in SEGMENTATIONS:
        raise FlashASRError(f"unknown segmentation {segmentation!r}; choose one of {', '.join(SEGMENTATIONS)}",
                            code="invalid_request")
    if batch_size is None:
        batch_size = default_batch_size(str(getattr(model, "device", "cpu")))
    if int(batch_size) < 1:
        raise FlashASRError(f"batch size must be >= 1, got {batch_size}", code="invalid_request")
    batch_size = int(batch_size)
    import math

    if max_segment_s is not None and not (math.isfinite(float(max_segment_s)) and float(max_segment_s) > 0):
        raise FlashASRError(f"max_segment_s must be a positive number of seconds, got {max_segment_s}",
                            code="invalid_request")
    if cpu_pool not in (None, "thread", "process"):
        raise FlashASRError(f"cpu_pool must be 'thread' or 'process', got {cpu_pool!r}", code="invalid_request")
    if workers is not None and int(workers) < 1:
        raise FlashASRError(f"workers must be >= 1 (or None for the default), got {workers}", code="invalid_request")
    if not (math.isfinite(float(max_buffered_audio_s)) and float(max_buffered_audio_s) > 0):
        raise FlashASRError(f"max_buffered_audio_s must be positive, got {max_buffered_audio_s}",
                            code="invalid_request")

    t_job = time.perf_counter()
    cpu_job = time.process_time()
    items: list[InputItem] = []
    raw: list = []
    for x in inputs:
        (items if isinstance(x, InputItem) else raw).append(x)
    if raw:
        items.extend(expand_inputs(raw))

    sr = int(getattr(model, "sample_rate", 16000))
    model_max = float(getattr(model, "max_segment_seconds", 30.0) or 30.0)
    seg_max = model_max if max_segment_s is None else min(float(max_segment_s), model_max)
    device = str(getattr(model, "device", "cpu"))
    model_name = str(getattr(model, "name", type(model).__name__))
    check_task(task, translates=bool(getattr(model, "translates", False)), model=model_name,
               family=getattr(model, "family", None))
    task_kw = {"task": task} if task != "transcribe" else {}  # models without a task argument still work
    options = {"language": language, "word_timestamps": bool(word_timestamps), "segmentation": segmentation,
               "max_segment_s": seg_max, **task_kw}
    decode = decode_fn or _default_decode
    split = split_fn or _default_split
    n_workers = int(workers) if workers else default_workers(device)
    prefetch = max(2, 2 * n_workers)
    max_buffered = int(max_buffered_audio_s * sr)

    report = JobReport(device=device, model=model_name, workers=n_workers, batch_size=batch_size)
    out_dir = Path(output_dir) if output_dir is not None else None
    summary = None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        clean_stale_tmp(out_dir)
        summary = Summary(out_dir)
        if resume:
            summary.load()
        else:
            summary.previous = {}

    results: list[FileResult | None] = [None] * len(items)
    todo: deque[int] = deque()
    for i, it in enumerate(items):
        prev = summary.is_complete(it.path, fmt=fmt, model=model_name, options=options) if (summary and resume) else None
        if prev is not None:
            results[i] = FileResult(item=it, status="skipped", duration=prev.get("duration"),
                                    output=out_dir / prev["output"])
        else:
            todo.append(i)

    if cpu_pool is None:
        cpu_pool = default_cpu_pool(device)
    if cpu_pool not in ("thread", "process"):
        raise FlashASRError(f"cpu_pool must be 'thread' or 'process', got {cpu_pool!r}", code="invalid_request")
    if decode_fn is not None or split_fn is not None or n_workers < 2 or not hasattr(os, "fork"):
        cpu_pool = "thread"
    report.cpu_pool = cpu_pool
    n_workers = max(1, min(n_workers, len(todo)))  # no more workers than files to decode

    def _new_pool():
        if cpu_pool == "process":
            import multiprocessing as mp

            # fork (as PyTorch's DataLoader does with a CUDA parent: the workers never touch CUDA),
            # started now, before this job starts any thread of its own; spawn would re-import the
            # caller's main module, which breaks scripts without an ``if __name__ == "__main__"`` guard
            # Ctrl-C held back while forking (a SIGINT landing inside fork's lock hooks was swallowed
            # and the job ran on); a pending one is raised when the main loop unblocks it
            masked = _block_sigint()
            try:
                p = cf.ProcessPoolExecutor(max_workers=n_workers, mp_context=mp.get_context("fork"),
                                           initializer=_worker_init)
                p.submit(int).result()  # fork every worker now
            except BaseException:
                if masked:
                    _unblock_sigint()
                raise
            if masked and in_loop[0]:  # the first pool is unblocked at the top of the main loop's try
                _unblock_sigint()
            return p
        return cf.ThreadPoolExecutor(max_workers=n_workers, thread_name_prefix="flashasr-decode")

    in_loop = [False]
    pool = _new_pool()
    report.workers = n_workers

    bar = None
    try:
        from tqdm import tqdm

        bar = tqdm(total=len(items), unit="file", file=sys.stderr, dynamic_ncols=True,
                   disable=(None if progress is None else not progress), desc="transcribe", leave=True)
    except Exception:  # tqdm missing: no progress bar
        bar = None

    def _emit(i: int, res: FileResult) -> None:
        results[i] = res
        if summary is not None and res.status in ("ok", "failed"):
            sig = input_signature(res.item.path)
            summary.append({
                "path": str(res.item.path), "key": res.item.key, "status": res.status,
                "duration": None if res.duration is None else round(res.duration, 3),
                "error_code": res.error_code, "error_message": res.error_message,
                "output": None if res.output is None else res.output.relative_to(out_dir).as_posix(),
                "output_bytes": getattr(res, "_bytes", None),
                "processing_s": round(res.processing_s, 3),
                "input_size": sig[0] if sig else None, "input_mtime_ns": sig[1] if sig else None,
                "format": fmt, "model": model_name, "options": options,
            })
        if on_result is not None:
            on_result(res)
        if not keep_transcripts:
            res.transcript = None
        if bar is not None:
            bar.update(1)
            el = time.perf_counter() - t_job
            bar.set_postfix_str(f"audio {report.audio_s / 3600:.3f} h, "
                                f"{(report.audio_s / el) if el > 0 else 0:.1f}x", refresh=False)

    for i, r in enumerate(results):
        if r is not None:
            _emit(i, r)

    def _submit(i: int) -> cf.Future:
        if cpu_pool == "process":
            return pool.submit(_prepare_file, str(items[i].path), sr, seg_max, segmentation)
        return pool.submit(_prepare_file, str(items[i].path), sr, seg_max, segmentation, decode, split)

    def _finish(st: _FileState) -> None:
        t_fin = time.perf_counter()
        dur = st.samples.size / sr
        res = FileResult(item=st.item, status="ok", duration=dur, n_pieces=len(st.pieces))
        if st.error is not None:
            res.status, res.error_code, res.error_message = "failed", st.error[0], st.error[1]
        else:
            parts = [(a / sr, t) for (a, _b), t in zip(st.pieces, st.results)]
            tr = merge_transcripts(parts, dur, language=None, model=model_name, word_timestamps=word_timestamps)
            if tr.language is None:
                tr.language = st.language
            if task == "translate":
                tr.language, tr.task = "en", "translate"
            res.transcript = tr
            report.audio_s += dur
            if out_dir is not None:
                try:
                    text = render(tr, fmt, words=True if word_timestamps else None)
                    op = out_dir / f"{st.item.key}.{EXTENSIONS[fmt]}"
                    res._bytes = atomic_write_text(op, text)  # type: ignore[attr-defined]
                    res.output = op
                except OSError as e:
                    res.status, res.error_code = "failed", "output_write_error"
                    res.error_message = f"cannot write the output for {st.item.display}: {e.strerror or e}"
        res.processing_s = time.perf_counter() - st.t0
        st.samples = np.empty(0, np.float32)
        _emit(st.idx, res)
        report.finish_s += time.perf_counter() - t_fin

    sampler = _start_gpu_monitor(device, gpu_monitor)
    if sampler is None and gpu_monitor:
        report.nvml = {"available": False, "reason": f"model device is {device!r}, or torch.cuda is unavailable"}

    futures: dict[cf.Future, int] = {}
    active: dict[int, _FileState] = {}
    pending: list[tuple[int, int]] = []  # (file idx, piece idx), arrival order
    buffered = 0

    def _run_batch(batch: list[tuple[int, int]], lang: str | None) -> None:
        nonlocal buffered
        waves = []
        for fi, pi in batch:
            st = active[fi]
            a, b = st.pieces[pi]
            waves.append(st.samples[a:b])
        t0 = time.perf_counter()
        outs: list = [None] * len(batch)
        errs: list = [None] * len(batch)
        try:
            got = model.transcribe_batch(waves, language=lang, word_timestamps=word_timestamps, **task_kw)
            if len(got) != len(waves):
                raise RuntimeError(f"transcribe_batch returned {len(got)} results for {len(waves)} inputs")
            outs = list(got)
        except KeyboardInterrupt:
            raise
        except Exception as e:
            if len(batch) == 1:
                errs[0] = e
            else:  # isolate the failing piece(s): redo one by one
                for k, w in enumerate(waves):
                    try:
                        outs[k] = model.transcribe_batch([w], language=lang, word_timestamps=word_timestamps,
                                                         **task_kw)[0]
                    except KeyboardInterrupt:
                        raise
                    except Exception as e1:
                        errs[k] = e1
        if device.startswith("cuda"):
            try:
                import torch

                torch.cuda.synchronize()
            except Exception:
                pass
        report.model_busy_s += time.perf_counter() - t0
        report.n_batches += 1
        report.n_pieces += len(batch)
        report.batch_pieces.append(len(batch))
        for (fi, pi), out, err in zip(batch, outs, errs):
            st = active[fi]
            if err is not None and st.error is None:
                code, msg = _error_of(err, st.item.path)
                st.error = (code, f"{st.item.display}: model failed: {msg}")
            st.results[pi] = out
            st.remaining -= 1
            if st.remaining == 0:
                with lock:
                    buffered -= st.samples.size
                    del active[fi]
                _finish(st)

    def _take_batch() -> tuple[list[tuple[int, int]], str | None]:
        head = pending[0]
        lang = active[head[0]].language
        a, b = active[head[0]].pieces[head[1]]
        hl = b - a
        cands = []
        for k, (fi, pi) in enumerate(pending[1:], start=1):
            st = active[fi]
            if st.language != lang:
                continue
            a2, b2 = st.pieces[pi]
            cands.append((abs((b2 - a2) - hl), k))
        cands.sort()
        chosen = [0] + [k for _, k in cands[: batch_size - 1]]
        chosen_set = set(chosen)
        batch = [pending[k] for k in sorted(chosen)]
        pending[:] = [p for k, p in enumerate(pending) if k not in chosen_set]
        return batch, lang

    # The feeder: decodes are started from the pool's completion callbacks as well as from the
    # main thread, so the workers keep decoding while the main thread is inside a model call
    # (with a main-thread-only feeder they drained the 2 x workers files in flight and idled:
    # measured on the H200 machine, pool 48 % busy, GPU 42 %). Memory stays bounded: decoded
    # audio counts against max_buffered_audio_s from the moment its decode finishes.
    lock = threading.RLock()
    wake = threading.Event()
    ready: deque = deque()  # (file idx, _prepare_file result) decoded, not yet taken by the main thread
    feeding = threading.local()
    state = {"stopping": False, "broken": False, "restarts": 0, "culprits": 0}
    # files in flight when a decode worker process died: each gets one more try ALONE in the
    # fresh pool (nothing else in flight), so a second death names the culprit and never an
    # innocent file that happened to share the pool with it
    suspects: deque = deque()
    solo: set[int] = set()

    def _room() -> bool:  # callers hold the lock
        if state["stopping"] or state["broken"]:
            return False
        if solo:
            return False  # a suspect is decoding: alone, so that a death names it
        if suspects:
            return not futures  # the next suspect starts once nothing else is in flight
        return (bool(todo) and len(futures) < prefetch
                and (buffered < max_buffered or (not active and not ready)))

    def _on_done(f: cf.Future) -> None:
        nonlocal buffered
        with lock:
            i = futures.pop(f, None)
            if i is None:
                return
            try:
                got = f.result()
            except BrokenProcessPool:
                # a worker process died (killed, out of memory, a crash in a native library): every
                # file in flight fails with this, innocent or not. Each gets one more try, alone, in
                # a fresh pool; a file whose worker dies again while it decodes alone is reported.
                state["broken"] = True
                if i not in solo and not state["stopping"]:
                    suspects.append(i)
                    wake.set()
                    return
                solo.discard(i)
                state["culprits"] += 1
                got = ("err", "decode_worker_died", f"{items[i].path}: the decode worker process died "
                                                    "while decoding this file (twice, the second time with "
                                                    "no other file in flight); it was killed or crashed")
            except BaseException as e:  # noqa: BLE001 - a cancelled decode, ...
                got = ("err", *_error_of(e, items[i].path))
            solo.discard(i)
            ready.append((i, got))
            if got[0] == "ok":
                buffered += got[1].size
        wake.set()
        _refill()

    def _refill() -> None:
        if getattr(feeding, "busy", False):  # a decode finished inside our own submit: the loop goes on
            return
        feeding.busy = True
        try:
            with lock:
                while _room():
                    suspect = bool(suspects)
                    i = suspects.popleft() if suspect else todo.popleft()
                    try:
                        f = _submit(i)
                    except BrokenProcessPool:  # replaced by the main thread (_replace_pool)
                        (suspects if suspect else todo).appendleft(i)
                        state["broken"] = True
                        wake.set()
                        break
                    except Exception as e:  # noqa: BLE001
                        ready.append((i, ("err", *_error_of(e, items[i].path))))
                        wake.set()
                        continue
                    futures[f] = i
                    if suspect:
                        solo.add(i)
                    f.add_done_callback(_on_done)
        finally:
            feeding.busy = False

    def _replace_pool() -> None:
        """After a worker process died: kill the broken pool's processes (a survivor would block
        forever on its result pipe), then a fresh pool (threads after more than 3 deaths that no
        culprit file explains)."""
        nonlocal pool, cpu_pool
        with lock:
            if not state["broken"] or futures:
                return  # wait until every future of the broken pool has reported
            old = pool
            for proc in list(getattr(old, "_processes", {}).values() or []):
                try:
                    proc.kill()
                except Exception:  # noqa: BLE001 - already gone
                    pass
            old.shutdown(wait=False, cancel_futures=True)
            state["restarts"] += 1
            # each file found to kill its worker explains up to two pool deaths; more than 3
            # unexplained deaths (an OOM killer, a broken environment) -> decode threads instead
            if state["restarts"] - 2 * state["culprits"] > 3:
                cpu_pool = report.cpu_pool = "thread"
            pool = _new_pool()
            state["broken"] = False

    try:
        in_loop[0] = True
        _unblock_sigint()  # a Ctrl-C during the first fork is raised here, inside the try
        _refill()
        timed_out = False
        while True:
            if state["broken"]:
                _replace_pool()
                _refill()
            with lock:
                got_now = list(ready)
                ready.clear()
            for i, got in got_now:
                item = items[i]
                if got[0] == "err":
                    code, msg = got[1], got[2]
                    msg = msg.replace(str(item.path), item.display) if item.display not in msg else msg
                    if not msg.startswith(item.display) and item.display not in msg:
                        msg = f"{item.display}: {msg}"
                    _emit(i, FileResult(item=item, status="failed", error_code=code, error_message=msg))
                    continue
                prep = _Prepared(item, *got[1:])
                report.decode_cpu_s += prep.decode_cpu
                report.vad_cpu_s += prep.vad_cpu
                report.prepare_wall_s += prep.wall
                st = _FileState(idx=i, item=item, samples=prep.samples, pieces=prep.pieces, t0=prep.t0,
                                results=[None] * len(prep.pieces), remaining=len(prep.pieces),
                                language=language or item.language)
                if not prep.pieces:  # no speech found: an empty transcript
                    with lock:
                        buffered -= st.samples.size
                    _finish(st)
                    continue
                active[i] = st
                pending.extend((i, k) for k in range(len(prep.pieces)))
            _refill()
            with lock:
                in_flight = bool(futures) or bool(ready)
                can_start = _room()
            # run a batch when full, or when nothing more is coming soon: no decode in flight and
            # none that may start (inputs exhausted or the memory budget full), or a wait that
            # timed out with nothing decoded (the decoders lag: don't idle)
            if pending and (len(pending) >= batch_size or (not in_flight and not can_start) or timed_out):
                batch, lang = _take_batch()
                _run_batch(batch, lang)
                timed_out = False
                _refill()  # finished files freed memory
                continue
            if not pending and not in_flight and not todo and not suspects and not state["broken"]:
                break
            if got_now:
                timed_out = False
                continue
            wake.clear()
            with lock:
                nothing = not ready
            if nothing:
                fired = wake.wait(timeout=batch_wait_s if pending else 1.0)
                timed_out = bool(pending) and not fired
    except KeyboardInterrupt:
        report.interrupted = True
        with lock:
            state["stopping"] = True
            for f in list(futures):
                f.cancel()
    finally:
        _unblock_sigint()  # whatever happened before the loop started
        pool.shutdown(wait=True, cancel_futures=True)
        if bar is not None:
            bar.close()
        report.results = [r for r in results if r is not None]
        report.wall_s = time.perf_counter() - t_job
        total_cpu = time.process_time() - cpu_job
        # process pool: the main process's CPU time holds no decode/VAD
        report.model_cpu_s = max(0.0, total_cpu - (0.0 if cpu_pool == "process" else
                                                   report.decode_cpu_s + report.vad_cpu_s))
        if sampler is not None:
            report.nvml = sampler.stop()
        if summary is not None:
            try:
                summary.compact([str(it.path) for it in items])
            except OSError:
                pass
    return report
