"""Process memory: keep glibc's allocator from holding freed large buffers in the heap.

glibc serves an allocation above its mmap threshold (128 KiB to start) with its own mapping,
returned to the system when freed; but each such free raises the threshold to the freed size
(up to 32 MiB), so later buffers of that size come from the heap, whose freed space the process
keeps. A model thread that allocates tensors of many sizes on the CPU then grows the heap batch by
batch: a 10-hour Ogg/Opus file through ``flashasr transcribe`` (the tiny Parakeet fixture on the
2-core VM) peaked at 4.03 GiB resident, 1.3 GiB of it heap growth while the model ran (the
decoded samples are 2.3 GiB); with the threshold fixed at 1 MiB, 3.01 GiB (128 KiB: 3.03 GiB),
wall time 180 -> 190 s. Follows glibc's ``mallopt(3)`` (``M_MMAP_THRESHOLD``: setting it turns
the dynamic adjustment off).
"""

from __future__ import annotations

import ctypes
import os
import sys

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MMAP_THRESHOLD_BYTES = 1 << 20


def pin_mmap_threshold(nbytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at ``nbytes`` for this process (see the module docstring).

    Returns True when set; False off Linux/glibc (musl has no ``mallopt``) or when the user set
    ``MALLOC_MMAP_THRESHOLD_`` (glibc's own variable wins). Never raises."""
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        return bool(ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, int(nbytes)))
    except (OSError, AttributeError, TypeError):
        return False


__all__ = ["pin_mmap_threshold", "MMAP_THRESHOLD_BYTES"]
