"""How a CPU rank's host allocator treats the memory a step frees: kept for the next step (glibc's ``malloc``
told neither to map large blocks on their own nor to hand freed memory back), so a step's buffers are not faulted
in afresh every step. Why, and what it measured: docs/design-training.md, "CPU ranks keep the memory a step
frees"."""

from __future__ import annotations

import ctypes

import torch

# mallopt(3) parameters
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4


def keep_freed_host_memory(device: torch.device) -> bool:
    """On a CPU rank, make glibc's ``malloc`` serve every block from its heap and never trim it, from now on in
    this process (and the processes it forks); True when set. A no-op (False) on a GPU rank, whose step's memory
    is the GPU allocator's, and where the C library is not glibc."""
    if device.type != "cpu":
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    # (mallopt returns 1 on success; -1 as the trim threshold disables trimming)
    return mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, -1) == 1
