"""Offline batch jobs: many inputs -> decode/VAD in threads -> cross-file batches -> resumable outputs.

Python API::

    from flashasr import load_model
    from flashasr.jobs import run_job
    report = run_job(["talks/", "extra.mp3"], load_model(), "out/", "srt")
    print(report.table()); raise SystemExit(report.exit_code)

See ``docs/JOBS.md`` for the pipeline, output naming and resume rules.
"""

from .inputs import AUDIO_EXTENSIONS, InputError, InputItem, expand_inputs, read_manifest
from .merge import merge_transcripts
from .outputs import SUMMARY_NAME, Summary, atomic_write_text
from .runner import SEGMENTATIONS, FileResult, JobReport, default_batch_size, default_workers, run_job

__all__ = [
    "run_job", "JobReport", "FileResult", "InputItem", "InputError", "expand_inputs", "read_manifest",
    "merge_transcripts", "Summary", "SUMMARY_NAME", "atomic_write_text", "AUDIO_EXTENSIONS",
    "SEGMENTATIONS", "default_workers", "default_batch_size",
]
