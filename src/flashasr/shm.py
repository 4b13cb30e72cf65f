"""Shared-memory segments between the processes of one machine: audio crosses without pickling.

Segments are POSIX shared memory named ``flashasr_<creator pid>_<n>`` (``/dev/shm`` on Linux),
created and opened without :mod:`multiprocessing`'s resource tracker (before Python 3.13 it
unlinks, at a process's exit, segments that process did not own). Owners unlink explicitly, and
:func:`cleanup_stale_segments` removes those whose creator died.

Two uses:

* the HTTP server's front ends send uploads to the engine process (:mod:`flashasr.serve.ipc`:
  pooled segments, reused);
* the job runner's decode workers hand decoded samples to the main process
  (:func:`put_array` in the worker, :func:`take_array` in the main process): one copy into the
  segment, then the main process maps it and unlinks the name at once, so the memory lives exactly
  as long as the array that maps it (nothing to leak if the main process dies later). When the
  job's model runs in a process of its own (:class:`flashasr.pipeline.model_process.ModelProcess`)
  the name is kept until the file is done, and the model process maps the same memory
  (:func:`shared_location`): the samples cross twice with no copy. Before, the
  samples were pickled through the pool's pipe: four copies, and the unpickling held the main
  process's GIL -- 4.3 CPU-s for 12 h of audio on the H200 machine, in the process that feeds the
  GPU (``bench/results/profile_jobs_h200_modelthread.json``).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import logging
import mmap
import os
import threading

import numpy as np

SHM_PREFIX = "flashasr_"
log = logging.getLogger(__name__)
_ids = itertools.count(1)


def new_name() -> str:
    """A fresh segment name of this process: ``flashasr_<pid>_p<parent pid>_<n>`` (the parent: the
    job or server whose worker made it, see :func:`cleanup_stale_segments`)."""
    return f"{SHM_PREFIX}{os.getpid()}_p{os.getppid()}_{next(_ids)}"


def unregister(name: str) -> None:
    """Take a segment out of :mod:`multiprocessing`'s resource tracker (see the module docstring)."""
    try:
        from multiprocessing import resource_tracker

        resource_tracker.unregister("/" + name.lstrip("/"), "shared_memory")
    except Exception:  # pragma: no cover
        pass


def create_segment(size: int):
    """A new :class:`multiprocessing.shared_memory.SharedMemory` of ``size`` bytes, untracked."""
    from multiprocessing import shared_memory

    shm = shared_memory.SharedMemory(name=new_name(), create=True, size=max(1, size))
    unregister(shm.name)
    return shm


def open_segment(name: str):
    """An existing segment as :class:`~multiprocessing.shared_memory.SharedMemory`, untracked."""
    from multiprocessing import shared_memory

    shm = shared_memory.SharedMemory(name=name)
    unregister(shm.name)
    return shm


def unlink_segment(name: str) -> None:
    """Remove a segment's name; a missing one is fine (the memory goes once nothing maps it)."""
    try:
        import _posixshmem

        _posixshmem.shm_unlink("/" + name.lstrip("/"))
    except FileNotFoundError:
        pass


def cleanup_stale_segments() -> int:
    """Unlink ``/dev/shm/flashasr_*`` segments whose creating process and its parent are both
    gone; returns the count. A segment made by a decode worker that died while its job runs on is
    kept: that job may still hold its samples (a job's model process maps them by name)."""
    n = 0
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return 0
    for name in names:
        if not name.startswith(SHM_PREFIX):
            continue
        parts = name[len(SHM_PREFIX):].split("_")
        try:
            pids = [int(parts[0])] + ([int(parts[1][1:])] if len(parts) > 2 and parts[1][:1] == "p" else [])
        except ValueError:
            continue
        if not any(_alive(p) for p in pids):
            unlink_segment(name)
            n += 1
    return n


def unlink_segments_of(pid: int) -> int:
    """Unlink every ``/dev/shm/flashasr_<pid>_*`` segment (the process ``pid`` is gone and nobody
    needs its segments: a server's front-end worker, whose parent -- the server -- lives on, so
    :func:`cleanup_stale_segments` keeps them); returns the count. A process that still maps one
    keeps its memory until it unmaps it (POSIX)."""
    head = f"{SHM_PREFIX}{int(pid)}_"
    try:
        names = [n for n in os.listdir("/dev/shm") if n.startswith(head)]
    except OSError:
        return 0
    for name in names:
        unlink_segment(name)
    return len(names)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


_MADV_POPULATE_READ = 22  # Linux >= 5.14 (<linux/mman.h>); not named by the mmap module of the Pythons we run
_populate_failure_logged = False


@functools.lru_cache(maxsize=1)
def _madvise():
    """libc's ``madvise`` through ctypes (a foreign call drops the GIL), or None where there is none."""
    try:
        import ctypes

        f = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError, TypeError):  # no POSIX C library here
        return None
    f.argtypes, f.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int
    return f


def populate(m: mmap.mmap) -> bool:
    """Fault in every page of the mapping ``m`` for reading, with the GIL released: libc's
    ``madvise(MADV_POPULATE_READ)`` called through ctypes.

    ``mmap.mmap(..., flags=MAP_POPULATE)`` does the same work inside the ``mmap`` call, which
    CPython makes holding the GIL: in a process whose other thread launches the model's work (the
    job's model process maps the next call's samples while the current call runs) or routes files
    (the job's main process), every page mapped stalled that thread (``bench/bench_populate.py``: on
    the dev VM another thread waited up to 9.9 ms at p99 beside 64 MB maps, 0.17 ms with this).

    Returns False where the platform or kernel lacks it (not Linux, a kernel before 5.14; logged
    once): the pages then fault in on their first touch, as without populating."""
    madvise = _madvise()
    if madvise is None or len(m) == 0:
        return False
    address = np.frombuffer(m, np.uint8).ctypes.data  # read-only mappings too (ctypes' from_buffer needs writable)
    if madvise(address, len(m), _MADV_POPULATE_READ) == 0:
        return True
    global _populate_failure_logged
    if not _populate_failure_logged:
        import ctypes

        _populate_failure_logged = True
        log.debug("madvise(MADV_POPULATE_READ) failed (errno %d): pages of shared samples fault in on first "
                  "touch", ctypes.get_errno())
    return False


def put_array(a: np.ndarray) -> tuple[str, str, int]:
    """Copy a 1-D array into a new segment; returns ``(name, dtype, length)`` for :func:`take_array`.

    The segment belongs to whoever takes it; this process keeps no mapping.
    """
    a = np.ascontiguousarray(a).reshape(-1)
    import _posixshmem

    name = new_name()
    fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
    try:
        size = max(1, a.nbytes)
        os.ftruncate(fd, size)
        with mmap.mmap(fd, size) as m:
            np.frombuffer(m, a.dtype, count=a.size)[:] = a
    except BaseException:
        os.close(fd)
        unlink_segment(name)
        raise
    os.close(fd)
    return name, a.dtype.str, int(a.size)


def take_array(name: str, dtype: str, length: int, *, keep_for: object = None) -> np.ndarray:
    """Map a segment made by :func:`put_array` as a writable 1-D array and unlink its name at once.

    The memory lives as long as the returned array (and the views of it); nothing to close.
    ``keep_for``: keep the name instead (another process of this machine may then map the same
    memory: :func:`shared_location`, the model process of a job), registered under this owner
    until :func:`release` (the array's file is done) or :func:`release_owner` (the owner's end).

    Raises:
        FileNotFoundError: no such segment (already taken, or never made).
    """
    import _posixshmem

    dt = np.dtype(dtype)
    fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    try:
        size = max(1, dt.itemsize * int(length))
        m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
        if keep_for is None:
            unlink_segment(name)
    if keep_for is None:
        # every page mapped now, with the GIL released (:func:`populate`): the first pass over the
        # samples (the model's check, the VAD) then takes no page faults (dev VM, 11 s of float32:
        # 98 us of mapping + 29 us for that first pass, against 55 + 173 us faulting page by page).
        # Not for a kept segment: the process that reads it is the model process (it maps the pages
        # itself); here only the VAD of a long file touches it (dev VM, a 10-minute file: 5.0 ms
        # with every page mapped here)
        populate(m)
    a = np.frombuffer(m, dt, count=int(length))
    if keep_for is not None:
        with _kept_lock:
            start = a.__array_interface__["data"][0]
            bisect.insort(_kept_starts, start)
            _kept[start] = (a.nbytes, name, keep_for)
    return a


# Segments whose names take_array kept: start address -> (bytes, name, owner); starts sorted
_kept: dict[int, tuple[int, str, object]] = {}
_kept_starts: list[int] = []
_kept_lock = threading.Lock()


def shared_location(a: np.ndarray) -> tuple[str, int] | None:
    """Where a C-contiguous array lies in a segment kept by :func:`take_array` (``keep_for``):
    ``(segment name, byte offset)``, so another process can map it without a copy; None for any
    other memory."""
    if not a.flags.c_contiguous:
        return None
    addr = a.__array_interface__["data"][0]
    with _kept_lock:
        k = bisect.bisect_right(_kept_starts, addr) - 1
        if k < 0:
            return None
        start = _kept_starts[k]
        nbytes, name, _owner = _kept[start]
    if addr + a.nbytes > start + max(nbytes, 1):
        return None
    return name, addr - start


def _forget(start: int) -> str:
    _nbytes, name, _owner = _kept.pop(start)
    del _kept_starts[bisect.bisect_left(_kept_starts, start)]
    return name


def release(a: np.ndarray) -> None:
    """Unlink the kept name of the segment that ``a`` (the array :func:`take_array` returned)
    maps; the memory goes with the last mapping. Any other array: nothing happens."""
    if not _kept or not a.size:  # nothing kept (a job whose model runs here): no lookup
        return
    start = a.__array_interface__["data"][0]
    with _kept_lock:
        name = _forget(start) if start in _kept else None
    if name is not None:
        unlink_segment(name)


def release_owner(owner: object) -> int:
    """Unlink every name still kept for ``owner`` (its job ended, or was interrupted); returns the count."""
    with _kept_lock:
        names = [_forget(start) for start in [s for s, v in _kept.items() if v[2] is owner]]
    for name in names:
        unlink_segment(name)
    return len(names)


__all__ = ["SHM_PREFIX", "new_name", "unregister", "create_segment", "open_segment", "unlink_segment",
           "cleanup_stale_segments", "populate", "put_array", "take_array", "shared_location", "release", "release_owner"]
