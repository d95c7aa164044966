"""Process-wide settings for the CPU paths: keep freed memory in the process (glibc ``mallopt``).

PyTorch's CPU allocator takes every tensor from ``malloc`` and returns it on release. With
glibc's defaults, large buffers come from fresh ``mmap`` calls and the top of the heap is trimmed
back to the operating system once enough of it is free, so a loop that allocates the same
activations, gradients and products every step faults their pages in again every step (with
transparent huge pages, each fault zeroes 2 MiB). The gain and its memory price are measured
by ``benchmarks/allocator_bench.py`` (``docs/benchmarks.md``).

:func:`keep_freed_memory` raises glibc's mmap and trim thresholds so freed buffers are reused;
the price is that up to ``limit`` bytes of freed memory stay with the process instead of going
back to the system while it runs. ``pfuse`` calls it at start-up; library users may call it
themselves. ``PFUSE_MALLOC=default`` keeps glibc's behaviour; elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

from posterior_fusion.choices import DEVICES
from posterior_fusion.environment import environment

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
DEFAULT_LIMIT = 1 << 30


def keep_freed_memory(limit: int = DEFAULT_LIMIT) -> bool:
    """Make glibc reuse freed buffers of up to ``limit`` bytes instead of unmapping them; returns
    whether the setting took effect (False off Linux/glibc or with ``PFUSE_MALLOC=default``)."""
    if environment("PFUSE_MALLOC") == "default" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other C libraries have no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    limit = max(0, min(int(limit), 2**31 - 1))  # mallopt takes a C int
    # older glibc refuses mmap thresholds above 32 MiB (HEAP_MAX_SIZE / 2 on 64-bit): larger buffers then still use mmap
    mmap_ok = mallopt(M_MMAP_THRESHOLD, limit) or mallopt(M_MMAP_THRESHOLD, min(limit, 1 << 25))
    return bool(mmap_ok and mallopt(M_TRIM_THRESHOLD, limit))


def release_freed_memory() -> bool:
    """Give the memory freed so far back to the operating system (glibc ``malloc_trim``); the
    phases whose buffers change size from batch to batch (the GLM predictive's Jacobians) call it
    so what :func:`keep_freed_memory` keeps never piles up beyond one batch. False where unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(trim(0))




def resolve_device(name: str, where: str = "`device`"):
    """The ``torch.device`` a ``device`` setting names: ``auto`` is CUDA where a GPU is visible, else
    the CPU; ``cuda`` without one is refused in one line."""
    import torch

    from posterior_fusion.errors import ConfigError

    if name not in DEVICES:
        raise ConfigError(f"{where} must be one of {', '.join(DEVICES)}, got {str(name)[:40]!r}")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise ConfigError(f"{where} cuda: no CUDA device is visible (torch {torch.__version__}, {build}); "
                          "use cpu or auto")
    return torch.device(name)
