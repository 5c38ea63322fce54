"""How a CPU process's memory allocator treats freed tensors.

glibc's ``malloc`` serves large blocks (above its mmap threshold, 128 KiB to 32 MiB as it adapts) with
fresh pages from the OS and gives them back on ``free``: each training step then page-faults its
activations, gradients and logits anew (on SmolLM2-135M, about half a million faults per update step
of 32 sequences, 10% of its forward and backward; docs/benchmarks.md). ``keep_freed_memory`` has it
serve them from the heap and keep what is freed there for the next step, as jemalloc and tcmalloc do;
the process's resident memory then stays at its peak instead of falling between phases.
"""

from __future__ import annotations

import ctypes
import sys

#: ``mallopt`` parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: Blocks at least this large still come from ``mmap`` (a whole model's weights, say): served from
#: the heap, one would stay there after it is freed.
MMAP_THRESHOLD_BYTES = 1 << 30
#: Free memory at the heap's top is never given back (the largest value ``mallopt`` takes).
TRIM_THRESHOLD_BYTES = (1 << 31) - 1


def keep_freed_memory() -> bool:
    """Make this process's ``malloc`` keep freed memory for reuse (both thresholds above). Returns
    whether it did: ``False`` where the C library is not glibc (musl's ``mallopt`` ignores these
    settings; other systems have none)."""
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )


def _glibc() -> ctypes.CDLL | None:
    """This process's C library where it is glibc on Linux (it defines ``gnu_get_libc_version``)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") else None
