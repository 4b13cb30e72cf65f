"""Finishing files: piece results -> one transcript -> output file -> journal line -> callbacks.

For a file whose last piece is done (:class:`~flashasr.jobs.batcher.FileState`)::

    [(offset_s, Transcript)] --pipeline.merge_pieces(parts, N / rate, options=file options,
                                                     warnings=what its decode tolerated)-->
        Transcript (global times, duration, language, translate task, warnings)
        --formats.render(fmt)--> text --atomic_write_text--> <out>/<key>.<ext>
        --> summary.jsonl line (after the output is in place) --> on_result --> progress bar

:class:`Finisher` also emits the results decided without a model call (skipped by resume, failed
decodes, options the model refuses for one file) and holds the job's results in input order.
Its wall time is ``JobReport.finish_s``; the audio of the files it finished ``ok``, counted as each
result is recorded (after its journal line), ``JobReport.audio_s``: the report's totals and results
always agree with the journal. When ``on_result`` raises (an error, a Ctrl-C), the job stops after the
writer's current group: the outputs that group already wrote still get their journal lines and
results (no more ``on_result`` calls), so a re-run skips exactly what is complete on disk.

A damaged input is reported, not hidden: the decode's warnings (``FileState.warnings``) go into the
transcript (``verbose_json`` ``warnings``), the journal line (``warnings``) and the result (the CLI
prints them on stderr). When the decode stage did not hand its warnings over (``None``: a custom
``decode`` that does not say), the file's header is read here (:func:`flashasr.audio.probe`, 0.2-9 ms
a file) and a decode shorter than it declares is reported as truncated.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable


from ..formats import EXTENSIONS, render
from ..options import ModelCapabilities, TranscribeOptions
from ..pipeline import merge_pieces
from .batcher import FileState
from .inputs import InputItem
from .interrupts import join
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
    """Writes each finished input's output and journal line and reports it, in one thread.

    After :meth:`start_writer` that thread is its own (``flashasr-writer``): the conductor hands
    over results with :meth:`emit`, :meth:`fail` and :meth:`finish` and goes on at once, while
    merging, rendering, the atomic writes and the journal lines (fsynced once per group of
    results written together) happen beside the model's work; ``on_result`` and the progress bar
    are then called from that thread, in the order results were handed over. Without
    :meth:`start_writer` everything runs in the caller's thread. :meth:`close` writes everything
    handed over, then returns (re-raising an error of the writer thread).

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
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None
        self.merge_render_cpu_s = 0.0  # merging the pieces and rendering the outputs
        self.write_cpu_s = 0.0  # writing the outputs (all writing threads) and the journal lines
        self._error: BaseException | None = None
        self._callback_failed = False  # on_result raised: no more calls to it, the job is stopping
        self.wake: threading.Event | None = None  # set when the writer thread stops on an error

    # ------------------------------------------------------------------ the writer thread
    def start_writer(self) -> None:
        self._queue = queue.Queue()
        self._pool = ThreadPoolExecutor(max_workers=WRITE_THREADS, thread_name_prefix="flashasr-write")
        self._thread = threading.Thread(target=self._write_loop, name="flashasr-writer", daemon=True)
        self._thread.start()

    def check(self) -> None:
        """Raise the error that stopped the writer thread (an ``on_result`` error or Ctrl-C, an
        unwritable journal), if any: the conductor asks before each turn."""
        if self._error is not None:
            raise self._error

    def _call(self, fn, *args) -> None:
        if self._queue is None:
            fn(*args)
        else:
            if self._error is not None:
                raise self._error
            self._queue.put((fn, args))

    def _write_loop(self) -> None:
        """Groups of what was handed over together: merged and rendered here, the output files
        written by ``WRITE_THREADS`` threads at once (each file's fsync waits for the disk, not
        for the others), then journal lines and callbacks in hand-over order, one fsync for the
        group's journal lines."""
        q = self._queue
        while True:
            group = [q.get()]
            while len(group) < GROUP_MAX and group[-1] is not None:
                try:
                    group.append(q.get_nowait())
                except queue.Empty:
                    break
            last = group[-1] is None
            try:
                self._write_group([g for g in group if g is not None])
                if self.summary is not None:
                    self.summary.sync()  # group commit: one fsync for what was written together
            except BaseException as e:  # noqa: BLE001 - re-raised in the conductor
                self._error = e
                if self.wake is not None:  # the conductor stops at once, starting no other model call
                    self.wake.set()
                break
            if last:
                break
        if self.summary is not None:
            try:
                self.summary.sync()
            except OSError:
                pass

    def _write_group(self, group: list) -> None:
        t0 = time.perf_counter()
        steps = []  # (fn, args) to emit, or a finished file: (None, (st, res, path, text))
        for fn, args in group:
            steps.append((None, self._prepare(args[0])) if fn == self._finish else (fn, args))
        writes = [(k, a[2], a[3]) for k, (fn, a) in enumerate(steps) if fn is None and a[2] is not None]
        done: dict[int, int | OSError] = {}
        jobs = [(p, t) for _k, p, t in writes]
        for (k, _p, _t), (got, cpu_s) in zip(writes, self._pool.map(_write_or_error, jobs) if len(jobs) > 1
                                             else map(_write_or_error, jobs)):
            done[k] = got
            self.write_cpu_s += cpu_s
        self.report.finish_s += time.perf_counter() - t0
        c0 = time.thread_time()
        stop = None
        for k, (fn, args) in enumerate(steps):
            try:
                if fn is not None:
                    fn(*args)
                else:
                    self._complete(*args, done.get(k))
            except BaseException as e:  # noqa: BLE001 - re-raised below
                if stop is not None or not self._callback_failed:
                    raise  # e.g. an unwritable journal: the results after it stay unrecorded (a re-run redoes them)
                # on_result failed (an error, a Ctrl-C): the job stops, but this group's outputs are already
                # complete on disk; their journal lines go first, so that the report and the journal agree
                stop = e
        self.write_cpu_s += time.thread_time() - c0
        if stop is not None:
            raise stop

    def open_progress(self, progress: bool | None) -> None:
        self.bar = progress_bar(len(self.items), progress)

    def close(self) -> None:
        """Write everything handed over, stop the writer thread, close the progress bar.

        Raises:
            the error that stopped the writer thread (an unwritable journal, an ``on_result`` error).
        """
        if self._thread is not None:
            self._queue.put(None)
            join(self._thread)  # in slices: a Ctrl-C meanwhile is noted at once (jobs.interrupts)
            self._thread = None
            self._pool.shutdown(wait=True)
        if self.bar is not None:
            self.bar.close()
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def emit(self, i: int, res: FileResult, output_bytes: int | None = None) -> None:
        """Record input ``i``'s result: journal line (ok/failed), ``on_result``, progress."""
        self._call(self._emit, i, res, output_bytes)

    def _emit(self, i: int, res: FileResult, output_bytes: int | None = None) -> None:
        self.results[i] = res
        if self.summary is not None and res.status in ("ok", "failed"):
            self.summary.append(self._record(res, output_bytes), sync=self._queue is None)
        if res.status == "ok" and res.duration is not None:  # counted once recorded (journal line written)
            self.report.audio_s += res.duration
        if self.on_result is not None and not self._callback_failed:
            try:
                self.on_result(res)
            except BaseException:
                self._callback_failed = True
                raise
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
            "warnings": list(res.warnings or []),
        }

    def fail(self, i: int, code: str, message: str) -> None:
        """Input ``i`` failed before any model call; the message is made to name the input."""
        item = self.items[i]
        msg = message.replace(str(item.path), item.display) if item.display not in message else message
        if not msg.startswith(item.display) and item.display not in msg:
            msg = f"{item.display}: {msg}"
        self.emit(i, FileResult(item=item, status="failed", error_code=code, error_message=msg))  # via the writer

    def finish(self, st: FileState) -> None:
        """A file whose pieces are all done (or that has none): merge, render, write, emit."""
        self._call(self._finish, st)

    def _finish(self, st: FileState) -> None:
        t0 = time.perf_counter()
        st, res, path, text = self._prepare(st)
        got, cpu_s = (None, 0.0) if path is None else _write_or_error((path, text))
        self.write_cpu_s += cpu_s
        self.report.finish_s += time.perf_counter() - t0
        self._complete(st, res, path, text, got)

    def _prepare(self, st: FileState) -> tuple:
        """Merge the file's pieces and render its output: (st, result, output path or None, text)."""
        c0 = time.thread_time()
        try:
            return self._merge_render(st)
        finally:
            self.merge_render_cpu_s += time.thread_time() - c0

    def _merge_render(self, st: FileState) -> tuple:
        dur = st.n_samples / self.sample_rate
        res = FileResult(item=st.item, status="ok", duration=dur, n_pieces=len(st.pieces))
        if st.error is not None:
            res.status, res.error_code, res.error_message = "failed", st.error[0], st.error[1]
            return st, res, None, None
        parts = [(a / self.sample_rate, t) for (a, _b), t in zip(st.pieces, st.results)]
        damage = st.warnings if st.warnings is not None else header_check(st.item.path, dur)
        res.transcript = merge_pieces(parts, dur, options=st.options, caps=self.caps, warnings=damage)
        res.warnings = list(res.transcript.warnings)
        if self.out_dir is None:
            return st, res, None, None
        text = render(res.transcript, self.fmt, words=True if st.options.word_timestamps else None)
        return st, res, self.out_dir / f"{st.item.key}.{EXTENSIONS[self.fmt]}", text

    def _complete(self, st: FileState, res: FileResult, path: Path | None, text: str | None,
                  written: int | OSError | None) -> None:
        """The output is in place (``written`` its bytes) or could not be written (the OSError):
        journal line, callbacks."""
        nbytes = None
        if isinstance(written, OSError):
            res.status, res.error_code = "failed", "output_write_error"
            res.error_message = f"cannot write the output for {st.item.display}: {written.strerror or written}"
        elif written is not None:
            res.output, nbytes = path, written
        res.processing_s = time.perf_counter() - st.t0
        self._emit(st.idx, res, nbytes)


#: Threads writing one group's output files at once (the dev VM's disk: one fsynced write
#: 1.26 ms, four at a time 0.26 ms each).
WRITE_THREADS = 4
#: Results handed over together that are written as one group at most.
GROUP_MAX = 256


def _write_or_error(job: tuple[Path, str]) -> tuple[int | OSError, float]:
    """:func:`atomic_write_text` -> (bytes written, or the OSError: it fails that file only; this
    thread's CPU seconds for it)."""
    c0 = time.thread_time()
    try:
        return atomic_write_text(*job), time.thread_time() - c0
    except OSError as e:
        return e, time.thread_time() - c0


def header_check(path, decoded_s: float) -> list[dict]:
    """A ``damaged_input`` warning when ``path``'s header declares more audio than was decoded
    (:func:`flashasr.audio.decode.truncation`), else nothing."""
    from ..audio.decode import damage_warning, declared_duration, truncation

    declared = declared_duration(path)
    cut = truncation(decoded_s, declared)
    return [damage_warning(cut, decoded_s, declared)] if cut else []


__all__ = ["Finisher", "progress_bar", "header_check"]
