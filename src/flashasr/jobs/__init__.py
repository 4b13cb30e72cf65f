"""Offline batch jobs: many inputs -> decode/VAD in workers -> cross-file batches -> resumable outputs.

Python API::

    from flashasr import load_model
    from flashasr.jobs import run_job
    report = run_job(["talks/", "extra.mp3"], load_model(), "out/", "srt", language="en")
    print(report.table()); raise SystemExit(report.exit_code)

Modules, one role each: :mod:`.inputs` (expanding inputs, output keys), :mod:`.feeder` (the CPU
stage in a worker pool), :mod:`.procpool` (the forked decode worker processes), :mod:`.batcher` (cross-file batches on the model), :mod:`.finish` (merge,
render, write, journal), :mod:`.outputs` (atomic writes, ``summary.jsonl``, resume), :mod:`.report`
(results and accounting), :mod:`.gpumon` (NVML sampling), :mod:`.interrupts` (where a Ctrl-C or
SIGTERM acts during a job) and :mod:`.runner` (:func:`run_job`, the conductor). Segmentation, model calls and merging are the pipeline's (:mod:`flashasr.pipeline`).
See ``docs/JOBS.md`` for the pipeline, output naming and resume rules.
"""

from ..options import SEGMENTATIONS
from .inputs import AUDIO_EXTENSIONS, InputError, InputItem, expand_inputs, read_manifest
from .outputs import SUMMARY_NAME, Summary, atomic_write_text
from .report import FileResult, JobReport
from .runner import default_batch_size, default_cpu_pool, default_workers, run_job, start_decode_pool

__all__ = [
    "run_job", "start_decode_pool", "JobReport", "FileResult", "InputItem", "InputError", "expand_inputs", "read_manifest",
    "Summary", "SUMMARY_NAME", "atomic_write_text", "AUDIO_EXTENSIONS",
    "SEGMENTATIONS", "default_workers", "default_batch_size", "default_cpu_pool",
]
