"""Job outputs: atomic file writes, the ``summary.jsonl`` journal and resume decisions.

Crash safety follows one rule: an output file is written to a temporary name in the
same folder, flushed, fsynced and ``os.replace``-d into place (atomic on POSIX), and
only *after* that a summary line is appended. So a summary line with ``status: ok``
always refers to a complete output; an output without a summary line (killed between
the two steps) is simply redone on the next run.

A re-run skips an input when the latest summary line for its path says ``ok`` and the
input's size and mtime (ns), the output format, the model and the options (the job's resolved
:meth:`flashasr.options.TranscribeOptions.to_dict`, every field) all match, and the output file
exists with the recorded size.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import fields
from pathlib import Path

from ..options import TranscribeOptions

SUMMARY_NAME = "summary.jsonl"
TMP_MARK = ".flashasr-tmp-"


def atomic_write_text(path: Path, text: str) -> int:
    """Write ``text`` (UTF-8) to ``path`` atomically; returns the number of bytes written.

    The temporary file ``.<name>.flashasr-tmp-<pid>`` lives in the target folder (so
    ``os.replace`` never crosses file systems) and is removed if anything fails.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}{TMP_MARK}{os.getpid()}-{threading.get_ident()}"
    data = text.encode("utf-8")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    return len(data)


def clean_stale_tmp(output_dir: Path) -> int:
    """Remove temporary files a killed run left in ``output_dir`` (recursively); returns the count."""
    n = 0
    if not output_dir.is_dir():
        return 0
    for root, _dirs, files in os.walk(output_dir):
        for f in files:
            if TMP_MARK in f and f.startswith("."):
                try:
                    os.unlink(os.path.join(root, f))
                    n += 1
                except OSError:
                    pass
    return n


def input_signature(path: Path) -> tuple[int, int] | None:
    """(size in bytes, mtime in ns) of an input file, or None when it cannot be stat-ed."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


class Summary:
    """The ``summary.jsonl`` journal of one output folder.

    One JSON object per finished input (appended as each finishes, flushed and fsynced):
    ``path`` (absolute input path), ``key``, ``status`` (``ok``/``failed``), ``duration``
    (audio seconds or null), ``error_code``, ``error_message``, ``output`` (path relative to
    the output folder), ``output_bytes``, ``processing_s`` (wall seconds from the start of
    decoding to the output being written), ``input_size``, ``input_mtime_ns``, ``format``,
    ``model``, ``options``. Unparsable lines (a line cut by a crash) are ignored.

    Records are keyed by (input path, format): jobs writing different formats into one folder
    each keep their own record, so a text run after a json run still finds its text outputs.
    """

    def __init__(self, output_dir: Path):
        self.output_dir = Path(output_dir)
        self.path = self.output_dir / SUMMARY_NAME
        self._lock = threading.Lock()
        self.previous: dict[tuple[str, str | None], dict] = {}
        self._order: list[str] = []
        self._unsynced = False

    def load(self) -> dict[tuple[str, str | None], dict]:
        """Read earlier lines; the last line per (input path, format) wins. Returns {key: record}."""
        self.previous = self._read()
        return self.previous

    @staticmethod
    def _key(rec: dict) -> tuple[str, str | None]:
        return rec["path"], rec.get("format")

    def _read(self) -> dict[tuple[str, str | None], dict]:
        """The journal on disk as {(path, format): last record}; unparsable lines are skipped."""
        recs: dict[tuple[str, str | None], dict] = {}
        if self.path.exists():
            for line in self.path.read_text(encoding="utf-8", errors="replace").splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(rec, dict) and isinstance(rec.get("path"), str):
                    recs[self._key(rec)] = rec
        return recs

    def is_complete(self, path: Path, *, fmt: str, model: str, options: dict) -> dict | None:
        """The earlier ``ok`` record for ``path`` if its output can be reused, else None."""
        rec = self.previous.get((str(path), fmt))
        if not rec or rec.get("status") != "ok":
            return None
        sig = input_signature(path)
        if sig is None or (rec.get("input_size"), rec.get("input_mtime_ns")) != sig:
            return None
        if rec.get("format") != fmt or rec.get("model") != model or not _same_options(rec.get("options"), options):
            return None
        out = rec.get("output")
        if not isinstance(out, str):
            return None
        op = self.output_dir / out
        try:
            if op.stat().st_size != rec.get("output_bytes"):
                return None
        except OSError:
            return None
        return rec

    def append(self, rec: dict, *, sync: bool = True) -> None:
        """Append one record (thread-safe), flushed, and fsynced unless ``sync=False`` (group
        commit: the caller calls :meth:`sync` after a group; a record's output is already durable
        when it is appended, so a record lost with the unsynced tail only means that input is redone)."""
        line = json.dumps(rec, ensure_ascii=False) + "\n"
        with self._lock:
            # Memory first: a Ctrl-C (KeyboardInterrupt can land between any two bytecodes)
            # after the line reached the file must not let compact() drop it again.
            self.previous[self._key(rec)] = rec
            self.output_dir.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a+b") as f:
                if f.tell() > 0:  # a line cut by a crash must not swallow this one
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":
                        line = "\n" + line
                f.write(line.encode("utf-8"))
                f.flush()
                if sync:
                    os.fsync(f.fileno())
                else:
                    self._unsynced = True

    def sync(self) -> None:
        """fsync the journal if records were appended with ``sync=False`` since the last sync."""
        with self._lock:
            if not self._unsynced or not self.path.exists():
                return
            with open(self.path, "rb") as f:
                os.fsync(f.fileno())
            self._unsynced = False

    def compact(self, order: list[str]) -> None:
        """Rewrite the journal atomically with one line per (input, format), inputs in ``order`` first.

        Records of paths not in ``order`` (inputs of earlier runs) are kept after them.
        """
        with self._lock:
            # lines on disk that memory lacks (none, unless an interrupt hit append)
            for p, r in self._read().items():
                self.previous.setdefault(p, r)
            by_path: dict[str, list] = {}
            for k in self.previous:
                by_path.setdefault(k[0], []).append(k)
            recs = []
            seen = set()
            for p in order:
                for k in by_path.get(p, []):
                    if k not in seen:
                        recs.append(self.previous[k])
                        seen.add(k)
            for k, r in self.previous.items():
                if k not in seen:
                    recs.append(r)
            text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs)
            atomic_write_text(self.path, text)


def _same_options(recorded, options: dict) -> bool:
    """Whether a journal record's options equal ``options``; a field the record lacks (written by
    a version before that field existed) counts as its default, so an upgrade alone re-runs nothing."""
    if not isinstance(recorded, dict) or set(recorded) - set(options):
        return False
    defaults = {f.name: f.default for f in fields(TranscribeOptions)}
    return all(recorded.get(k, defaults.get(k)) == v for k, v in options.items())
