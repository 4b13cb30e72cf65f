"""The offline job runner: many inputs through the one pipeline with one model, cross-file batches.

Pipeline (one job; ``options`` is one resolved :class:`~flashasr.options.TranscribeOptions`)::

    inputs --expand_inputs--> [InputItem]  --resume: summary.jsonl says done--> skipped
      |  per file: options (+ a manifest's language), resolved against model.capabilities
      v
    DecodeFeeder (``workers`` forked processes on CUDA / threads on CPU; feeder.py)
        decode + resample (PyAV/soxr) -> pipeline.plan_pieces -> samples float32 [N], [(start, end)]
      v  (bounded: 2 x workers files in flight, max_buffered_audio_s of decoded audio)
    Batcher (main thread; batcher.py)
        pending pieces of many files, grouped by options.decoding, nearest in length
        --> pipeline.transcribe_pieces(model, waves, options)   (one model call per batch)
      v  a file's last piece done
    Finisher (main thread; finish.py)
        pipeline.merge_pieces (global times) -> render -> atomic write -> summary.jsonl line

:func:`run_job` checks the arguments, wires these together and conducts; this module also holds
the defaults (:func:`default_workers`, :func:`default_batch_size`, :func:`default_cpu_pool`).

* When a batch runs: it is full (``batch_size`` pieces), or nothing more is coming soon (no decode
  in flight or ready and none may start), or the main thread waited ``batch_wait_s`` for a decode
  in vain: the model never idles waiting for a full batch.
* A file completes as soon as its last piece is done (outputs appear in roughly input order, long
  before the job ends). A file without speech gets an empty transcript and no model call.
* Batched results equal per-file results (the model contract of
  :meth:`~flashasr.models.base.ASRModel.transcribe_batch`), and one bad file or piece fails alone.
* Ctrl-C: the job stops starting work, keeps the finished outputs, compacts the journal and
  returns with ``interrupted=True`` (exit code 130). The interrupt is raised only where the
  conductor waits or begins a turn, and a second one is noted, never raised
  (:class:`~flashasr.jobs.interrupts.JobInterrupts`).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterable

from ..errors import FlashASRError, InvalidRequestError
from ..formats import FORMATS
from ..options import ModelCapabilities, TranscribeOptions
from ..pipeline.plan import default_vad_device
from .batcher import Batcher, FileState
from .feeder import DecodeFailure, DecodeFeeder, unblock_sigint
from .finish import Finisher
from .interrupts import JobInterrupts
from .model_worker import ModelWorker
from .planner import Planner
from .inputs import InputItem, expand_inputs
from .outputs import Summary, clean_stale_tmp
from .report import FileResult, JobReport


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
    """Pieces per model call: 8 on CPU (tiny.en on 2 threads, medians of 3 passes: the job over 25
    short clips 9.27 s at 8 against 11.04 s at 1 and 9.09 s at 16; over 3 long recordings 7.75 s
    against 10.42 s and 7.76 s; same text; ``bench/results/whisper_cpu_{short,long}_vm.json``), 512
    on CUDA (the Parakeet GPU engine in memory: 8,232x at 128 pieces per call, 9,550x at 512; the
    job from disk 2,233x and 2,453x; H200, bench/results/offline_e2e_h200_shm.json)."""
    return 512 if str(device).startswith("cuda") else 8


def default_max_buffered_s(batch_size: int) -> float:
    """Decoded audio held before new decodes wait: 30 min, or 4 h (0.9 GB of float32 samples)
    for GPU-sized batches of 64 or more pieces -- a batch of 512 pieces holds about 1.4 h, and one
    is formed while another runs (with 30 min the decoders stalled and the engine got batches of
    ~135 pieces: H200, ``bench/results/offline_e2e_h200_fill.json``)."""
    return 14400.0 if int(batch_size) >= 64 else 1800.0


#: The interpreter's GIL switch interval during a job with decode worker processes (CPython's
#: default is 5 ms): a thread coming back from a system call or a CUDA wait -- the model thread,
#: the decode-result thread, the writers -- waits up to this long for a thread running Python
#: (H200, 3.03 h from disk: 3,400x at 0.5 ms against 2,838x at 5 ms; the null model 5,048x against
#: 4,575x; ``bench/results/offline_e2e_h200_lean.json``).
JOB_SWITCH_INTERVAL_S = 0.0005


def start_decode_pool(device: str = "cpu", workers: int | None = None, cpu_pool: str | None = None,
                      n_inputs: int | None = None):
    """Fork the decode worker processes of :func:`run_job` now, to pass as its ``worker_pool`` (to
    any number of jobs; ``close()`` it at the end), or None when the job would use threads anyway
    (a CPU job; or ``n_inputs`` fewer than the workers: then each file's time ranges are decoded
    by :func:`flashasr.audio.load_audio_parallel`'s processes).

    Call it before loading the model: forking 15 workers from a process that holds a CUDA context
    and a loaded model took 0.9 s on the H200 machine (``bench/results/profile_jobs_h200_lean.json``),
    a few milliseconds from a small process. ``flashasr transcribe`` does so.
    """
    n = int(workers) if workers else default_workers(device)
    if _pool_kind(cpu_pool, device, n, False) != "process" or (n_inputs is not None and n_inputs < n):
        return None
    from .feeder import worker_init
    from .procpool import ForkedWorkers

    return ForkedWorkers(n, init=worker_init)


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


def check_job_arguments(fmt: str, batch_size, workers, cpu_pool, max_buffered_audio_s, device: str) -> int:
    """Check a job's arguments before any work (shared by :func:`run_job` and the Ray job).

    Args:
        fmt: output format (one of ``FORMATS``); batch_size: pieces per model call or None (the
            device's default); workers: decode workers or None; cpu_pool: ``"process"``,
            ``"thread"`` or None; max_buffered_audio_s: seconds of decoded audio held at most, or
            None; device: the model's device (picks the default batch size).
    Returns:
        the batch size to use (int >= 1).
    Raises:
        InvalidRequestError: (``invalid_request``, ``param`` naming the argument) for a bad value.
    """
    import math

    if fmt not in FORMATS:
        raise InvalidRequestError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}", param="fmt")
    if batch_size is None:
        batch_size = default_batch_size(device)
    if int(batch_size) < 1:
        raise InvalidRequestError(f"batch size must be >= 1, got {batch_size}", param="batch_size")
    if cpu_pool not in (None, "thread", "process"):
        raise InvalidRequestError(f"cpu_pool must be 'thread' or 'process', got {cpu_pool!r}", param="cpu_pool")
    if workers is not None and int(workers) < 1:
        raise InvalidRequestError(f"workers must be >= 1 (or None for the default), got {workers}", param="workers")
    if not (math.isfinite(float(max_buffered_audio_s)) and float(max_buffered_audio_s) > 0):
        raise InvalidRequestError(f"max_buffered_audio_s must be positive, got {max_buffered_audio_s}",
                                  param="max_buffered_audio_s")
    return int(batch_size)


def _pool_kind(cpu_pool: str | None, device: str, workers: int, custom_hooks: bool) -> str:
    """Threads with a custom decode/split (not callable by name in a worker process), with one
    worker, or without fork; else ``cpu_pool`` (default :func:`default_cpu_pool`)."""
    if custom_hooks or workers < 2 or not hasattr(os, "fork"):
        return "thread"
    return cpu_pool or default_cpu_pool(device)


def collect_inputs(inputs) -> list[InputItem]:
    """The job's inputs as :class:`InputItem` s, in order: items given as such are kept, paths,
    folders, globs and manifests go through :func:`expand_inputs` (which raises
    :class:`~flashasr.jobs.inputs.InputError`, ``input_not_found`` or ``unreadable_input``)."""
    items: list[InputItem] = []
    raw: list = []
    for x in inputs:
        (items if isinstance(x, InputItem) else raw).append(x)
    if raw:
        items.extend(expand_inputs(raw))
    return items


def open_summary(out_dir: Path | None, resume: bool) -> Summary | None:
    """The output folder's journal (earlier records loaded when resuming); None without a folder."""
    if out_dir is None:
        return None
    out_dir.mkdir(parents=True, exist_ok=True)
    clean_stale_tmp(out_dir)
    summary = Summary(out_dir)
    if resume:
        summary.load()
    return summary


def triage_inputs(items: list[InputItem], opts: TranscribeOptions, caps: ModelCapabilities, summary: Summary | None,
                  fmt: str) -> tuple[list[int], list[TranscribeOptions | None], list[tuple[int, FileResult]]]:
    """Per input: to do (with its file options), or decided now: ``skipped`` (``summary`` records a
    complete output for these job options) or ``failed`` (a manifest language the model refuses).

    Returns (file numbers to do, file options per input, [(file number, result decided now)]).
    """
    todo: list[int] = []
    file_opts: list[TranscribeOptions | None] = [None] * len(items)
    early: list[tuple[int, FileResult]] = []
    record = opts.to_dict()
    for i, it in enumerate(items):
        prev = summary.is_complete(it.path, fmt=fmt, model=caps.name, options=record) if summary else None
        if prev is not None:
            early.append((i, FileResult(item=it, status="skipped", duration=prev.get("duration"),
                                        output=summary.output_dir / prev["output"])))
            continue
        try:  # the job's language wins over a manifest's
            file_opts[i] = opts if opts.language or not it.language else \
                replace(opts, language=it.language).resolve(caps)
        except FlashASRError as e:
            early.append((i, FileResult(item=it, status="failed", error_code=e.code,
                                        error_message=f"{it.display}: {e}")))
            continue
        todo.append(i)
    return todo, file_opts, early


class _Conductor:
    """The main thread's loop: admit decoded files (to the planner thread when the workers only
    decode: the VAD batched on the GPU), hand batches to the model thread, route its results, hand
    finished files to the writer thread; else wait for a decode, a plan or a batch to finish."""

    def __init__(self, items: list[InputItem], file_opts: list, feeder: DecodeFeeder, batcher: Batcher,
                 model: ModelWorker, finisher: Finisher, report: JobReport, batch_wait_s: float, *,
                 options: TranscribeOptions, caps: ModelCapabilities, vad_device: str, split: Callable | None,
                 interrupts: JobInterrupts, min_batch: int | None = None):
        self.items, self.file_opts = items, file_opts
        self.interrupts = interrupts
        self.feeder, self.batcher, self.model, self.finisher = feeder, batcher, model, finisher
        self.report = report
        self.batch_wait_s = batch_wait_s
        self.min_batch = max(1, min(batcher.batch_size, min_batch if min_batch else max(32, batcher.batch_size // 4)))
        self.options, self.caps, self.vad_device, self.split = options, caps, vad_device, split
        self.planner = None if vad_device == "cpu" else Planner(options, caps, vad_device=vad_device, wake=feeder.wake,
                                                                 split=split)
        self.batches: dict[int, list[tuple[int, int]]] = {}  # batch number -> its (file, piece) slots
        self._n = 0
        self._resample_cpu_s = 0.0  # of the workers' decode CPU: soxr
        self._transport_cpu_s = 0.0  # the workers' copies into shared memory
        self.planner_cpu_s = 0.0
        self.last_decode = 0.0  # time.perf_counter() of the last decoded file's arrival (not a failure's)

    def run(self) -> None:
        timed_out = False
        while True:
            self.interrupts.check()  # a Ctrl-C noted since the last turn: stop now
            self.finisher.check()  # on_result raised: stop now (no other batch starts)
            self.feeder.maintain()
            done_now = self.model.take_done()
            for token, outs in done_now:
                for st in self.batcher.complete(self.batches.pop(token), outs):
                    self._finished(st)
            got_now = self.feeder.take_ready()
            self._admit(got_now)
            planned = self.planner.take_done() if self.planner is not None else []
            self._queue(planned)
            self.feeder.refill()
            pending = bool(self.batcher.pending)
            if pending and self.model.has_room() and self._time_for_a_batch(timed_out):
                self._submit()
                timed_out = False
                continue
            if not pending and self.model.idle and self.feeder.exhausted() and not self._planning():
                return
            if got_now or done_now or planned:
                timed_out = False
                continue
            fired = self.interrupts.wait(self.feeder.wait, self.batch_wait_s if pending else 1.0)
            timed_out = pending and not fired

    def _time_for_a_batch(self, timed_out: bool) -> bool:
        """A full batch; or, with the model idle: nothing more coming soon (no decode in flight or
        ready and none may start, nothing being planned), a wait that timed out, or ``min_batch``
        pieces pending (default a quarter batch, at least 32: the GPU starts early and never idles
        while a batch fills; batches of 128 ran the engine at 8,232x, of 512 at 9,550x, H200,
        ``bench/results/offline_e2e_h200_shm.json``). A second batch only queues when full."""
        if self.batcher.full():
            return True
        if not self.model.idle:
            return False
        return ((self.feeder.nothing_coming() and not self._planning()) or timed_out
                or len(self.batcher.pending) >= self.min_batch)

    def _submit(self) -> None:
        self.interrupts.check()  # and once more right before a batch is handed over
        self.finisher.check()
        batch, options, waves = self.batcher.take_batch()
        self._n += 1
        self.batches[self._n] = batch
        self.model.submit(self._n, waves, options)

    def _admit(self, got: list) -> None:
        """Decoded files (and decode failures) in; pieces planned here when the workers did not."""
        states = []
        if any(not isinstance(p, DecodeFailure) for _i, p in got):
            self.last_decode = time.perf_counter()
        for i, p in got:
            if isinstance(p, DecodeFailure):
                self.finisher.fail(i, p.code, p.message)
                continue
            self.report.decode_cpu_s += p.decode_cpu_s
            self.report.vad_cpu_s += p.vad_cpu_s
            self._resample_cpu_s += p.resample_cpu_s
            self._transport_cpu_s += p.transport_cpu_s
            self.report.prepare_wall_s += p.wall_s
            states.append(FileState(i, self.items[i], self.file_opts[i], p.samples, p.pieces, p.t0, p.warnings))
        if self.planner is not None:  # the workers only decoded: the planner thread cuts
            self.planner.submit([st for st in states if st.pieces is None])
        self._queue([st for st in states if st.pieces is not None])

    def _planning(self) -> bool:
        return self.planner is not None and self.planner.in_flight > 0

    def stop(self) -> None:
        if self.planner is not None:
            self.planner.stop()
            self.planner_cpu_s = self.planner.cpu_s
            self.report.vad_cpu_s += self.planner.cpu_s

    def _queue(self, states: list[FileState]) -> None:
        """Planned files: their pieces join the pending pool; a file without any has no speech."""
        for st in states:
            if st.pieces:
                self.batcher.add(st)
            else:  # no speech: an empty transcript, no model call
                self._finished(st)

    def _finished(self, st: FileState) -> None:
        self.feeder.release(st.drop_audio())  # its audio leaves the memory budget now
        self.finisher.finish(st)


def run_job(
    inputs: Iterable[str | os.PathLike | InputItem],
    model,
    output_dir: str | os.PathLike | None = None,
    fmt: str = "text",
    *,
    options: TranscribeOptions | None = None,
    batch_size: int | None = None,
    workers: int | None = None,
    cpu_pool: str | None = None,
    resume: bool = True,
    progress: bool | None = None,
    on_result: Callable[[FileResult], None] | None = None,
    keep_transcripts: bool = True,
    max_buffered_audio_s: float | None = None,
    batch_wait_s: float = 0.05,
    decode_fn: Callable | None = None,
    split_fn: Callable | None = None,
    gpu_monitor: bool | None = None,
    vad_device: str | None = None,
    worker_pool=None,
    min_batch: int | None = None,
    stop: threading.Event | None = None,
    **changes,
) -> JobReport:
    """Transcribe many inputs with one model; the Python API behind ``flashasr transcribe``.

    Args:
        inputs: paths, directories, glob patterns, ``.jsonl`` manifests (see
            :func:`flashasr.jobs.inputs.expand_inputs`) or ready :class:`InputItem` objects.
        model: a loaded :class:`~flashasr.models.base.ASRModel` (asked for its ``capabilities``).
        output_dir: folder for one output per input plus ``summary.jsonl``; None writes
            nothing (results go to ``on_result`` and the report).
        fmt: ``text``, ``json``, ``srt``, ``vtt`` or ``verbose_json``.
        options: :class:`~flashasr.options.TranscribeOptions` for every input (language, task,
            word_timestamps, segmentation, max_segment_s); ``**changes`` are its fields as keywords
            (``language="de"``, ``segmentation="fixed"``, ...), applied on top. Checked against the
            model once, before any input is read. ``language=None`` uses a manifest entry's
            ``language`` (checked per file: one the model cannot take fails that file only).
        batch_size: pieces per model call (>= 1); None: :func:`default_batch_size`.
        workers: decode/VAD workers (default :func:`default_workers`).
        cpu_pool: ``thread`` or ``process`` workers for the CPU stage (default
            :func:`default_cpu_pool`; always threads with a custom ``decode_fn``/``split_fn``).
            Processes return the decoded samples through a pipe (one copy).
        resume: skip inputs whose complete output an earlier run recorded in the summary (same
            input size and mtime, format, model and options).
        progress: tqdm bar on stderr; None shows it only when stderr is a terminal.
        on_result: called with each :class:`FileResult` once its output and journal line are
            written, in the job's writer thread (``flashasr-writer``), in hand-over order. An
            exception it raises stops the job and is re-raised here; a KeyboardInterrupt stops it
            as Ctrl-C does (``interrupted=True``).
        keep_transcripts: keep ``FileResult.transcript`` in the report (False frees memory).
        max_buffered_audio_s: decoded audio (seconds) held before new decodes wait; None:
            :func:`default_max_buffered_s` (it must hold a batch being formed beside the one running).
        batch_wait_s: how long a partial batch waits for more decoded pieces.
        decode_fn: replaces :func:`flashasr.audio.load_audio` (``decode_fn(path, rate)`` returns an
            object with ``.samples``); split_fn: the VAD splitter of
            :func:`flashasr.pipeline.plan_pieces` (``split_fn(samples, rate, max_s, method)``).
            Tests, benchmarks with pre-decoded audio.
        gpu_monitor: sample NVML GPU utilisation in a background thread during the job
            (:class:`~flashasr.jobs.gpumon.NvmlSampler`, result in ``report.nvml``); None: on
            when the model's device is CUDA and ``torch.cuda`` is available.
        vad_device: where the Silero VAD runs: ``"cpu"`` (ONNX, in the decode workers) or a CUDA
            device (one batched PyTorch computation for the files decoded since the last look, in
            the main process; the workers only decode); None: the model's device when it is CUDA,
            else ``"cpu"``. The same pieces either way
            (:func:`flashasr.pipeline.plan_many`).
        min_batch: pieces pending at which an idle model gets a batch before it is full (default a
            quarter of ``batch_size``, at least 32).
        worker_pool: decode worker processes from :func:`start_decode_pool` (forked before the
            model was loaded; kept after the job); None forks ``workers`` processes for this job
            when it uses processes. With a pool, ``workers`` is its size.
        stop: set from any thread, it stops the job as a first Ctrl-C does (``interrupted=True``, the
            finished outputs kept), at the conductor's next turn (within about a second, or when the
            model call running returns).
    Returns:
        :class:`JobReport`; ``report.exit_code`` is non-zero when any input failed.
        On Ctrl-C (SIGINT, or a SIGTERM whose handler raises KeyboardInterrupt) the job stops
        starting work, keeps the finished outputs (never a half-written file) and returns with
        ``interrupted=True``; a second one is noted, not raised, and kills a model process whose
        call keeps the job waiting (its ``kill``). Before the job starts (while the inputs are
        listed and the journal read) a Ctrl-C raises KeyboardInterrupt: nothing was done yet.
    Raises:
        InvalidRequestError (``invalid_request``): bad options, ``fmt``, ``batch_size``, ``workers``,
            ``cpu_pool`` or ``max_buffered_audio_s``; UnsupportedTaskError / UnsupportedLanguageError:
            job options the model cannot honour; :class:`~flashasr.jobs.inputs.InputError`: inputs
            that cannot be expanded. All before any input is decoded.
    """
    t_job, cpu_job = time.perf_counter(), time.process_time()
    opts = TranscribeOptions.build(options, **changes)
    device = str(getattr(model, "device", "cpu"))
    if max_buffered_audio_s is None:
        max_buffered_audio_s = default_max_buffered_s(batch_size or default_batch_size(device))
    batch_size = check_job_arguments(fmt, batch_size, workers, cpu_pool, max_buffered_audio_s, device)
    caps = model.capabilities
    opts = opts.resolve(caps)
    items = collect_inputs(inputs)
    out_dir = None if output_dir is None else Path(output_dir)
    summary = open_summary(out_dir, resume)
    todo, file_opts, early = triage_inputs(items, opts, caps, summary if resume else None, fmt)

    n_workers, kind, decode_workers, worker_pool = _workers_plan(
        workers, cpu_pool, device, len(todo), decode_fn is not None or split_fn is not None, worker_pool)
    report = JobReport(device=device, model=caps.name, batch_size=batch_size, workers=n_workers, cpu_pool=kind)
    vad_device = _vad_device(vad_device, device, split_fn)
    finisher = Finisher(items, report=report, out_dir=out_dir, fmt=fmt, summary=summary, caps=caps, options=opts,
                        on_result=on_result, keep_transcripts=keep_transcripts)
    batcher = Batcher(batch_size)
    model_worker = sampler = conductor = None
    switch = sys.getswitchinterval()
    # from here a Ctrl-C (or a SIGTERM that raises KeyboardInterrupt) is noted and raised only where the
    # conductor waits or begins a turn; a second one gives a model process up (kills it); see JobInterrupts
    with JobInterrupts(report, abandon=getattr(model, "kill", None), stop=stop) as interrupts:
        # forks the worker processes now, before this job starts any thread of its own
        feeder = DecodeFeeder([str(it.path) for it in items], todo, options=opts, caps=caps, workers=report.workers,
                              cpu_pool=report.cpu_pool, max_buffered=int(max_buffered_audio_s * caps.sample_rate),
                              decode=decode_fn, split=split_fn, plan=vad_device == "cpu",
                              decode_workers=decode_workers, pool=worker_pool,
                              keep_shared=bool(getattr(model, "maps_shared_memory", False)))
        finisher.wake = feeder.wake
        try:
            if report.cpu_pool == "process":
                sys.setswitchinterval(JOB_SWITCH_INTERVAL_S)
            finisher.open_progress(progress)
            finisher.start_writer()
            for i, res in early:
                finisher.emit(i, res)
            sampler = _start_gpu_monitor(device, gpu_monitor)
            if sampler is None and gpu_monitor:
                report.nvml = {"available": False,
                               "reason": f"model device is {device!r}, or torch.cuda is unavailable"}
            model_worker = ModelWorker(model, wake=feeder.wake, synchronize_cuda=device.startswith("cuda") and not
                                       getattr(model, "isolates_pieces", False))  # a model process answers when done
            feeder.start()  # a Ctrl-C held back while forking is delivered here (noted; the conductor raises it)
            conductor = _Conductor(items, file_opts, feeder, batcher, model_worker, finisher, report, batch_wait_s,
                                   options=opts, caps=caps, vad_device=vad_device, split=split_fn,
                                   interrupts=interrupts, min_batch=min_batch)
            conductor.run()
        except KeyboardInterrupt:
            report.interrupted = True
            feeder.stop()
        finally:
            # a second Ctrl-C (or SIGTERM) while the job winds down is noted, not raised: the cleanup below
            # always runs to its end (journal, shared memory); it only stops waiting for a model process
            interrupts.hold()
            sys.setswitchinterval(switch)
            unblock_sigint()  # whatever happened before the loop started
            _wind_down(report, conductor, model_worker, feeder, finisher, batcher, sampler, summary, items,
                       t_job, cpu_job)
    return report


def _wind_down(report, conductor, model_worker, feeder, finisher, batcher, sampler, summary, items, t_job,
               cpu_job) -> None:
    """The end of :func:`run_job`, however it ended: threads stopped, outputs written, figures, journal."""
    if conductor is not None:
        conductor.stop()  # the planner thread
    if model_worker is not None:
        model_worker.stop()  # the batch running finishes; nothing more starts
    feeder.shutdown()
    try:
        finisher.close()  # every finished file handed over is written
    except KeyboardInterrupt:  # raised in on_result (the writer thread) after the loop had ended
        report.interrupted = True
    finally:
        _account(report, finisher, batcher, feeder, model_worker, conductor, t_job, cpu_job)
        if sampler is not None:
            report.nvml = sampler.stop()
        if summary is not None:
            try:
                summary.compact([str(it.path) for it in items])
            except OSError:
                pass


def _workers_plan(workers, cpu_pool, device: str, n_files: int, custom_hooks: bool, pool):
    """(workers, pool kind, decode workers per file, the caller's pool to use or None) for a job of
    ``n_files`` files. Fewer files than workers: the spare workers decode each file's time ranges
    (:func:`flashasr.audio.load_audio_parallel`, in processes of its own), the files themselves in
    threads of this process (a worker process may not start processes)."""
    n = int(workers) if workers else default_workers(device)
    kind = _pool_kind(cpu_pool, device, n, custom_hooks)
    decode_workers = n // n_files if 0 < n_files < n else 1
    if decode_workers > 1:
        kind = "thread"
    if kind == "process" and pool is not None and not pool.closed:
        return pool.size, kind, decode_workers, pool
    return max(1, min(n, n_files)), kind, decode_workers, None


def _vad_device(vad_device: str | None, device: str, split_fn) -> str:
    """Where the VAD runs (see :func:`run_job`); with a custom ``split_fn``: in the workers."""
    if split_fn is not None:
        return "cpu"
    if vad_device is None:
        return default_vad_device(device)
    if vad_device != "cpu" and not str(vad_device).startswith("cuda"):
        raise InvalidRequestError(f"vad_device must be 'cpu' or a CUDA device, got {vad_device!r}", param="vad_device")
    return str(vad_device)


def _account(report: JobReport, finisher: Finisher, batcher: Batcher, feeder: DecodeFeeder,
             model_worker: ModelWorker | None, conductor: "_Conductor | None", t_job: float, cpu_job: float) -> None:
    """The final figures of the report (see :class:`JobReport` for each)."""
    report.results = [r for r in finisher.results if r is not None]
    report.wall_s = time.perf_counter() - t_job
    report.cpu_pool = feeder.cpu_pool  # threads, if too many worker deaths pushed the job onto them
    report.model_busy_s = model_worker.busy_s if model_worker is not None else 0.0
    report.batch_pieces = list(batcher.batch_pieces)
    if model_worker is not None:  # the batches the model ran (not one queued and dropped at an interrupt)
        report.model_calls = [[round(t0 - t_job, 4), round(dt, 4), n, round(a, 2)] for t0, dt, n, a in model_worker.calls]
        report.batch_pieces = [n for _t0, _dt, n, _a in model_worker.calls]
        if any(model_worker.timings):
            report.engine_timings = list(model_worker.timings)
    if conductor is not None and conductor.last_decode:
        report.last_decode_s = conductor.last_decode - t_job
    report.n_batches = len(report.batch_pieces)
    report.n_pieces = sum(report.batch_pieces)
    total_cpu = time.process_time() - cpu_job
    # process pool: the main process's CPU time holds no decode/VAD
    in_process = 0.0 if report.cpu_pool == "process" else report.decode_cpu_s + report.vad_cpu_s
    report.model_cpu_s = max(0.0, total_cpu - in_process)
    resample = conductor._resample_cpu_s if conductor is not None else 0.0
    planner = conductor.planner_cpu_s if conductor is not None else 0.0
    model_cpu = model_worker.cpu_s if model_worker is not None else 0.0
    remote = model_worker.remote_cpu_s if model_worker is not None else 0.0  # a model process's own CPU
    report.model_cpu_s += remote
    report.model_process = model_worker.process_info() if model_worker is not None else None
    ms = model_worker.stage_cpu_s if model_worker is not None else {}
    upload, detok = ms.get("features_upload", 0.0), ms.get("detokenize", 0.0)
    st = {"decode": max(0.0, report.decode_cpu_s - resample), "resample": resample, "vad": report.vad_cpu_s,
          "transport": (conductor._transport_cpu_s if conductor is not None else 0.0) + feeder.transport_cpu_s
          + (model_cpu if remote else 0.0),  # with a model process, the model thread here only sends and receives
          "features_upload": upload, "model": max(0.0, (remote or model_cpu) - upload - detok), "detokenize": detok,
          "merge_render": finisher.merge_render_cpu_s, "write": finisher.write_cpu_s}
    main_measured = planner + feeder.transport_cpu_s + model_cpu + finisher.merge_render_cpu_s + finisher.write_cpu_s
    if report.cpu_pool != "process":  # the workers' shared-memory copies run only in processes
        in_process = report.decode_cpu_s + report.vad_cpu_s - planner
    st["other"] = max(0.0, total_cpu - in_process - main_measured)
    report.stage_cpu_s = st


__all__ = ["run_job", "start_decode_pool", "default_batch_size", "default_workers", "default_cpu_pool", "FileResult", "JobReport"]
