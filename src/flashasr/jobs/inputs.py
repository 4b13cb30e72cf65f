"""Expand job inputs (files, directories, glob patterns, JSONL manifests) into work items.

Each :class:`InputItem` carries the resolved audio path and a *relative output key*
(a POSIX path without extension) that decides where its output goes under
``--output-dir``:

* a file given directly: its base name (``talk.wav`` -> ``talk``);
* a file found under a directory input: its path relative to that directory
  (``in/a/talk.wav`` with input ``in`` -> ``a/talk``), so duplicate base names in
  different folders never collide;
* a glob match: its path relative to the pattern's non-wildcard prefix;
* a manifest entry: its path relative to the manifest's folder (relative entries
  resolve against that folder, as NeMo manifests do).

If two different inputs still map to the same key (``x/a.wav`` and ``y/a.wav`` given
as two files, or ``a.wav`` and ``a.mp3`` in one folder), every colliding key gets a
``-<8 hex>`` suffix from a hash of the absolute input path. The mapping depends only
on the set of inputs, so a re-run with the same inputs finds the same outputs.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from ..errors import FlashASRError

#: File extensions a directory or glob expansion treats as audio (lower case, with dot).
AUDIO_EXTENSIONS = frozenset({
    ".wav", ".wave", ".flac", ".mp3", ".ogg", ".oga", ".opus", ".m4a", ".mp4", ".aac",
    ".aif", ".aiff", ".aifc", ".wma", ".webm", ".mka", ".mkv", ".mov", ".amr", ".au",
    ".caf", ".ac3", ".3gp", ".spx", ".w64", ".mpga", ".mpeg",
})

MANIFEST_EXTENSIONS = (".jsonl", ".json")


class InputError(FlashASRError):
    """A job input (path, glob or manifest) could not be expanded.

    ``input``: the input as spelled, when the error is about one input (then the message is
    ``input '<input>': <reason>`` and ``reason`` holds the part after it); else None."""

    code = "invalid_input"
    status = 400

    def __init__(self, message: str, *, code: str | None = None, input: str | None = None):
        super().__init__(f"input {input!r}: {message}" if input is not None else message, code=code)
        self.input = input
        self.reason = message


@dataclass
class InputItem:
    """One audio input of a job.

    Attributes:
        path: absolute path of the audio file (may not exist or be unreadable: the
            job reports that per file instead of failing the whole expansion).
        key: relative output key, POSIX style, without extension (see module doc).
        display: the path as the user spelled it (for messages and headers).
        language: ISO 639-1 code from a manifest entry (None otherwise).
        meta: the full manifest entry (empty for non-manifest inputs).
    """

    path: Path
    key: str
    display: str
    language: str | None = None
    meta: dict = field(default_factory=dict)


def _has_magic(s: str) -> bool:
    return glob.has_magic(s)


def _is_audio(p: Path) -> bool:
    return p.suffix.lower() in AUDIO_EXTENSIONS


def _strip_ext(rel: str) -> str:
    pp = PurePosixPath(rel)
    return str(pp.with_suffix("")) if pp.suffix else str(pp)


def _safe_key(rel: str) -> str:
    """Normalise a relative key: no absolute parts, no ``..`` (those become ``__``)."""
    parts = [p for p in PurePosixPath(rel.replace(os.sep, "/")).parts if p not in ("", ".", "/")]
    parts = ["__" if p == ".." else p for p in parts]
    return "/".join(parts) or "audio"


def read_manifest(manifest: str | os.PathLike) -> list[InputItem]:
    """Read a JSONL manifest: one JSON object per line with ``audio_filepath`` or ``path``.

    Relative paths resolve against the manifest's folder. A ``language`` field is kept.
    Raises:
        InputError: unreadable file, a line that is not a JSON object, or a line without
            ``audio_filepath``/``path`` (the message names the line number).
    """
    mpath = Path(manifest)
    try:
        text = mpath.read_text(encoding="utf-8")
    except OSError as e:
        raise InputError(f"manifest {manifest}: cannot read ({e.strerror or e})", code="unreadable_input") from e
    root = mpath.resolve().parent
    items = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"manifest {manifest}, line {lineno}: not valid JSON ({e.msg})",
                             code="invalid_manifest") from e
        if not isinstance(entry, dict):
            raise InputError(f"manifest {manifest}, line {lineno}: expected a JSON object",
                             code="invalid_manifest")
        ap = entry.get("audio_filepath", entry.get("path"))
        if not isinstance(ap, str) or not ap:
            raise InputError(f"manifest {manifest}, line {lineno}: no 'audio_filepath' or 'path' field",
                             code="invalid_manifest")
        p = Path(ap)
        absp = p if p.is_absolute() else root / p
        if p.is_absolute():
            try:
                rel = str(absp.resolve().relative_to(root))
            except ValueError:
                rel = absp.name
        else:
            rel = ap
        lang = entry.get("language") if isinstance(entry.get("language"), str) else None
        items.append(InputItem(path=Path(os.path.abspath(absp)), key=_safe_key(_strip_ext(rel)),
                               display=ap, language=lang, meta=entry))
    return items


def _walk_dir(d: Path, unreadable: list | None = None) -> list[str]:
    """Audio files below ``d`` (sorted), as ``os.path.join(root, name)`` strings (a folder of 100,000
    files is listed without a pathlib object per file); folders that cannot be listed go to
    ``unreadable``."""
    out = []

    def _onerror(e: OSError) -> None:
        if unreadable is not None:
            unreadable.append(e)

    join = os.path.join
    for root, dirs, files in os.walk(d, followlinks=False, onerror=_onerror):
        dirs.sort()
        out.extend(join(root, f) for f in sorted(files) if _has_audio_suffix(f))
    return out


def _has_audio_suffix(name: str) -> bool:
    """:func:`_is_audio` of a bare file name (pathlib's rule up to Python 3.13: the suffix starts at
    the last dot that is neither the name's first nor its last character)."""
    i = name.rfind(".")
    return 0 < i < len(name) - 1 and name[i:].lower() in AUDIO_EXTENSIONS


def _walked_key(rel: str) -> str:
    """``_safe_key(_strip_ext(rel))`` of a path :func:`_walk_dir` found, relative to the walked folder
    with ``/`` separators. Its folders are real names (no ``.``, ``..`` or empty parts), so the suffix
    is all that goes, unless the name is dots and a suffix (``..wav``): its stem ``.`` or ``..`` then
    takes :func:`_safe_key`'s rule (dropped, or ``__``)."""
    name_at = rel.rfind("/") + 1
    i = rel.rfind(".")
    if i <= name_at:
        return rel
    if rel[name_at:i].strip("."):
        return rel[:i]
    return _safe_key(rel[:i])


def expand_inputs(inputs: list[str | os.PathLike], *, missing: list | None = None) -> list[InputItem]:
    """Expand ``inputs`` (files, directories, globs, ``.jsonl`` manifests) in order.

    Directories are walked recursively (sorted, symlinked folders not followed) and
    keep files with an audio extension (:data:`AUDIO_EXTENSIONS`); a file named
    directly is kept whatever its extension (the job then reports it if it is not
    audio). A path given twice is kept once (first occurrence).

    Returns:
        list of :class:`InputItem` with unique ``key`` values.
    Args:
        missing: if given, an input that does not exist (or a glob with no match) is appended
            to it as an :class:`InputError` (its ``input``: the input as given) and the others
            are still expanded; otherwise the first such input raises.
        Folders that cannot be listed and inputs behind a folder that cannot be searched are
        reported the same way (code ``unreadable_input``).
    Raises:
        InputError(code="input_not_found"): a path that does not exist or a glob with no match
            (only when ``missing`` is None); InputError(code="unreadable_input"): permission denied.
    """

    def _missing(err: InputError) -> None:
        if missing is None:
            raise err
        missing.append(err)

    items: list[InputItem] = []
    for raw in inputs:
        s = os.fspath(raw)

        def _missing_of(err: InputError, s: str = s) -> None:
            err.input = s  # the input as the user gave it (JSON Lines name it as the failed input's path)
            _missing(err)

        try:
            _expand_one(s, items, _missing_of)
        except PermissionError as e:  # a parent folder that cannot be searched
            _missing_of(InputError(f"permission denied ({e.filename or s})", code="unreadable_input", input=s))
    # De-duplicate by absolute path.
    seen: set[str] = set()  # absolute, normalised paths: equal strings <=> equal paths (cheaper to hash)
    uniq = []
    for it in items:
        s = str(it.path)
        if s in seen:
            continue
        seen.add(s)
        uniq.append(it)
    return _dedupe_keys(uniq)


def _expand_one(s: str, items: list[InputItem], _missing) -> None:
    """Expand one input into ``items`` (see :func:`expand_inputs`)."""
    p = Path(s).expanduser()
    if p.is_dir():
        unreadable: list[OSError] = []
        top = os.fspath(p)
        cut = len(os.path.join(top, ""))  # the walked paths start with the folder and one separator
        for f in _walk_dir(p, unreadable):
            rel = f[cut:] if os.sep == "/" else f[cut:].replace(os.sep, "/")
            # shown as pathlib shows it (Path(".") / "a.wav" is "a.wav", not "./a.wav")
            items.append(InputItem(path=Path(os.path.abspath(f)), key=_walked_key(rel),
                                   display=f[cut:] if top == "." else f))
        for e in unreadable:
            _missing(InputError(f"folder {e.filename or s!r}: cannot be listed ({e.strerror or e}); its files "
                                "were not transcribed", code="unreadable_input"))
    elif p.is_file() and p.suffix.lower() in MANIFEST_EXTENSIONS:
        items.extend(read_manifest(p))
    elif p.exists() or p.is_symlink():
        items.append(InputItem(path=Path(os.path.abspath(p)), key=_safe_key(_strip_ext(p.name)), display=s))
    elif _has_magic(s):
        matches = sorted(glob.glob(os.path.expanduser(s), recursive=True))
        if not matches:
            _missing(InputError("the pattern matches no file", code="input_not_found", input=s))
            return
        # Base = the longest leading part of the pattern without wildcards.
        parts = Path(os.path.expanduser(s)).parts
        base_parts = []
        for part in parts:
            if _has_magic(part):
                break
            base_parts.append(part)
        base = Path(*base_parts) if base_parts else Path(".")
        for m in matches:
            mp = Path(m)
            if mp.is_dir():
                continue
            if not _is_audio(mp):
                continue
            try:
                rel = mp.relative_to(base).as_posix()
            except ValueError:
                rel = mp.name
            items.append(InputItem(path=Path(os.path.abspath(mp)), key=_safe_key(_strip_ext(rel)),
                                   display=m))
    else:
        _missing(InputError("no such file or directory", code="input_not_found", input=s))


def _dedupe_keys(items: list[InputItem]) -> list[InputItem]:
    """Give colliding output keys a ``-<hash8>`` suffix (case-insensitive collisions too)."""
    by_key: dict[str, list[InputItem]] = {}
    for it in items:
        by_key.setdefault(it.key.lower(), []).append(it)
    for group in by_key.values():
        if len(group) > 1:
            for it in group:
                h = hashlib.sha1(str(it.path).encode("utf-8", "surrogateescape")).hexdigest()[:8]
                it.key = f"{it.key}-{h}"
    return items
