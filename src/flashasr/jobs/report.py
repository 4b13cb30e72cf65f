"""What a job did: one :class:`FileResult` per input and the :class:`JobReport` of the whole job.

``FileResult`` rows come out of :mod:`.finish` (and :mod:`.runner` for inputs decided before any
work: skipped, or options the model refuses); the report's stage accounting is filled by
:func:`flashasr.jobs.run_job` from the decode feeder (:mod:`.feeder`, CPU seconds of the worker
threads/processes), the batcher (:mod:`.batcher`, model-call wall seconds) and the finisher
(merge + render + write wall seconds). Times in seconds; CPU figures are CPU seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..types import Transcript
from .inputs import InputItem


@dataclass
class FileResult:
    """The outcome for one input.

    ``status``: ``ok`` (transcribed now), ``skipped`` (complete output from an earlier
    run reused) or ``failed``. ``duration`` in audio seconds (None when decoding failed),
    ``processing_s`` wall seconds from the start of its decode to its output,
    ``output`` the written file (None without an output folder), ``transcript`` the
    result (None for skipped/failed), ``error_code``/``error_message`` for failures,
    ``warnings`` the transcript's (:attr:`flashasr.types.Transcript.warnings`: a damaged input,
    a repetition cut), kept when the transcript is not.
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
    warnings: list[dict] | None = None


@dataclass
class JobReport:
    """What a job did. Times in seconds; CPU figures are CPU seconds (all threads).

    Stage accounting (all measured by :func:`run_job`):

    * ``decode_cpu_s`` / ``vad_cpu_s``: per-thread CPU clocks (``time.thread_time``) of the
      worker threads around container decode + downmix + resample to the model rate, and
      around segmentation (:func:`flashasr.pipeline.plan_pieces`: the VAD).
    * ``model_cpu_s``: the rest of the process's CPU time (model calls, merging, rendering,
      writing, bookkeeping).
    * ``model_busy_s``: main-thread wall seconds inside model calls
      (:func:`flashasr.pipeline.transcribe_pieces`, a failing batch's one-by-one retries
      included; on CUDA followed by ``torch.cuda.synchronize()``, so GPU work is included);
      ``model_busy_s / wall_s`` is the model-stage ("GPU busy") fraction.
    * ``finish_s``: main-thread wall seconds merging piece results, rendering and writing
      outputs and summary lines.
    * ``prepare_wall_s``: wall seconds the worker threads spent inside decode + VAD (summed
      over files); against ``workers x wall_s`` it says how occupied the pool was, against the
      CPU seconds how much of that time the threads actually ran (GIL or CPU contention).
    * ``workers``: decode/VAD workers (``cpu_pool``: threads or processes); ``batch_size``: the largest batch asked for;
      ``batch_pieces``: pieces per model call, in call order; ``model_calls``: per model call
      ``[start, seconds, pieces, audio seconds]``, ``start`` in seconds from the job's start (where
      the model waited: before the first call, between calls, after the last); ``engine_timings``:
      per model call the GPU engine's own split of it (``host_prep``, ``encoder_gpu``,
      ``decoder_gpu``, ``wait``, ``total``; :class:`~flashasr.engine.offline.OfflineOutput`), None
      for other models; ``last_decode_s``: seconds
      from the job's start to the arrival of its last decoded file (decode failures not counted).
      Both stay empty / 0 in the Ray job (``run_ray_job``: the model calls run in actors).
    * ``stage_cpu_s``: CPU seconds per stage of the whole path, every process (the
      issue-#12 accounting): ``decode`` (container decode + downmix, workers), ``resample``
      (soxr, workers), ``vad`` (the Silero VAD: workers or the planner thread), ``transport``
      (samples into shared memory in the workers and mapped in the main process), ``features_upload``
      (the model's host-side batch preparation: padding into pinned memory, the copy to the GPU),
      ``model`` (the rest of the model thread: launches, waits, decoding bookkeeping),
      ``detokenize`` (token ids -> text, words, segments and times), ``merge_render`` (pieces ->
      one transcript -> the output format), ``write`` (output files and journal lines), ``other``
      (the rest of the main process: the conductor, the result thread, progress). Keys a model
      does not report (features_upload, detokenize) stay 0 and their time is in ``model``.
    * ``nvml``: :class:`~flashasr.jobs.gpumon.NvmlSampler` result (NVML GPU utilisation over
      the job) on CUDA, else ``{"available": False, "reason": ...}``; None when not asked.
    * ``model_process``: when the model ran in a process of its own
      (:class:`~flashasr.pipeline.model_process.ModelProcess`): its ``pid`` and the samples that
      reached it in this job by mapping the decode workers' segments (``shared_mb``) and by a copy
      (``copied_mb``); else None.
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
    model_calls: list[list[float]] = field(default_factory=list)
    engine_timings: list[dict | None] | None = None
    last_decode_s: float = 0.0
    nvml: dict | None = None
    stage_cpu_s: dict[str, float] = field(default_factory=dict)
    model_process: dict | None = None

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

    STAGES = ("decode", "resample", "vad", "transport", "features_upload", "model", "detokenize", "merge_render",
              "write", "other")
    #: Fewer inputs transcribed in a run, or fewer model calls, and :meth:`bound_by` says ``too_small``.
    MIN_FILES_TO_SAY = 2
    MIN_CALLS_TO_SAY = 2

    def stage_cpu_per_audio_hour(self) -> dict[str, float]:
        """:attr:`stage_cpu_s` per hour of audio, every stage of :attr:`STAGES`, plus ``sum``."""
        h = self.audio_s / 3600.0
        out = {k: (self.stage_cpu_s.get(k, 0.0) / h if h > 0 else 0.0) for k in self.STAGES}
        out["sum"] = sum(out.values())
        return out

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
    def writer_busy_fraction(self) -> float:
        """Merging/rendering/writing wall seconds (the writer thread) / job wall seconds."""
        return min(1.0, self.finish_s / self.wall_s) if self.wall_s > 0 else 0.0

    def bound_by(self) -> str:
        """Which stage bounds throughput, from the fractions above.

        The rule, first match wins:

        1. ``too_small`` -- the report lists its results and this run transcribed fewer than
           :attr:`MIN_FILES_TO_SAY` inputs (ok or failed; skipped ones did no work) or made fewer
           than :attr:`MIN_CALLS_TO_SAY` model calls: its stages ran one after the other (one file is
           decoded whole before its first model call, written after its last), never side by side,
           so no stage bounded a pipeline and the shares say only where the time went (the table
           shows them). A single short clip at 79 % model time is not "bound by input".
        2. ``model`` -- model calls (the model thread) >= 80 % of wall time.
        3. ``cpu_stage`` -- the worker pool >= 80 % occupied or its CPU >= 80 % used.
        4. ``writer`` -- output work (the writer thread) >= 80 %.
        5. ``input`` -- nothing saturated: too little work in flight, I/O, the conductor, or start-up
           and tail.

        A report without results (figures set by hand) skips rule 1.
        """
        if self.results and (len(self.ok) + len(self.failed) < self.MIN_FILES_TO_SAY
                             or self.n_batches < self.MIN_CALLS_TO_SAY):
            return "too_small"
        if self.model_busy_fraction >= 0.8:
            return "model"
        if max(self.cpu_stage_utilisation, self.cpu_pool_busy_fraction) >= 0.8:
            return "cpu_stage"
        if self.writer_busy_fraction >= 0.8:
            return "writer"
        return "input"

    def to_dict(self) -> dict:
        return {
            "files_ok": len(self.ok), "files_skipped": len(self.skipped), "files_failed": len(self.failed),
            "audio_s": round(self.audio_s, 3), "wall_s": round(self.wall_s, 3),
            "speed_factor": round(self.speed_factor, 2),
            "cpu_s_per_audio_hour": {k: round(v, 1) for k, v in self.cpu_per_audio_hour().items()},
            "model_busy_fraction": round(self.model_busy_fraction, 3),
            "gpu_busy_fraction": None if self.gpu_busy_fraction is None else round(self.gpu_busy_fraction, 3),
            "nvml": self.nvml, "model_process": self.model_process,
            "model_busy_s": round(self.model_busy_s, 3), "finish_s": round(self.finish_s, 3),
            "model_calls": self.model_calls, "engine_timings": self.engine_timings, "last_decode_s": round(self.last_decode_s, 4),
            "cpu_s": {"decode": round(self.decode_cpu_s, 3), "vad": round(self.vad_cpu_s, 3),
                      "model": round(self.model_cpu_s, 3)},
            "stage_cpu_s": {k: round(self.stage_cpu_s.get(k, 0.0), 3) for k in self.STAGES},
            "stage_cpu_s_per_audio_hour": {k: round(v, 2) for k, v in self.stage_cpu_per_audio_hour().items()},
            "workers": self.workers, "cpu_pool": self.cpu_pool, "batch_size": self.batch_size,
            "cpu_stage_utilisation": round(self.cpu_stage_utilisation, 3),
            "prepare_wall_s": round(self.prepare_wall_s, 3),
            "cpu_pool_busy_fraction": round(self.cpu_pool_busy_fraction, 3),
            "cpu_stage_cpu_efficiency": round(self.cpu_stage_cpu_efficiency, 3),
            "writer_busy_fraction": round(self.writer_busy_fraction, 3),
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
            f"audio      {self.audio_s:.1f} s ({self.audio_s / 3600:.3f} h) in {_count(self.n_pieces, 'piece')}, "
            f"{_count(self.n_batches, 'batch')}",
            f"wall       {self.wall_s:.2f} s   speed factor {self.speed_factor:.1f}x real time",
            f"CPU s per audio hour   decode {c['decode']:.1f}   vad {c['vad']:.1f}   model+other {c['model']:.1f}",
        ]
        if self.stage_cpu_s and self.audio_s > 0:
            sc = self.stage_cpu_per_audio_hour()
            lines.append("  by stage  " + "  ".join(f"{k.replace('_', ' ')} {sc[k]:.2f}" for k in self.STAGES
                                                     if sc[k] >= 0.005 or k in ("decode", "model"))
                         + f"  (sum {sc['sum']:.2f})")
        if self.workers and self.wall_s > 0:
            pool = _POOL_NAMES.get(self.cpu_pool, ("thread", "threads"))[self.workers != 1]
            lines.append(f"stages     {self.workers} decode {pool} {100 * self.cpu_pool_busy_fraction:.0f} % busy "
                         f"({100 * self.cpu_stage_utilisation:.0f} % on CPU), "
                         f"model calls {100 * self.model_busy_fraction:.0f} % of wall, "
                         f"outputs {100 * self.finish_s / self.wall_s:.0f} %; {self._bound_text()}")
        if self.model_process:
            mp = self.model_process
            lines.append(f"model      in its own process (pid {mp['pid']}): samples mapped {mp['shared_mb']:.0f} MB, "
                         f"copied {mp['copied_mb']:.0f} MB")
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

    def _bound_text(self) -> str:
        """:meth:`bound_by` as the table says it."""
        b = self.bound_by()
        if b != "too_small":
            return f"bound by {b}"
        files = len(self.ok) + len(self.failed)
        return f"bound by: too small to say ({_count(files, 'file')}, {_count(self.n_batches, 'model call')})"


#: How the final table names the decode workers of each ``cpu_pool``.
_POOL_NAMES = {"process": ("process", "processes"), "thread": ("thread", "threads"),
               "ray": ("Ray task slot", "Ray task slots")}


def _count(n: int, word: str) -> str:
    """``1 piece``, ``2 pieces``, ``1 batch``, ``3 batches``."""
    return f"{n} {word}" if n == 1 else f"{n} {word}{'es' if word.endswith(('s', 'ch')) else 's'}"

__all__ = ["FileResult", "JobReport"]
