"""Shared-memory segments (flashasr.shm): samples handed over whole, pages faulted in without the GIL."""

from __future__ import annotations

import mmap
import os
import sys

import numpy as np
import pytest

from flashasr import shm

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX shared memory as on Linux")


@linux
def test_take_array_gives_the_samples_and_unlinks_the_name():
    rng = np.random.default_rng(3)
    for n in (1, 4095, 176_000):
        a = rng.standard_normal(n).astype(np.float32)
        name, dtype, length = shm.put_array(a)
        b = shm.take_array(name, dtype, length)
        assert b.dtype == np.float32 and np.array_equal(a, b)
        assert not os.path.exists(f"/dev/shm/{name}")  # the name went at once; the memory lives with b
        with pytest.raises(FileNotFoundError):
            shm.take_array(name, dtype, length)


@linux
def test_populate_maps_read_only_and_writable_segments_and_falls_back(monkeypatch):
    import _posixshmem

    name = f"/flashasr_test_populate_{os.getpid()}"
    fd = _posixshmem.shm_open(name, os.O_CREAT | os.O_RDWR, mode=0o600)
    try:
        os.ftruncate(fd, 3 * mmap.PAGESIZE)
        with mmap.mmap(fd, 3 * mmap.PAGESIZE) as w:
            np.frombuffer(w, np.float32)[:] = 0.5
        ro = mmap.mmap(fd, 3 * mmap.PAGESIZE, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        assert shm.populate(ro) is True  # Linux >= 5.14: MADV_POPULATE_READ
        assert float(np.frombuffer(ro, np.float32).sum()) == 0.5 * 3 * mmap.PAGESIZE / 4
        # a kernel or C library without it: False, and the samples still arrive (faulted in on first touch)
        monkeypatch.setattr(shm, "_madvise", lambda: (lambda *a: -1))
        assert shm.populate(ro) is False
        monkeypatch.setattr(shm, "_madvise", lambda: None)
        assert shm.populate(ro) is False
        a = np.arange(5000, dtype=np.float32)
        assert np.array_equal(shm.take_array(*shm.put_array(a)), a)
        ro.close()
    finally:
        os.close(fd)
        _posixshmem.shm_unlink(name)
