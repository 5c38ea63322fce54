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
    whether it did: ``False`` off Linux or where the C library has no glibc ``mallopt`` (musl's ignores
    these settings)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    if not _is_glibc():
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )


def _is_glibc() -> bool:
    try:
        ctypes.CDLL(None).gnu_get_libc_version  # noqa: B018 (a lookup: glibc defines it, musl not)
    except AttributeError:
        return False
    return True
