"""Host memory: large blocks freed in one step stay with the process for the next, instead of going back to the OS.

glibc's malloc serves a block above its mmap threshold (which adapts, up to 32 MiB) with a fresh mmap and unmaps it
when freed, so the next step's block of that size faults every page in again. A training step on a CPU frees and
reallocates such blocks every time (an embedding's dense gradient: 30,522 x 384 fp32 = 47 MB for the default model):
43,000 minor page faults a step in the default job, a tenth of its step time (docs/benchmarks.md). With both the
mmap and the trim threshold at 1 GiB, blocks up to that size come from the heap and stay there once freed, and the
next step reuses them, as PyTorch's caching allocator does on a GPU and jemalloc or tcmalloc (Intel's advice for
CPU training) do on the host. The process keeps what it freed, up to its peak, which it reaches again every step.

Left as it is where the user set glibc's malloc tunables, or where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import os
import platform

KEPT_BLOCK_BYTES = 1 << 30
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters, from glibc's malloc.h
USER_TUNABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")


def keep_freed_memory() -> bool:
    """Raise glibc malloc's mmap and trim thresholds to 1 GiB for this process. Returns whether it did."""
    if any(name in os.environ for name in USER_TUNABLES) or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    # Each returns 1 on success; the trim threshold first, so that no heap top is trimmed between the two calls.
    return mallopt(_M_TRIM_THRESHOLD, KEPT_BLOCK_BYTES) == 1 and mallopt(_M_MMAP_THRESHOLD, KEPT_BLOCK_BYTES) == 1
