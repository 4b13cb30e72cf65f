"""Job outputs: atomic file writes, the ``summary.jsonl`` journal and resume decisions.

Crash safety follows one rule: an output file is written to a temporary name in the
same folder, flushed to the disk (``fdatasync``) and ``os.replace``-d into place (atomic on
POSIX), and only *after* that a summary line is appended (lines are fsynced in groups). So a summary line with ``status: ok``
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


_MADE_DIRS: set[str] = set()  # output folders this process made or found (one mkdir each)
_SYNC = getattr(os, "fdatasync", os.fsync)  # the data and what reading it back needs (its size)


def atomic_write_text(path: Path, text: str) -> int:
    """Write ``text`` (UTF-8) to ``path`` atomically; returns the number of bytes written.

    The temporary file ``.<name>.flashasr-tmp-<pid>-<thread>`` lives in the target folder (so
    ``os.replace`` never crosses file systems), is written and flushed to the disk
    (``fdatasync``: its bytes and its size) before the rename, and is removed if anything fails.
    Safe to call from several threads at once.
    """
    parent = os.fspath(path.parent)
    if parent not in _MADE_DIRS:
        os.makedirs(parent, exist_ok=True)
        _MADE_DIRS.add(parent)
    name = os.fspath(path)
    tmp = os.path.join(parent, f".{path.name}{TMP_MARK}{os.getpid()}-{threading.get_ident()}")
    data = text.encode("utf-8")
    try:
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o666)
        except FileNotFoundError:  # the folder went away since it was made: make it again
            os.makedirs(parent, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o666)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            _SYNC(fd)
        finally:
            os.close(fd)
        os.replace(tmp, name)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return len(data)


def check_writable_place(path: Path) -> None:
    """Whether ``path`` (a folder to make, or a file to write, possibly below folders not made yet)
    could be created, without creating anything: its nearest existing folder is a writable folder.

    Raises:
        NotADirectoryError: that nearest existing path is not a folder.
        PermissionError: that folder is not writable.
    """
    near = Path(path)
    while not near.exists() and near.parent != near:
        near = near.parent
    if not near.is_dir():
        raise NotADirectoryError(f"{near} exists and is not a directory")
    if not os.access(near, os.W_OK | os.X_OK):
        raise PermissionError(f"{near} is not writable")


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
        self._lines: dict[tuple[str, str | None], str] = {}  # the JSON line of each record in memory
        self._fd: int | None = None  # the journal, open for appending during a run
        self._known = 0  # bytes of the journal this object has read or written
        self._unsynced = False

    def load(self) -> dict[tuple[str, str | None], dict]:
        """Read earlier lines; the last line per (input path, format) wins. Returns {key: record}."""
        self.previous, self._lines, self._known = self._read()
        return self.previous

    @staticmethod
    def _key(rec: dict) -> tuple[str, str | None]:
        return rec["path"], rec.get("format")

    def _read(self) -> tuple[dict, dict, int]:
        """The journal on disk: ({(path, format): last record}, {key: its line}, bytes read);
        unparsable lines are skipped."""
        recs: dict[tuple[str, str | None], dict] = {}
        lines: dict[tuple[str, str | None], str] = {}
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return recs, lines, 0
        for line in data.decode("utf-8", errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("path"), str):
                recs[self._key(rec)] = rec
                lines[self._key(rec)] = line
        return recs, lines, len(data)

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

    def _open(self) -> int:
        """The journal's descriptor (callers hold the lock), opened once: a line cut by a crash at
        its end gets its newline first, so it cannot swallow the next record."""
        if self._fd is None:
            os.makedirs(self.output_dir, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                os.write(fd, b"\n")
            if size != self._known:  # written by someone else since load(): compact() must read it
                self._known = -1
            self._fd = fd
        return self._fd

    def append(self, rec: dict, *, sync: bool = True) -> None:
        """Append one record (thread-safe), written at once, and fsynced unless ``sync=False``
        (group commit: the caller calls :meth:`sync` after a group; a record's output is already
        durable when it is appended, so a record lost with the unsynced tail only means that input
        is redone)."""
        line = json.dumps(rec, ensure_ascii=False)
        try:
            data = (line + "\n").encode("utf-8")
        except UnicodeEncodeError:  # a file name that is not UTF-8 (its bytes as surrogates, as Python
            # gives them): escaped (\udcff), which json.loads reads back to the same path
            line = json.dumps(rec)
            data = (line + "\n").encode("ascii")
        with self._lock:
            # Memory first: a Ctrl-C (KeyboardInterrupt can land between any two bytecodes)
            # after the line reached the file must not let compact() drop it again.
            key = self._key(rec)
            self.previous[key] = rec
            self._lines[key] = line
            fd = self._open()
            os.write(fd, data)
            if self._known >= 0:
                self._known += len(data)
            if sync:
                os.fsync(fd)
            else:
                self._unsynced = True

    def sync(self) -> None:
        """fsync the journal if records were appended with ``sync=False`` since the last sync."""
        with self._lock:
            if self._unsynced and self._fd is not None:
                os.fsync(self._fd)
            self._unsynced = False

    def close(self) -> None:
        """fsync and close the journal's descriptor (a later append opens it again)."""
        with self._lock:
            if self._fd is not None:
                try:
                    if self._unsynced:
                        os.fsync(self._fd)
                finally:
                    os.close(self._fd)
                    self._fd = None
                    self._unsynced = False

    def compact(self, order: list[str]) -> None:
        """Rewrite the journal atomically with one line per (input, format), inputs in ``order`` first.

        Records of paths not in ``order`` (inputs of earlier runs) are kept after them. The lines
        are the ones in memory (no re-encoding); the file is read again only when it holds bytes
        this object did not read or write (another writer, or an interrupt inside :meth:`append`).
        """
        self.close()
        with self._lock:
            try:
                size = os.stat(self.path).st_size
            except FileNotFoundError:
                size = 0
            if size != self._known:  # lines on disk that memory lacks
                recs, lines, _ = self._read()
                for k, r in recs.items():
                    if k not in self.previous:
                        self.previous[k] = r
                        self._lines[k] = lines[k]
            by_path: dict[str, list] = {}
            for k in self.previous:
                by_path.setdefault(k[0], []).append(k)
            keys = []
            seen = set()
            for p in order:
                for k in by_path.get(p, []):
                    if k not in seen:
                        keys.append(k)
                        seen.add(k)
            keys.extend(k for k in self.previous if k not in seen)
            lines = [self._lines.get(k) or json.dumps(self.previous[k], ensure_ascii=False) for k in keys]
            self._known = atomic_write_text(self.path, "".join(line + "\n" for line in lines))


def _same_options(recorded, options: dict) -> bool:
    """Whether a journal record's options equal ``options``; a field the record lacks (written by
    a version before that field existed) counts as its default, so an upgrade alone re-runs nothing."""
    if not isinstance(recorded, dict) or set(recorded) - set(options):
        return False
    defaults = {f.name: f.default for f in fields(TranscribeOptions)}
    return all(recorded.get(k, defaults.get(k)) == v for k, v in options.items())
