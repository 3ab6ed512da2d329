"""Keep freed memory in the process on CPU: glibc malloc settings for training loops.

A training step allocates and frees the same large buffers every step (FSDP2's
gathered parameters and flat gradient buffers, ~14 MB per SmolLM2 layer). glibc
serves blocks above its mmap threshold with fresh mmaps and returns freed heap
memory to the system, so each step page-faults all of it in again; on the
development VM that was ~12% of a 1-thread actor update (1.95 s -> 1.69 s median
for 4 x 77 tokens; bench notes in BENCHMARKS.md). Raising the threshold to glibc's
maximum (32 MiB on 64-bit) and never trimming keeps those blocks for reuse; peak
memory is unchanged, it is just not handed back between steps.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 * 2**20
_applied = False


def keep_freed_memory() -> bool:
    """Apply the settings once per process; False where libc is not glibc (nothing changed)."""
    global _applied
    if _applied:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others have no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _applied = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    return _applied


def release_freed_memory() -> bool:
    """Hand the heap's free memory back to the system once (glibc `malloc_trim`): after dropping a one-off
    allocation that `keep_freed_memory` would otherwise keep resident. False where libc is not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):  # musl and others have no malloc_trim
        return False
