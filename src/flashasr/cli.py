"""The ``flashasr`` command line: ``transcribe``, ``eval`` and ``serve``.

Exit codes: 0 success; 1 at least one input failed (the others still finished);
2 bad usage, no inputs or a model that cannot be loaded; 130 interrupted (Ctrl-C or
SIGTERM; finished outputs are kept, no output file is ever half-written).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from . import __version__
from .errors import FlashASRError, UsageParser, print_error
from .formats import FORMATS

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a command-line tool whose reader went away exits with
RAY_DEFAULT = "default"  # `--ray` without an address: ray.init's own choice (RAY_ADDRESS, a local cluster, a new one)


def _err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _positive_int(s: str) -> int:
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


_positive_int.__name__ = "positive integer"  # argparse names the type in "invalid ... value"


def _positive_float(s: str) -> float:
    v = float(s)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {v}")
    return v


_positive_float.__name__ = "positive number"


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="model: tiny.en (default, embedded), base (whisper base multilingual), a CTranslate2/"
                        "Hugging Face Whisper folder, a Whisper .pt, a Parakeet .nemo, a hub id in the Hugging Face "
                        "cache (nvidia/parakeet-..., openai/whisper-...), or random:NAME|PATH (Parakeet with random "
                        "weights shaped by a NeMo YAML, for benchmarks); `flashasr models` lists what loads here")
    p.add_argument("--device", default="cpu", help="torch device: cpu (default), cuda, cuda:1, ...")
    p.add_argument("--engine", choices=("auto", "plain"), default="auto",
                   help="auto (default): the GPU engine for the model on CUDA (Parakeet: encoder profiles + "
                        "graph decoder; Whisper: static-cache graph decoder); plain: plain PyTorch")
    p.add_argument("--language", default=None,
                   help="ISO 639-1 code, any case, or an English language name (default: the manifest's "
                        "language, else detected / the model's)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``flashasr`` command (``transcribe``, ``eval``, ``serve``)."""
    parser = UsageParser(prog="flashasr", description="Fast speech-to-text (Whisper, Parakeet-TDT).")
    parser.add_argument("--version", action="version", version=f"flashasr {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{transcribe,eval,models,serve}")

    t = sub.add_parser("transcribe", help="transcribe files, folders, glob patterns or manifests",
                       description="Transcribe audio. INPUT: files, folders (recursive, audio extensions), "
                                   "glob patterns, or .jsonl manifests with audio_filepath/path.")
    t.add_argument("inputs", nargs="+", metavar="INPUT")
    _add_model_args(t)
    t.add_argument("--format", "-f", default="text", choices=FORMATS, help="output format (default: text)")
    t.add_argument("--output-dir", "-o", default=None,
                   help="write one output per input (relative folders mirrored) plus summary.jsonl here; "
                        "without it transcripts go to stdout")
    t.add_argument("--word-timestamps", action="store_true", help="word-level times (verbose_json 'words')")
    t.add_argument("--prompt", default=None,
                   help="text that conditions the decoding: spellings, names, style (Whisper's initial prompt, "
                        "given to the first window of every piece); other models ignore it and say so")
    t.add_argument("--temperature", type=float, default=None,
                   help="first decoding temperature, 0..1 (Whisper: 0 greedy, then the fallback schedule; above "
                        "0 sampled, seeded per window)")
    t.add_argument("--task", choices=("transcribe", "translate"), default="transcribe",
                   help="translate: English text from speech in another language (multilingual Whisper "
                        "models, e.g. --model base)")
    t.add_argument("--batch-size", type=_positive_int, default=None,
                   help="pieces per model call, across files (default: 8 on CPU, 512 on CUDA)")
    t.add_argument("--segmentation", choices=("vad", "fixed", "none"), default="vad",
                   help="cut long audio at pauses (vad, default), in fixed windows, or not at all")
    t.add_argument("--max-segment-s", type=_positive_float, default=None,
                   help="longest piece in seconds (default and maximum: the model's, 30 for Whisper)")
    t.add_argument("--workers", type=_positive_int, default=None,
                   help="decode/VAD workers (default: half the cores on CPU, cores-1 up to 16 on CUDA)")
    t.add_argument("--cpu-pool", choices=("thread", "process"), default=None,
                   help="decode/VAD workers as threads or processes (default: processes on CUDA, where "
                        "the GPU needs many cores fed without the GIL; threads on CPU)")
    t.add_argument("--model-process", choices=("auto", "yes", "no"), default="auto",
                   help="run the model in a process of its own, so that the job's other Python threads cannot "
                        "slow its calls by taking the GIL (default auto: yes on CUDA when the files decode in "
                        "processes, --cpu-pool process, the CUDA default, with at least as many files as "
                        "--workers); the model process maps the samples the decode processes leave in shared "
                        "memory, and copies them once otherwise (decode threads); docs/JOBS.md")
    t.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                   help="skip inputs with a complete output from an earlier run (default: on)")
    t.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar on stderr (default: only when stderr is a terminal)")
    t.add_argument("--summary", action=argparse.BooleanOptionalAction, default=None,
                   help="the final table of files, audio, speed and stage costs on stderr (default: for several "
                        "inputs or with --output-dir)")
    t.add_argument("--quiet", "-q", action="store_true", help="no final summary table")
    r = t.add_argument_group("Ray (a cluster: decode + VAD as CPU tasks, one model actor per GPU; docs/RAY.md)")
    r.add_argument("--ray", nargs="?", const=RAY_DEFAULT, default=None, metavar="ADDRESS",
                   help="run the job on a Ray cluster: ADDRESS is auto, local, HOST:PORT (ray start --head prints "
                        "it) or ray://HOST:10001; without one, RAY_ADDRESS or a cluster started here, else a private "
                        "local instance (put --ray after the inputs, or write --ray=ADDRESS); --workers then caps "
                        "the decode tasks at once")
    r.add_argument("--ray-actors", type=_positive_int, default=None,
                   help="model actors (default: one per GPU of the cluster with --device cuda, else 1)")
    r.add_argument("--ray-decode-cpus", type=_positive_float, default=None,
                   help="CPUs each decode + VAD task asks for (default 0.5: two per core)")

    e = sub.add_parser("eval", help="WER on a manifest (optionally side by side with faster-whisper)",
                       description="Word error rate on a JSONL manifest with references.")
    from .eval import add_eval_args

    add_eval_args(e)

    sub.add_parser("models", help="list the models loadable here without a network, and how to get others",
                   description="Models loadable here without a network: the embedded ones and those in the "
                               "Hugging Face cache.")
    sub.add_parser("serve", help="run the HTTP/WebSocket server (needs the 'serve' extra)", add_help=False)
    return parser


def _install_sigterm() -> None:
    """SIGTERM gets Ctrl-C's handler (``signal.default_int_handler``: KeyboardInterrupt), so it is the
    same clean stop; a job takes both over while it runs (:class:`flashasr.jobs.interrupts.JobInterrupts`)."""
    try:
        signal.signal(signal.SIGTERM, signal.default_int_handler)
    except (ValueError, OSError):  # not the main thread
        pass


def _warn_about_options(args: argparse.Namespace, options, caps) -> None:
    """One stderr line per option the model changes or does not use (``options``: resolved)."""
    for name in caps.ignored(options):
        _err(f"warning: model {caps.name} does not use --{name}; it is ignored")
    if args.max_segment_s is not None and options.max_segment_s < args.max_segment_s:
        _err(f"warning: --max-segment-s {args.max_segment_s:g} is over model {caps.name}'s window; "
             f"pieces are at most {options.max_segment_s:g} s")


def _device_usable(device: str, *, here: bool) -> bool:
    """``--device`` checked by :func:`flashasr.pipeline.engines.check_device` (the rule of every door:
    ``cpu``, ``cuda`` or ``cuda:N``; with ``here`` also whether this machine can use it -- a Ray job's
    GPUs are the cluster's, checked there): False after an ``error: [invalid_device]`` line."""
    from .pipeline.engines import check_device

    try:
        check_device(device, here=here)
    except FlashASRError as e:
        print_error(e.code, str(e))
        return False
    return True


def _output_dir_ready(output_dir: str | None, *, create: bool) -> bool:
    """Whether ``--output-dir`` can take the outputs (True without one). ``create=False`` checks
    without creating anything (the folder, or the nearest existing folder above it, is a writable
    folder), so that a command refused later leaves nothing on disk; ``create=True`` makes it, once
    every argument and the model were accepted. False after an ``error: [output_dir_invalid]`` line."""
    if output_dir is None:
        return True
    from .jobs.outputs import check_writable_place

    out = Path(output_dir)
    try:
        if create:
            out.mkdir(parents=True, exist_ok=True)
        check_writable_place(out)
    except OSError as e:
        print_error("output_dir_invalid", f"cannot write outputs to --output-dir {output_dir}: {e.strerror or e}")
        return False
    return True


def cmd_transcribe(args: argparse.Namespace) -> int:
    """``flashasr transcribe``: see :func:`build_parser` for the options."""
    from .jobs import InputError, expand_inputs, start_decode_pool
    from .options import TranscribeOptions

    if args.word_timestamps and args.format != "verbose_json":  # as the server's 400 for timestamp_granularities
        print_error("invalid_option", f"--word-timestamps needs -f verbose_json (-f {args.format} has no words)")
        return EXIT_USAGE

    try:  # the one options object of this door, checked for syntax now and against the model below
        options = TranscribeOptions(language=args.language, task=args.task, word_timestamps=args.word_timestamps,
                                    segmentation=args.segmentation, max_segment_s=args.max_segment_s,
                                    prompt=args.prompt, temperature=args.temperature)
    except FlashASRError as e:
        print_error(e.code, str(e))
        return EXIT_USAGE
    missing: list = []
    try:
        items = expand_inputs(args.inputs, missing=missing)
    except InputError as e:  # e.g. an unreadable manifest
        print_error(e.code, str(e))
        return EXIT_USAGE
    for e in missing:  # one line per missing input, as a failed file's: the others still run
        _err(f"failed: {e.input}: [{e.code}] {e.reason}" if getattr(e, "input", None) is not None
             else f"failed: [{e.code}] {e}")
    if not items:
        given = ", ".join(repr(x) for x in args.inputs[:3]) + (f" and {len(args.inputs) - 3} more" if len(args.inputs) > 3 else "")
        print_error("no_inputs", f"no audio files found in {given} (audio extensions only; a folder is searched "
                                 "recursively, its links to other folders are not followed)")
        return EXIT_USAGE
    if args.output_dir is None and sys.stdout is None:  # `>&-`: the transcripts would have nowhere to go
        print_error("output_error", "stdout is closed: nowhere to print the transcripts (use --output-dir DIR)")
        return EXIT_USAGE
    # checked before the (slow) model load, and nothing is created on disk until every argument is accepted
    if not _device_usable(args.device, here=args.ray is None) or not _output_dir_ready(args.output_dir, create=False):
        return EXIT_USAGE
    if args.ray is not None:
        if args.model_process == "yes":  # the cluster's model actors are processes of their own already
            _err("warning: --model-process applies to local jobs; with --ray the model runs in the cluster's actors")
        return _transcribe_ray(args, items, missing, options)
    # decode workers forked while this process is small (forking them from one holding a CUDA context
    # and the model took 0.9 s on the H200 machine); None when the job decodes in threads
    pool = start_decode_pool(args.device, args.workers, args.cpu_pool, n_inputs=len(items))
    try:
        return _transcribe(args, items, missing, options, pool)
    finally:
        if pool is not None:
            pool.close()


def _transcribe(args: argparse.Namespace, items: list, missing: list, options, pool) -> int:
    """The rest of :func:`cmd_transcribe`: load the model, run the job, report."""
    try:
        model = _job_model(args, pool)
    except FlashASRError as e:
        print_error(e.code, f"cannot load model {args.model or 'tiny.en'}: {e}")
        return EXIT_USAGE
    except Exception as e:  # e.g. a CUDA device asked for on a machine without one
        print_error("model_load_error", f"cannot load model {args.model or 'tiny.en'} on {args.device}: "
                    f"{type(e).__name__}: {e}")
        return EXIT_USAGE
    try:
        return _run_transcribe_job(args, items, missing, options, pool, model)
    finally:
        if hasattr(model, "close") and getattr(model, "isolates_pieces", False):
            model.close()


def _job_model(args: argparse.Namespace, pool):
    """The job's model: in a process of its own (:class:`~flashasr.pipeline.model_process.ModelProcess`)
    with ``--model-process yes``, or by default on CUDA when the files decode in worker processes;
    else loaded here (in-process callers reuse it, :func:`~flashasr.pipeline.cached_model`)."""
    from .pipeline import cached_model

    remote = args.model_process == "yes" or (args.model_process == "auto" and pool is not None
                                             and str(args.device).startswith("cuda"))
    if remote:
        from .pipeline.model_process import ModelProcess

        return ModelProcess(args.model, device=args.device, engine=args.engine)
    return cached_model(args.model, args.device, None, args.engine)


def _run_transcribe_job(args: argparse.Namespace, items: list, missing: list, options, pool, model) -> int:
    """Run the job with the loaded ``model`` and report (the rest of :func:`_transcribe`)."""
    from .jobs import run_job

    try:
        options = options.resolve(model.capabilities)
    except FlashASRError as e:  # a language or task this model cannot do
        print_error(e.code, str(e))
        return EXIT_USAGE
    _warn_about_options(args, options, model.capabilities)
    if not _output_dir_ready(args.output_dir, create=True):
        return EXIT_USAGE
    printer = None
    if args.output_dir is None:
        printer = StdoutPrinter(items, args.format, args.word_timestamps, missing=missing)
        stopped = _print_to_stdout(printer.print_missing)
        if stopped is not None:
            return stopped
    _install_sigterm()
    watch = ReaderWatch().start() if printer is not None else None
    try:
        report = run_job(items, model, args.output_dir, args.format, options=options, batch_size=args.batch_size,
                         workers=args.workers, cpu_pool=args.cpu_pool, resume=args.resume, progress=args.progress,
                         on_result=printer, keep_transcripts=False, worker_pool=pool,
                         stop=None if watch is None else watch.stop)
    except FlashASRError as e:
        _flush_held(printer)
        print_error(e.code, str(e))
        if e.code in ("model_process_error", "output_error"):  # the job ran and stopped: not a usage error
            if args.output_dir:
                _err("the outputs finished so far are kept; re-run the same command to resume")
            return EXIT_FAILED
        return EXIT_USAGE
    except BrokenPipeError:  # `| head` closed stdout: stop quietly, as command-line tools do
        _quiet_stdout()
        return EXIT_BROKEN_PIPE
    finally:
        if watch is not None:
            watch.close()
    if watch is not None and watch.gone and report.interrupted:  # the reader went away: its stop
        _quiet_stdout()
        return EXIT_BROKEN_PIPE
    stopped = _flush_held(printer)
    if stopped is not None:
        return stopped
    return _report(args, items, missing, report)


def _transcribe_ray(args: argparse.Namespace, items: list, missing: list, options) -> int:
    """``flashasr transcribe --ray``: join the cluster, run :func:`flashasr.jobs.ray_job.run_ray_job`,
    report as the local job does (exit codes, ``failed:`` lines, the table)."""
    from .jobs.ray_job import DEFAULT_DECODE_CPUS, probe_capabilities, run_ray_job
    from .ray_cluster import connect

    address = None if args.ray == RAY_DEFAULT else args.ray
    try:
        connect(address)
    except FlashASRError as e:  # a malformed address, Ray missing, a cluster that cannot be joined
        print_error(e.code, str(e))
        return EXIT_USAGE
    try:
        caps = probe_capabilities(args.model, device=args.device, engine=args.engine)
    except FlashASRError as e:
        print_error(e.code, f"cannot load model {args.model or 'tiny.en'}: {e}")
        return EXIT_USAGE
    except Exception as e:  # noqa: BLE001 - e.g. a CUDA device asked for on a cluster without one
        print_error("model_load_error", f"cannot load model {args.model or 'tiny.en'} on {args.device}: "
                    f"{type(e).__name__}: {e}")
        return EXIT_USAGE
    try:
        options = options.resolve(caps)
    except FlashASRError as e:
        print_error(e.code, str(e))
        return EXIT_USAGE
    _warn_about_options(args, options, caps)
    if not _output_dir_ready(args.output_dir, create=True):
        return EXIT_USAGE
    printer = None
    if args.output_dir is None:
        printer = StdoutPrinter(items, args.format, args.word_timestamps, missing=missing)
        stopped = _print_to_stdout(printer.print_missing)
        if stopped is not None:
            return stopped
    _install_sigterm()  # after joining: ours, not Ray's
    try:
        report = run_ray_job(items, args.model, args.output_dir, args.format, address=address, device=args.device,
                             engine=args.engine, capabilities=caps, options=options, batch_size=args.batch_size,
                             actors=args.ray_actors, decode_cpus=args.ray_decode_cpus or DEFAULT_DECODE_CPUS,
                             decode_tasks=args.workers, resume=args.resume, progress=args.progress,
                             on_result=printer, keep_transcripts=False)
    except FlashASRError as e:
        _flush_held(printer)
        print_error(e.code, str(e))
        return EXIT_USAGE
    except BrokenPipeError:
        _quiet_stdout()
        return EXIT_BROKEN_PIPE
    stopped = _flush_held(printer)
    if stopped is not None:
        return stopped
    return _report(args, items, missing, report)


def _without_path(msg: str, item) -> str:
    """A file's error message without the file's own name in front (the ``failed:`` line names it
    once): ``<display>: ``, ``<path>: `` or either quoted, as the layers below spell it."""
    for name in (item.display, str(item.path)):
        for prefix in (f"{name}: ", f"{name!r}: ", f'"{name}": '):
            if msg.startswith(prefix):
                return msg[len(prefix):]
    return msg


def _report(args: argparse.Namespace, items: list, missing: list, report) -> int:
    """The end of a job on the command line: ``warning:`` and ``failed:`` lines, the interrupt line, the
    table; the exit code."""
    for r in report.results:  # what the caller should know about a transcript: a damaged input, a cut loop
        for w in r.warnings or ():
            _err(f"warning: {r.item.display}: [{w.get('code')}] {w.get('message')}")
    for r in report.failed:
        _err(f"failed: {r.item.display}: [{r.error_code}] {_without_path(r.error_message or '', r.item)}")
    if report.interrupted:
        _err(f"interrupted: {len(report.ok) + len(report.skipped)} of {len(items)} inputs finished; "
             "re-run the same command to resume" if args.output_dir else "interrupted")
    if not args.quiet and (args.summary or (args.summary is None and (len(items) > 1 or args.output_dir))):
        nothing_done = _nothing_done_line(report, args.output_dir)
        _err(nothing_done or report.table())
        if missing:  # inputs that never reached the job (not found, unreadable folder): also failures
            _err(f"inputs     {len(missing)} not found or unreadable (the 'failed:' lines above); exit code 1")
        if args.output_dir and not nothing_done:
            _err(f"outputs    {os.path.abspath(args.output_dir)} (summary.jsonl)")
    return EXIT_FAILED if missing and report.exit_code == EXIT_OK else report.exit_code


def _nothing_done_line(report, output_dir: str | None) -> str | None:
    """The one line that replaces the table of a re-run whose every input was already done (all
    skipped by ``--resume``: a table of zeros says nothing), else None."""
    n = len(report.results)
    if not n or len(report.skipped) < n or report.interrupted or output_dir is None:
        return None
    from .jobs.outputs import SUMMARY_NAME

    where = os.path.join(output_dir, SUMMARY_NAME)
    return (f"all {n} inputs already done in {where}; nothing to transcribe (use --no-resume to redo them)"
            if n > 1 else f"the input is already done in {where}; nothing to transcribe (use --no-resume to redo it)")


class StdoutPrinter:
    """The transcripts of a job without ``--output-dir``, on stdout in input order, each as soon as
    it and every input before it are done (the job's ``on_result``, called from its writer thread).

    One input: the format as it is. Several (for JSON, counting inputs that named no file): ``json``/
    ``verbose_json`` as JSON Lines -- one object per input with its ``path`` (and ``error``
    ``{code, message}`` for a failed one, also for an input that does not exist or a glob without
    a match: those come first, see :meth:`print_missing`), nothing else on stdout;
    ``text``/``srt``/``vtt`` each under a ``==> file <==`` header (failed inputs: nothing, their
    ``failed:`` line goes to stderr).
    """

    def __init__(self, items, fmt: str, words: bool, missing: list | None = None):
        self.fmt, self.words = fmt, bool(words)
        self.missing = list(missing or [])
        lines = fmt in ("json", "verbose_json")  # JSON Lines name every input given, missing ones too
        self.several = len(items) + (len(self.missing) if lines else 0) > 1
        self.order = {str(it.path): k for k, it in enumerate(items)}
        self.ready: dict[int, str | None] = {}
        self.next = 0

    def print_missing(self) -> None:
        """JSON Lines: one ``{"path", "error"}`` object per input that named no file (before the job)."""
        import json

        if not (self.several and self.fmt in ("json", "verbose_json")):
            return
        _write_stdout("".join(json.dumps({"path": getattr(e, "input", None), "error": {"code": e.code, "message": str(e)}},
                                         ensure_ascii=False) + "\n" for e in self.missing))

    def __call__(self, res) -> None:
        self.ready[self.order[str(res.item.path)]] = self._render(res)
        while self.next in self.ready:
            out = self.ready.pop(self.next)
            self.next += 1
            if out is not None:
                _write_stdout(out if out.endswith("\n") else out + "\n")

    def flush_held(self) -> int:
        """The transcripts still held back for an earlier input that never finished (an interrupted
        job, a failed model process): printed now, in input order with the gaps skipped, so a
        finished transcript is never lost. Returns how many were printed."""
        n = 0
        for k in sorted(self.ready):
            out = self.ready.pop(k)
            if out is not None:
                _write_stdout(out if out.endswith("\n") else out + "\n")
                n += 1
        return n

    def _render(self, res) -> str | None:
        import json

        from .formats import render

        ok = res.status == "ok" and res.transcript is not None
        lines = self.several and self.fmt in ("json", "verbose_json")
        if lines:
            if not ok:
                rec = {"error": {"code": res.error_code, "message": res.error_message}} if res.status == "failed" else None
            elif self.fmt == "json":
                rec = {"text": res.transcript.text.strip()}
            else:
                rec = res.transcript.to_dict(words=True if self.words else None)
            return None if rec is None else json.dumps({"path": res.item.display, **rec}, ensure_ascii=False)
        if not ok:
            return None
        text = render(res.transcript, self.fmt, words=True if self.words else None)
        return f"==> {res.item.display} <==\n{text}" if self.several else text


def _write_stdout(text: str) -> None:
    """``text`` to stdout, flushed. Raises BrokenPipeError when the reader went away (the caller stops
    quietly), :class:`~flashasr.errors.FlashASRError` ``output_error`` for any other failure (a full
    disk, a closed stdout), so the job stops with a clear error line instead of a traceback."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except (OSError, AttributeError, ValueError) as e:  # AttributeError: no stdout at all (`>&-`)
        raise FlashASRError(f"cannot write the transcripts to stdout: {e} (use --output-dir DIR)",
                            code="output_error") from None


def _print_to_stdout(step) -> int | None:
    """``step()``, a :class:`StdoutPrinter` call that writes to stdout: None, or the exit code when
    stdout failed (141: the reader went away, quietly; 1: stdout unwritable, said on stderr)."""
    try:
        step()
    except BrokenPipeError:
        _quiet_stdout()
        return EXIT_BROKEN_PIPE
    except FlashASRError as e:
        print_error(e.code, str(e))
        return EXIT_FAILED
    return None


def _flush_held(printer: "StdoutPrinter | None") -> int | None:
    """:meth:`StdoutPrinter.flush_held` after a job: None, or the exit code when stdout failed
    (:func:`_print_to_stdout`), so transcripts that could not be printed never end in exit 0."""
    return None if printer is None else _print_to_stdout(printer.flush_held)


class ReaderWatch:
    """Notices at once that the reader of stdout went away (``| head -n 1`` has its lines), so a job
    that prints to a pipe stops as after Ctrl-C (when the model call running ends), not at its next
    line: the next line may be minutes away (lines come in input order, so a long input holds back
    those after it), and the job would run on meanwhile.

    While started, a daemon thread polls stdout (a pipe or FIFO only; a file, terminal or socket is not
    watched) for ``POLLERR`` or ``POLLHUP``: Linux reports ``POLLERR`` on a pipe's write end once no
    reader is left (other systems may report neither, and the job then stops at its next line, as
    before). Then :attr:`gone` is set and :attr:`stop` (a ``threading.Event``) set, which
    :func:`~flashasr.jobs.run_job` takes as its clean stop (its ``stop`` argument): no signal is
    involved, so whatever SIGINT's handler is, nothing reaches the process after the job.
    The caller then exits quietly with 141 (128 + SIGPIPE), as command-line tools do.

    Args:
        fd: the descriptor to watch (default: stdout's).
        poll_s: the poll's timeout, seconds (how soon :meth:`close` ends the thread).
    """

    def __init__(self, fd: int | None = None, poll_s: float = 0.25):
        import threading

        self.fd, self.poll_s = fd, float(poll_s)
        self.gone = False
        self.stop = threading.Event()
        self._done = threading.Event()
        self._thread: "threading.Thread | None" = None

    def start(self) -> "ReaderWatch":
        import select
        import stat
        import threading

        try:
            fd = sys.stdout.fileno() if self.fd is None else self.fd
            if not stat.S_ISFIFO(os.fstat(fd).st_mode) or not hasattr(select, "poll"):
                return self
        except (OSError, ValueError, AttributeError):  # no real stdout (an embedding, a test's capture)
            return self
        poller = select.poll()
        poller.register(fd, 0)  # no event asked for: POLLERR / POLLHUP / POLLNVAL are always reported

        def watch() -> None:
            while not self._done.is_set():
                events = 0
                for _fd, ev in poller.poll(self.poll_s * 1000):
                    events |= ev
                if events & select.POLLNVAL:  # the descriptor was closed under us: nothing to watch
                    return
                if events & (select.POLLERR | select.POLLHUP):
                    self.gone = True
                    self.stop.set()
                    return

        self._thread = threading.Thread(target=watch, name="flashasr-stdout-watch", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop watching and end the thread (the job is over)."""
        self._done.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def _quiet_stdout() -> None:
    """After a closed pipe: point stdout at /dev/null so the interpreter's final flush stays quiet."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except OSError:
        pass


def cmd_models() -> int:
    """``flashasr models``: what loads here without a network, then how to use other models."""
    from .models.catalog import hub_cache_dir, local_models

    rows = local_models()
    w = max(len(r["spec"]) for r in rows)
    print(f"{'model':{w}}  family    where / note")
    for r in rows:
        print(f"{r['spec']:{w}}  {r['family']:8}  {r['where']}  ({r['note']})")
    print(f"\nAlso: a path to Whisper weights (a CTranslate2 or Hugging Face folder, an OpenAI .pt), a Parakeet "
          f".nemo file, or a hub id (nvidia/parakeet-..., openai/whisper-..., */faster-whisper-...) once in the "
          f"Hugging Face cache ({hub_cache_dir()}).")
    return EXIT_OK


def cmd_serve(argv: list[str]) -> int:
    """Hand ``flashasr serve ...`` to :func:`flashasr.serve.app.main` (imported lazily)."""
    try:
        from .serve.app import main as serve_main
    except ImportError as e:
        missing = getattr(e, "name", None) or str(e)
        print_error("serve_unavailable", f"'flashasr serve' needs the serve extra "
                    f"(pip install 'flashasr[serve]'); import failed: {missing}")
        return EXIT_USAGE
    return int(serve_main(argv) or 0)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``flashasr`` console script; returns the exit code."""
    from .malloc import pin_mmap_threshold

    pin_mmap_threshold()  # freed model buffers go back to the system (a 10 h file: 4.0 -> 3.0 GiB peak)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":
        return cmd_serve(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "transcribe":
        try:
            return cmd_transcribe(args)
        except KeyboardInterrupt:  # e.g. during model loading
            _err("interrupted")
            return EXIT_INTERRUPTED
    if args.command == "models":
        return cmd_models()
    if args.command == "eval":
        from .eval import run_eval_cli

        try:
            return run_eval_cli(args)
        except KeyboardInterrupt:
            _err("interrupted")
            return EXIT_INTERRUPTED
    parser.print_help(sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
