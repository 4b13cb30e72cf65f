"""Finishing files: piece results -> one transcript -> output file -> journal line -> callbacks.

For a file whose last piece is done (:class:`~flashasr.jobs.batcher.FileState`)::

    [(offset_s, Transcript)] --pipeline.merge_pieces(parts, N / rate, options=file options)-->
        Transcript (global times, duration, language fallback, translate task)
        --formats.render(fmt)--> text --atomic_write_text--> <out>/<key>.<ext>
        --> summary.jsonl line (after the output is in place) --> on_result --> progress bar

:class:`Finisher` also emits the results decided without a model call (skipped by resume, failed
decodes, options the model refuses for one file) and holds the job's results in input order.
Its wall time is ``JobReport.finish_s``; the audio it finished, ``JobReport.audio_s``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

from ..formats import EXTENSIONS, render
from ..options import ModelCapabilities, TranscribeOptions
from ..pipeline import merge_pieces
from .batcher import FileState
from .inputs import InputItem
from .outputs import Summary, atomic_write_text, input_signature
from .report import FileResult, JobReport


def progress_bar(total: int, progress: bool | None):
    """A tqdm bar on stderr (None: only when stderr is a terminal); None when tqdm is missing."""
    try:
        from tqdm import tqdm

        return tqdm(total=total, unit="file", file=sys.stderr, dynamic_ncols=True,
                    disable=(None if progress is None else not progress), desc="transcribe", leave=True)
    except Exception:  # noqa: BLE001 - tqdm missing: no progress bar
        return None


class Finisher:
    """Writes each finished input's output and journal line and reports it (main thread only).

    Args:
        items: the job's inputs; ``results[i]`` is input ``i``'s :class:`FileResult` once emitted.
        report: the job's report (``audio_s``, ``finish_s`` are added to here).
        out_dir: output folder, or None (results only go to ``on_result`` and the report).
        fmt: output format; ``summary``: the folder's journal (None without ``out_dir``).
        caps: the model's capabilities: its name (journal and ``Transcript.model``), its rate (file
            duration = samples / rate), its language when it has only one (the merger's).
        options: the job's resolved options, recorded in every journal line as
            ``options.to_dict()`` (the resume match).
        on_result: called with each :class:`FileResult`; ``keep_transcripts``: keep them in the
            report afterwards.
    """

    def __init__(self, items: list[InputItem], *, report: JobReport, out_dir: Path | None, fmt: str,
                 summary: Summary | None, caps: ModelCapabilities, options: TranscribeOptions,
                 on_result: Callable[[FileResult], None] | None = None, keep_transcripts: bool = True):
        self.items = items
        self.results: list[FileResult | None] = [None] * len(items)
        self.report = report
        self.out_dir, self.fmt, self.summary = out_dir, fmt, summary
        self.caps = caps
        self.model_name = caps.name
        self.options_record = options.to_dict()
        self.sample_rate = caps.sample_rate
        self.on_result = on_result
        self.keep_transcripts = keep_transcripts
        self.bar = None
        self.t_job = time.perf_counter()

    def open_progress(self, progress: bool | None) -> None:
        self.bar = progress_bar(len(self.items), progress)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def emit(self, i: int, res: FileResult, output_bytes: int | None = None) -> None:
        """Record input ``i``'s result: journal line (ok/failed), ``on_result``, progress."""
        self.results[i] = res
        if self.summary is not None and res.status in ("ok", "failed"):
            self.summary.append(self._record(res, output_bytes))
        if self.on_result is not None:
            self.on_result(res)
        if not self.keep_transcripts:
            res.transcript = None
        if self.bar is not None:
            self.bar.update(1)
            el = time.perf_counter() - self.t_job
            audio = self.report.audio_s
            self.bar.set_postfix_str(f"audio {audio / 3600:.3f} h, {(audio / el) if el > 0 else 0:.1f}x",
                                     refresh=False)

    def _record(self, res: FileResult, output_bytes: int | None) -> dict:
        sig = input_signature(res.item.path)
        return {
            "path": str(res.item.path), "key": res.item.key, "status": res.status,
            "duration": None if res.duration is None else round(res.duration, 3),
            "error_code": res.error_code, "error_message": res.error_message,
            "output": None if res.output is None else res.output.relative_to(self.out_dir).as_posix(),
            "output_bytes": output_bytes,
            "processing_s": round(res.processing_s, 3),
            "input_size": sig[0] if sig else None, "input_mtime_ns": sig[1] if sig else None,
            "format": self.fmt, "model": self.model_name, "options": self.options_record,
        }

    def fail(self, i: int, code: str, message: str) -> None:
        """Input ``i`` failed before any model call; the message is made to name the input."""
        item = self.items[i]
        msg = message.replace(str(item.path), item.display) if item.display not in message else message
        if not msg.startswith(item.display) and item.display not in msg:
            msg = f"{item.display}: {msg}"
        self.emit(i, FileResult(item=item, status="failed", error_code=code, error_message=msg))

    def finish(self, st: FileState) -> None:
        """A file whose pieces are all done (or that has none): merge, render, write, emit."""
        t_fin = time.perf_counter()
        dur = st.samples.size / self.sample_rate
        res = FileResult(item=st.item, status="ok", duration=dur, n_pieces=len(st.pieces))
        nbytes = None
        if st.error is not None:
            res.status, res.error_code, res.error_message = "failed", st.error[0], st.error[1]
        else:
            parts = [(a / self.sample_rate, t) for (a, _b), t in zip(st.pieces, st.results)]
            res.transcript = merge_pieces(parts, dur, options=st.options, caps=self.caps)
            self.report.audio_s += dur
            if self.out_dir is not None:
                nbytes = self._write(st, res)
        res.processing_s = time.perf_counter() - st.t0
        st.samples = np.empty(0, np.float32)
        self.emit(st.idx, res, nbytes)
        self.report.finish_s += time.perf_counter() - t_fin

    def _write(self, st: FileState, res: FileResult) -> int | None:
        """Render and write atomically; returns the bytes written (None: ``res`` marked failed)."""
        try:
            text = render(res.transcript, self.fmt, words=True if st.options.word_timestamps else None)
            op = self.out_dir / f"{st.item.key}.{EXTENSIONS[self.fmt]}"
            nbytes = atomic_write_text(op, text)
            res.output = op
            return nbytes
        except OSError as e:
            res.status, res.error_code = "failed", "output_write_error"
            res.error_message = f"cannot write the output for {st.item.display}: {e.strerror or e}"
            return None


__all__ = ["Finisher", "progress_bar"]
