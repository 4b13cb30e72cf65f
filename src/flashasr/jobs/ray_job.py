"""Offline jobs on a Ray cluster: the local job's stages as one Ray Data pipeline.

``flashasr transcribe INPUTS... -o OUT --ray [ADDRESS]`` and :func:`run_ray_job`. The same inputs,
outputs, ``summary.jsonl`` records, resume rules, per-file failures and exit codes as
:func:`flashasr.jobs.run_job`, and the same functions at every step, so the same file gives the
same transcript (text and times) on a laptop and on a cluster::

    driver:  expand_inputs -> resume triage (runner.triage_inputs: summary.jsonl, per-file options)
               |  rows {idx, path, options} of the files to do, one file per block
               v
    CPU tasks (num_cpus=decode_cpus, many per node; Ray Data map_batches):
               feeder.prepare_file: decode + resample (PyAV/soxr) -> pipeline.plan_pieces (ONNX VAD)
               -> one row per piece {idx, piece, start, end, samples float32 [n]} (+ the file's
                  decode/VAD CPU seconds), or one row for a file without pieces (failure / no speech)
               v   (Ray Data's streaming executor: bounded queues, object-store budget = back-pressure)
    model actors (ModelStage; one per GPU, num_gpus=1; the engine built once per actor):
               batches of batch_size pieces of many files; grouped by options.decoding, sorted by
               length, pipeline.transcribe_pieces per group (one bad piece fails alone)
               -> rows {idx, piece, Transcript (pickled) | error}
               v   (driver: ds.iter_batches, in completion order)
    driver:  _Collector routes each piece to its file (batcher.FileState); a file's last piece ->
             finish.Finisher: pipeline.merge_pieces -> render -> atomic write -> summary.jsonl line

* The model's capabilities (its window, rate, speech gate, languages) are needed before any file is
  read: :func:`probe_capabilities` loads the model where the actors will run it (on the driver for
  ``cpu``, in a one-off GPU task for ``cuda``: the GPU engine's window is its largest profile), or
  the caller passes ``capabilities=``.
* Failures: a decode error fails its file (as locally). A task whose worker process dies is
  retried by Ray (3 times); a model actor that dies is restarted and its batch retried (twice).
  A file whose work is still lost after that (a poison file killing every worker) fails alone
  with ``worker_lost``: Ray Data may drop up to ``max(3, files / 100)`` blocks, after which an
  error common to all (workers that cannot import flashasr) fails the rest of the job with
  ``ray_job_failed``. Either way the outputs already written and their journal lines stay.
* Ctrl-C / SIGTERM: the pipeline stops, finished outputs are kept, the journal compacted;
  ``report.interrupted`` (exit 130); the re-run resumes.
* The VAD runs on the CPU in the decode tasks (the local job runs it on the GPU for CUDA jobs:
  the same pieces, ``docs/JOBS.md``).

Inputs must be readable at the same path on every node (shared storage); outputs and the journal
are written by the driver only (``docs/RAY.md``).
"""

from __future__ import annotations

import json
import math
import os
import pickle
import time
import warnings
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from ..errors import InvalidRequestError
from ..options import ModelCapabilities, TranscribeOptions
from .batcher import FileState
from .feeder import DecodeFailure, error_of, prepare_file
from .finish import Finisher
from .inputs import InputItem
from .report import FileResult, JobReport
from .runner import check_job_arguments, collect_inputs, default_batch_size, open_summary, triage_inputs

#: Blocks of input rows at most (files per block grows beyond it): the driver holds one object
#: reference per block.
MAX_INPUT_BLOCKS = 100_000
#: CPUs one decode + VAD task asks for: two tasks per core keep a core busy while the other reads.
DEFAULT_DECODE_CPUS = 0.5
#: Retries of a model actor's batch after the actor died (Ray Data's default is forever: a piece
#: that kills the model would loop).
MODEL_TASK_RETRIES = 2

_EMPTY = np.zeros(0, np.float32)


# ----------------------------------------------------------------------------- capabilities
def probe_capabilities(model: str | None, *, device: str = "cpu", dtype: str | None = None,
                       engine: str = "auto") -> ModelCapabilities:
    """The capabilities of ``model`` as the job's actors will run it (spec as for
    :func:`flashasr.pipeline.load_model`).

    On ``cpu`` the model is loaded here (:func:`flashasr.pipeline.cached_model`); on CUDA in a
    one-off Ray task on a GPU of the cluster (its worker exits afterwards, releasing the GPU), since
    the GPU engine decides the window.

    Raises:
        ModelLoadError / UnsupportedModelError: the model cannot be loaded (there);
            ``invalid_device``: CUDA asked for on a cluster without a GPU.
    """
    if not str(device).startswith("cuda"):
        from ..pipeline import cached_model

        return cached_model(model, device, dtype, engine).capabilities
    import ray

    from ..errors import ModelLoadError

    if not ray.cluster_resources().get("GPU"):  # a GPU task would wait for one forever
        raise ModelLoadError(f"device {device!r}: the Ray cluster has no GPU (ray start --num-gpus=N on the GPU "
                             "nodes), or use --device cpu", code="invalid_device")
    task = ray.remote(num_gpus=1, num_cpus=1, max_calls=1)(_remote_capabilities)
    return ModelCapabilities.from_dict(ray.get(task.remote(model, device, dtype, engine)))


def _remote_capabilities(model, device, dtype, engine) -> dict:
    from ..pipeline import load_model

    return load_model(model, device=device, dtype=dtype, engine=engine).capabilities.to_dict()


# ----------------------------------------------------------------------------- the CPU stage
def prepare_pieces(batch: dict, caps: dict) -> dict:
    """Ray Data CPU stage: each file of ``batch`` (columns ``idx``, ``path``, ``options`` JSON)
    through :func:`flashasr.jobs.feeder.prepare_file` (decode + resample + VAD plan), out as one row
    per piece (``samples`` float32 ``[end - start]``; ``speech`` its VAD speech spans as JSON, ``""``
    when unknown) or one row with ``piece = -1`` for a file without pieces (``error_code`` set: it
    failed; else no speech). The file's CPU seconds ride on its first row; ``t0_wall``:
    ``time.time()`` at the start of its decode; ``warnings``: the decode's damage warnings as JSON
    (``""``: not known)."""
    mc = ModelCapabilities.from_dict(caps)
    cols = _Columns()
    for idx, path, opts in zip(batch["idx"], batch["path"], batch["options"]):
        t0 = time.time()
        got = prepare_file(str(path), TranscribeOptions.from_dict(json.loads(str(opts))), mc)
        if isinstance(got, DecodeFailure):
            cols.add(idx, -1, 0, 0, 0, 0, _EMPTY, error=(got.code, got.message), t0=t0)
            continue
        cost = (got.decode_cpu_s, got.vad_cpu_s, got.wall_s, got.resample_cpu_s)
        n = int(got.samples.size)
        warn = json.dumps(got.warnings) if got.warnings is not None else ""  # the file's damage, on every row
        if not got.pieces:
            cols.add(idx, -1, 0, n, 0, 0, _EMPTY, cost=cost, t0=t0, warnings=warn)
        for k, p in enumerate(got.pieces):
            a, b = p
            speech = getattr(p, "speech", None)
            cols.add(idx, k, len(got.pieces), n, a, b, got.samples[a:b], options=str(opts), cost=cost if k == 0 else None,
                     t0=t0, speech="" if speech is None else json.dumps(speech), warnings=warn)
    return cols.batch()


class _Columns:
    """Rows of the piece table, gathered column by column (what Ray Data's numpy batches hold)."""

    NAMES = ("idx", "piece", "n_pieces", "n_samples", "start", "end", "samples", "options", "error_code",
             "error_message", "decode_cpu_s", "vad_cpu_s", "prepare_wall_s", "resample_cpu_s", "t0_wall",
             "speech", "warnings")

    def __init__(self):
        self.c: dict[str, list] = {k: [] for k in self.NAMES}

    def add(self, idx, piece, n_pieces, n_samples, start, end, samples, *, options="", error=("", ""), cost=None,
            t0=0.0, speech="", warnings=""):
        c = self.c
        for k, v in (("idx", int(idx)), ("piece", piece), ("n_pieces", n_pieces), ("n_samples", n_samples),
                     ("start", int(start)), ("end", int(end)), ("samples", samples), ("options", options),
                     ("error_code", error[0]),
                     ("error_message", error[1]), ("t0_wall", t0), ("speech", speech), ("warnings", warnings)):
            c[k].append(v)
        for k, v in zip(("decode_cpu_s", "vad_cpu_s", "prepare_wall_s", "resample_cpu_s"), cost or (0.0,) * 4):
            c[k].append(float(v))

    def batch(self) -> dict:
        out = {}
        for k, v in self.c.items():
            if k == "samples":  # ragged: an object array of float32 arrays (Ray's variable-shaped tensor column)
                arr = np.empty(len(v), dtype=object)
                arr[:] = v
                out[k] = arr
            elif k in ("options", "error_code", "error_message", "speech", "warnings"):
                out[k] = np.array(v, dtype=object)
            else:
                out[k] = np.array(v, dtype=np.float64 if k.endswith(("_s", "_wall")) else np.int64)
        return out


# ----------------------------------------------------------------------------- the model stage
class ModelStage:
    """Ray Data model actor: one per GPU (or ``actors`` on CPU), the model and its engine built once.

    Args (``fn_constructor_kwargs``): ``model``, ``device``, ``dtype``, ``engine`` as for
    :func:`flashasr.pipeline.load_model`; ``batch_size``: pieces per model call. Each row carries
    its file's options (``options``: the JSON of :meth:`~flashasr.options.TranscribeOptions.to_dict`).

    ``__call__`` takes a batch of piece rows (any files) and returns one row per input row:
    ``result`` (the pickled :class:`~flashasr.types.Transcript`, ``b""`` when none), ``error_code`` /
    ``error_message`` (a piece the model failed on), the file's bookkeeping columns, and per model
    call ``call_pieces`` / ``call_s`` / ``call_cpu_s`` on its first row (0 elsewhere).
    """

    def __init__(self, model, device, dtype, engine, batch_size: int):
        from ..pipeline import load_model

        self.model = load_model(model, device=device, dtype=dtype, engine=engine)
        self.batch_size = int(batch_size)
        self._options: dict[str, TranscribeOptions] = {}
        self.cuda = str(device).startswith("cuda")
        self.pid = os.getpid()

    def __call__(self, batch: dict) -> dict:
        n = len(batch["idx"])
        result = np.empty(n, dtype=object)
        result[:] = [b""] * n
        err_code = np.array(batch["error_code"], dtype=object)
        err_msg = np.array(batch["error_message"], dtype=object)
        calls = {k: np.zeros(n, np.float64) for k in ("call_pieces", "call_s", "call_cpu_s")}
        groups: dict[tuple, list[int]] = {}
        for r in range(n):
            if int(batch["piece"][r]) >= 0:
                groups.setdefault(self.options(batch["options"][r]).decoding, []).append(r)
        for rows in groups.values():
            rows.sort(key=lambda r: int(batch["end"][r]) - int(batch["start"][r]))  # near lengths share a call
            for k in range(0, len(rows), self.batch_size):
                self._call(batch, rows[k:k + self.batch_size], result, err_code, err_msg, calls)
        keep = ("idx", "piece", "n_pieces", "n_samples", "start", "end", "decode_cpu_s", "vad_cpu_s",
                "prepare_wall_s", "resample_cpu_s", "t0_wall", "warnings")
        return {**{k: batch[k] for k in keep}, "result": result, "error_code": err_code, "error_message": err_msg,
                **calls, "actor_pid": np.full(n, self.pid, np.int64)}

    def options(self, text) -> TranscribeOptions:
        """The options of a row (parsed once per distinct JSON)."""
        got = self._options.get(text)
        if got is None:
            got = self._options[text] = TranscribeOptions.from_dict(json.loads(str(text)))
        return got

    def _call(self, batch, rows, result, err_code, err_msg, calls) -> None:
        from ..pipeline import transcribe_pieces

        opts = self.options(batch["options"][rows[0]])
        waves = [np.asarray(batch["samples"][r], dtype=np.float32) for r in rows]
        speech = [json.loads(str(batch["speech"][r])) if batch["speech"][r] else None for r in rows]
        t0, c0 = time.perf_counter(), time.thread_time()
        outs = transcribe_pieces(self.model, waves, opts, speech)
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        calls["call_pieces"][rows[0]] = len(rows)
        calls["call_s"][rows[0]] = time.perf_counter() - t0
        calls["call_cpu_s"][rows[0]] = time.thread_time() - c0
        for r, out in zip(rows, outs):
            if isinstance(out, BaseException):
                code, msg = error_of(out, Path(""))
                err_code[r], err_msg[r] = code, msg
            else:
                result[r] = pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)


# ----------------------------------------------------------------------------- the driver
class _Collector:
    """Routes the model stage's rows to their files and hands each finished file to the
    :class:`~flashasr.jobs.finish.Finisher` (the driver's main thread). A row seen twice (a retried
    task's output) is ignored."""

    def __init__(self, items: list[InputItem], file_opts: list, finisher: Finisher, report: JobReport):
        self.items, self.file_opts, self.finisher, self.report = items, file_opts, finisher, report
        self.states: dict[int, FileState] = {}
        self.seen: set[tuple[int, int]] = set()
        self.done: set[int] = set()
        self.model_s: dict[int, float] = {}  # actor pid -> seconds in model calls
        self.model_cpu_s = 0.0

    def take(self, b: dict) -> None:
        for r in range(len(b["idx"])):
            idx, piece = int(b["idx"][r]), int(b["piece"][r])
            if idx in self.done or (idx, piece) in self.seen:
                continue
            self.seen.add((idx, piece))
            if b["call_pieces"][r] > 0:
                self.report.batch_pieces.append(int(b["call_pieces"][r]))
                pid = int(b["actor_pid"][r])
                self.model_s[pid] = self.model_s.get(pid, 0.0) + float(b["call_s"][r])
                self.model_cpu_s += float(b["call_cpu_s"][r])
            self._account(b, r)
            if piece < 0:
                self._whole(b, r, idx)
            else:
                self._piece(b, r, idx, piece)

    def _account(self, b: dict, r: int) -> None:
        rep = self.report
        rep.decode_cpu_s += float(b["decode_cpu_s"][r])
        rep.vad_cpu_s += float(b["vad_cpu_s"][r])
        rep.prepare_wall_s += float(b["prepare_wall_s"][r])
        rep.stage_cpu_s["resample"] = rep.stage_cpu_s.get("resample", 0.0) + float(b["resample_cpu_s"][r])

    def _state(self, b: dict, r: int, idx: int, n_pieces: int) -> FileState:
        st = self.states.get(idx)
        if st is None:
            t0 = time.perf_counter() - (time.time() - float(b["t0_wall"][r]))  # the decode's start, on this clock
            st = FileState(idx, self.items[idx], self.file_opts[idx], _EMPTY, [None] * n_pieces, t0)
            st.n_samples = int(b["n_samples"][r])
            st.warnings = json.loads(str(b["warnings"][r])) if b["warnings"][r] else None
            self.states[idx] = st
        return st

    def _whole(self, b: dict, r: int, idx: int) -> None:
        """A file without pieces: failed before the model, or without speech (an empty transcript)."""
        code = str(b["error_code"][r] or "")
        self.done.add(idx)
        if code:
            self.finisher.fail(idx, code, str(b["error_message"][r]))
        else:
            self.finisher.finish(self._state(b, r, idx, 0))

    def _piece(self, b: dict, r: int, idx: int, piece: int) -> None:
        st = self._state(b, r, idx, int(b["n_pieces"][r]))
        st.pieces[piece] = (int(b["start"][r]), int(b["end"][r]))
        code = str(b["error_code"][r] or "")
        if code:
            if st.error is None:
                st.error = (code, f"{st.item.display}: model failed: {b['error_message'][r]}")
        else:
            st.results[piece] = pickle.loads(b["result"][r])
        st.remaining -= 1
        if st.remaining == 0:
            del self.states[idx]
            self.done.add(idx)
            self.finisher.finish(st)

    def fail_missing(self, todo: list[int], code: str, why: str) -> None:
        """Every file to do that never came back (its block was lost, or the job stopped)."""
        for idx in todo:
            if idx not in self.done:
                self.done.add(idx)
                self.states.pop(idx, None)
                self.finisher.fail(idx, code, f"{self.items[idx].path}: {why}")


def _dataset(items: list[InputItem], todo: list[int], file_opts: list, caps: ModelCapabilities, *, model, device,
             dtype, engine, batch_size: int, actors: int, actor_cpus: float, decode_cpus: float,
             decode_tasks: int | None, max_buffered_audio_s: float | None, files_per_task: int | None = None):
    """The job's Ray Data pipeline over the files ``todo`` (see the module docstring)."""
    import ray
    import ray.data

    from ..ray_cluster import quiet_ray_data

    quiet_ray_data()
    per_block = int(files_per_task or max(1, math.ceil(len(todo) / MAX_INPUT_BLOCKS)))
    rows = [{"idx": i, "path": str(items[i].path), "options": json.dumps(file_opts[i].to_dict())} for i in todo]
    ds = ray.data.from_items(rows, override_num_blocks=max(1, math.ceil(len(rows) / per_block)))
    extra = {"concurrency": int(decode_tasks)} if decode_tasks else {}
    ds = ds.map_batches(prepare_pieces, batch_size=1, batch_format="numpy", num_cpus=decode_cpus,
                        fn_kwargs={"caps": caps.to_dict()}, **extra)
    gpu = str(device).startswith("cuda")
    with warnings.catch_warnings():  # max_task_retries has no named parameter in Ray 2.60 (pinned)
        warnings.simplefilter("ignore", DeprecationWarning)
        # a dying actor's batch is retried MODEL_TASK_RETRIES times (Ray Data's default: forever)
        ds = ds.map_batches(ModelStage, batch_size=batch_size, batch_format="numpy",
                            compute=ray.data.ActorPoolStrategy(size=actors), num_gpus=1 if gpu else 0,
                            num_cpus=actor_cpus, max_task_retries=MODEL_TASK_RETRIES,
                            fn_constructor_kwargs={"model": model, "device": "cuda" if gpu else device,
                                                   "dtype": dtype, "engine": engine, "batch_size": batch_size})
    ctx = ds.context
    ctx.enable_progress_bars = False
    ctx.max_errored_blocks = max(3, len(todo) // 100)
    if max_buffered_audio_s:
        from ray.data import ExecutionResources

        # float32 at the model rate, x2: a block being built beside the blocks queued
        ctx.execution_options.resource_limits = ExecutionResources(
            object_store_memory=int(2 * 4 * caps.sample_rate * float(max_buffered_audio_s)))
    return ds


def default_actors(device: str, resources: dict) -> int:
    """Model actors: one per GPU of the cluster on CUDA (at least 1), one on CPU."""
    if str(device).startswith("cuda"):
        return max(1, int(resources.get("GPU", 0)))
    return 1


def run_ray_job(
    inputs: Iterable[str | os.PathLike | InputItem],
    model: str | None = None,
    output_dir: str | os.PathLike | None = None,
    fmt: str = "text",
    *,
    address: str | None = None,
    device: str = "cpu",
    dtype: str | None = None,
    engine: str = "auto",
    capabilities: ModelCapabilities | None = None,
    options: TranscribeOptions | None = None,
    batch_size: int | None = None,
    actors: int | None = None,
    actor_cpus: float = 1.0,
    decode_cpus: float = DEFAULT_DECODE_CPUS,
    decode_tasks: int | None = None,
    max_buffered_audio_s: float | None = None,
    files_per_task: int | None = None,
    resume: bool = True,
    progress: bool | None = None,
    on_result: Callable[[FileResult], None] | None = None,
    keep_transcripts: bool = True,
    **changes,
) -> JobReport:
    """Transcribe many inputs on a Ray cluster; the Python API behind ``flashasr transcribe --ray``.

    Args:
        inputs, output_dir, fmt, options, ``**changes``, batch_size, resume, progress, on_result,
            keep_transcripts: as for :func:`flashasr.jobs.run_job` (``batch_size``: pieces per model
            call, default 8 on CPU, 512 on CUDA).
        model: a model spec (:func:`flashasr.pipeline.load_model`: ``tiny.en``, a ``.nemo`` path
            readable on every node, ...), loaded by each model actor; None: tiny.en.
        address: the cluster (:mod:`flashasr.ray_cluster`; None: ``RAY_ADDRESS``, a cluster started
            here with ``ray start``, else a private local instance).
        device, dtype, engine: where and how the actors run the model (``cuda``: one actor per GPU,
            each on its own GPU).
        capabilities: the model's :class:`~flashasr.options.ModelCapabilities` as the actors will
            have them, when known (skips :func:`probe_capabilities`).
        actors: model actors (default :func:`default_actors`); ``actor_cpus``: CPUs each reserves.
        decode_cpus: CPUs each decode + VAD task asks for (fractional: several per core);
            ``decode_tasks``: at most this many at once (None: as many as the CPUs allow).
        max_buffered_audio_s: bounds the pipeline's object-store use to about twice this much
            float32 audio (None: Ray Data's default budget, a share of the object store).
        files_per_task: files one decode task takes in turn (None: 1, more beyond
            :data:`MAX_INPUT_BLOCKS` files); more for many short clips (fewer tasks to schedule).
    Returns:
        :class:`~flashasr.jobs.JobReport` (``cpu_pool`` ``"ray"``; ``model_busy_s`` per actor,
        averaged); ``exit_code`` as the local job's.
    Raises:
        as :func:`~flashasr.jobs.run_job` for bad arguments and options (before anything runs);
        :class:`~flashasr.ray_cluster.RayUnavailableError` when Ray is missing or the cluster
        cannot be joined; the model's load errors from :func:`probe_capabilities`.
    """
    from ..ray_cluster import connect

    t_job, cpu_job = time.perf_counter(), time.process_time()
    opts = TranscribeOptions.build(options, **changes)
    batch_size = check_job_arguments(fmt, batch_size or default_batch_size(device), None, None,
                                  max_buffered_audio_s or 1.0, device)
    _check_ray_arguments(actors, actor_cpus, decode_cpus, decode_tasks, files_per_task)
    resources = connect(address)
    caps = capabilities or probe_capabilities(model, device=device, dtype=dtype, engine=engine)
    opts = opts.resolve(caps)
    items = collect_inputs(inputs)
    out_dir = None if output_dir is None else Path(output_dir)
    summary = open_summary(out_dir, resume)
    todo, file_opts, early = triage_inputs(items, opts, caps, summary if resume else None, fmt)
    n_actors = int(actors) if actors else default_actors(device, resources)
    report = JobReport(device=device, model=caps.name, batch_size=batch_size, cpu_pool="ray",
                       workers=int(decode_tasks or max(1, (resources.get("CPU", 1) - n_actors * actor_cpus)
                                                       // decode_cpus)))
    finisher = Finisher(items, report=report, out_dir=out_dir, fmt=fmt, summary=summary, caps=caps, options=opts,
                        on_result=on_result, keep_transcripts=keep_transcripts)
    collector = _Collector(items, file_opts, finisher, report)
    try:
        finisher.open_progress(progress)
        finisher.start_writer()
        for i, res in early:
            finisher.emit(i, res)
        if todo:
            ds = _dataset(items, todo, file_opts, caps, model=model, device=device, dtype=dtype, engine=engine,
                          batch_size=batch_size, actors=n_actors, actor_cpus=actor_cpus, decode_cpus=decode_cpus,
                          decode_tasks=decode_tasks, max_buffered_audio_s=max_buffered_audio_s,
                          files_per_task=files_per_task)
            _drain(ds, collector, todo)
    except KeyboardInterrupt:
        report.interrupted = True
    finally:
        try:
            finisher.close()
        finally:
            _account(report, collector, finisher, n_actors, t_job, cpu_job)
            if summary is not None:
                try:
                    summary.compact([str(it.path) for it in items])
                except OSError:
                    pass
    return report


def _drain(ds, collector: _Collector, todo: list[int]) -> None:
    """Iterate the pipeline's output into the collector; files that never came back fail alone
    (``worker_lost``), or with the pipeline's error when it stopped (``ray_job_failed``)."""
    try:
        for b in ds.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=2):
            collector.take(b)
    except KeyboardInterrupt:
        raise
    except Exception as e:  # noqa: BLE001 - the cluster's failure: each file still to do is reported
        why = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        collector.fail_missing(todo, "ray_job_failed", f"the Ray pipeline stopped before this file was done ({why})")
        return
    collector.fail_missing(todo, "worker_lost", "lost on the cluster: its task or model call kept failing "
                           "(worker process killed or crashed on every retry)")


def _check_ray_arguments(actors, actor_cpus, decode_cpus, decode_tasks, files_per_task) -> None:
    for name, v, low in (("actors", actors, 1), ("decode_tasks", decode_tasks, 1), ("files_per_task", files_per_task, 1)):
        if v is not None and int(v) < low:
            raise InvalidRequestError(f"{name} must be >= {low}, got {v}", param=name)
    for name, v in (("actor_cpus", actor_cpus), ("decode_cpus", decode_cpus)):
        if not (math.isfinite(float(v)) and float(v) > 0):
            raise InvalidRequestError(f"{name} must be a positive number of CPUs, got {v}", param=name)


def _account(report: JobReport, collector: _Collector, finisher: Finisher, n_actors: int, t_job: float,
             cpu_job: float) -> None:
    """The report's figures (see :class:`~flashasr.jobs.JobReport`; model figures from the actors)."""
    report.results = [r for r in finisher.results if r is not None]
    report.wall_s = time.perf_counter() - t_job
    report.model_busy_s = sum(collector.model_s.values()) / max(1, n_actors)
    report.n_batches = len(report.batch_pieces)
    report.n_pieces = sum(report.batch_pieces)
    report.model_cpu_s = collector.model_cpu_s
    resample = report.stage_cpu_s.get("resample", 0.0)
    report.stage_cpu_s = {"decode": max(0.0, report.decode_cpu_s - resample), "resample": resample,
                          "vad": report.vad_cpu_s, "model": collector.model_cpu_s,
                          "merge_render": finisher.merge_render_cpu_s, "write": finisher.write_cpu_s,
                          "other": max(0.0, time.process_time() - cpu_job - finisher.merge_render_cpu_s
                                       - finisher.write_cpu_s)}


__all__ = ["run_ray_job", "probe_capabilities", "prepare_pieces", "ModelStage", "default_actors",
           "DEFAULT_DECODE_CPUS"]
