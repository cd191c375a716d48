"""Host memory: keep freed activation buffers in the process instead of returning them to the kernel.

PyTorch's CPU tensors come from glibc ``malloc``. By default glibc serves blocks above a dynamic threshold with a
fresh ``mmap`` and gives them back with ``munmap`` when freed, and trims the heap top back to the kernel. A training
step frees and re-allocates the same activation buffers every step, so each step faults every page of them in again
and the kernel zeroes each page first; once the memory is kept, the pages stay mapped and the step faults next to
none (``scripts/bench_train.py`` reports the faults per step; docs/benchmarks.md, "Host-side fixes on the CPU", has
the figures). This is what jemalloc/tcmalloc preloading does for CPU PyTorch; ``mallopt`` does it in-process.

Nothing changes numerically. The cost is that up to ``trim_threshold`` bytes of freed memory stay with the process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

__all__ = ["tune_malloc"]

log = logging.getLogger(__name__)

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3

MIB = 1 << 20
# glibc refuses an mmap threshold above HEAP_MAX_SIZE / 2 (32 MiB on 64-bit); blocks above it are always mmap'd.
MAX_MMAP_THRESHOLD = 32 * MIB

_applied: tuple[int, int, int] | None = None


def tune_malloc(
    mmap_threshold: int = MAX_MMAP_THRESHOLD, trim_threshold: int = 1024 * MIB, top_pad: int = 64 * MIB
) -> bool:
    """Make glibc keep freed memory for reuse (process-wide; idempotent).

    Args:
        mmap_threshold: Blocks at least this large get their own ``mmap`` (capped at glibc's 32 MiB maximum).
        trim_threshold: Free memory at the heap top kept before trimming it back to the kernel.
        top_pad: Extra memory requested from the kernel each time the heap grows.

    Returns:
        True if glibc took the settings (now or earlier), False where the C library is not glibc (macOS, musl,
        Windows): there the call is a no-op.
    """
    global _applied
    settings = (min(int(mmap_threshold), MAX_MMAP_THRESHOLD), int(trim_threshold), int(top_pad))
    if _applied == settings:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 - raises AttributeError on a C library that is not glibc
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = all(
        mallopt(param, value) == 1
        for param, value in zip((_M_MMAP_THRESHOLD, _M_TRIM_THRESHOLD, _M_TOP_PAD), settings, strict=True)
    )
    if ok:
        _applied = settings
    else:
        log.warning("yolo5l.base.hostmem: glibc mallopt refused %s; host memory is not kept between steps", settings)
    return ok
