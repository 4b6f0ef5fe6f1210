"""Process-wide memory habits of a worker: how freed memory is kept, how the heap is scanned.

Two defaults of CPython/glibc cost an engine step on the CPU, measured on the light model
(128 prompts of 128 tokens, 64 new tokens each, one thread): each about a tenth of the run.

* glibc serves large allocations (above a threshold that grows to at most 32 MiB) with a
  fresh ``mmap`` and returns them to the kernel on free; a prefill step's activations
  (``tokens x intermediate`` floats, 32 MiB for 4096 tokens of a 2048-wide gate/up GEMM) are
  such blocks, so every step page-faults its working memory in again (zeroed by the kernel).
  :func:`keep_freed_memory` raises the mmap and trim thresholds so freed blocks stay in the
  heap and the next step reuses them: the peak activation memory stays resident, which a
  worker needs again at the next step anyway. An operator's ``MALLOC_MMAP_THRESHOLD_`` /
  ``MALLOC_TRIM_THRESHOLD_`` win; other C libraries are left alone.
* CPython's cyclic collector occasionally scans the whole heap (every object of torch, the
  tokenizer, the model): ~150 ms of one step's time, at a moment set by allocation counts.
  The executor freezes the loaded model out of it (``kvstore/runtime/pauses.py``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # mallopt parameters (glibc malloc.h)
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 30  # blocks below 1 GiB come from the heap (reused when freed)
TRIM_THRESHOLD = 1 << 30  # up to 1 GiB of free heap top is kept for the next step

_kept = False


def keep_freed_memory() -> bool:
    """Keep freed large blocks for reuse (glibc only; once per process). True if set."""
    global _kept
    if _kept:
        return True
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False  # the operator chose
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False  # not glibc (musl, macOS): nothing to tune
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    if not ok:
        log.info("mallopt refused the worker's thresholds; allocations stay as they were")
    _kept = ok
    return ok
