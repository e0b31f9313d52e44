"""Process-level memory settings for CPU training (no torch needed)."""

from __future__ import annotations

import os
import sys

# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
# The largest mmap threshold glibc accepts (HEAP_MAX_SIZE / 2 on 64-bit): blocks below it come from the heap.
_MMAP_THRESHOLD_MAX = 32 * 2**20
_ALLOCATOR_ENVIRONMENT = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")


def retain_freed_memory() -> bool:
    """Make glibc's allocator keep the memory a training step frees, for the next step to reuse.

    By default glibc returns the top of its heap to the system once more than a few tens of MB
    are free there (the trim threshold), and serves blocks above a moving threshold with their own
    `mmap`. A CPU training step frees all its activations at the end, so the next step gets fresh
    pages and pays a page fault on the first touch of each 4 KiB of them. On a virtual machine
    those faults cost 0-8% of the training scripts' throughput for d=256 models and up to ~15% of
    a step for 512-wide ones (docs/benchmarks.md, "Training scripts").
    This sets the trim threshold to 2 GiB and the mmap threshold to its maximum (32 MiB), so the
    process keeps its peak memory instead (it is a training process: the peak comes back every
    step). Returns whether it applied: only on Linux with glibc, and not when the user set
    `MALLOC_TRIM_THRESHOLD_` or `MALLOC_MMAP_THRESHOLD_` (theirs wins). Process-wide: the training
    scripts call it (`--cpu_allocator retain`, their default); the library never does on its own.
    In your own loop (or under transformers' Trainer) call `hf_zformer.retain_freed_memory()` once
    before training."""
    if not sys.platform.startswith("linux") or any(name in os.environ for name in _ALLOCATOR_ENVIRONMENT):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, ...)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
