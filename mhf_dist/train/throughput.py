"""Throughput, MFU and memory for logging and profiling.

MFU = achieved model FLOP/s (analytic, ``mhf_dist.model.flops``) / peak.
The peak is ``train.peak_tflops`` per device × devices when given, else
measured in the run's dtype with a timed large matmul: per GPU × world size,
or on CPU the per-rank measurement × the ranks that can run at once
(``cpu_count // threads per rank``), since CPU ranks share one machine.
"""

from __future__ import annotations

import os
import resource
import time

import torch


def measured_peak_flops(
    device: torch.device, dtype: torch.dtype, n: int | None = None, repeats: int = 5
) -> float:
    """FLOP/s of the best of ``repeats`` timed ``n×n`` matmuls on this rank (``n`` = 8192 on a GPU, where a
    smaller product is too short to reach the matrix units' rate; 1024 on CPU, which reaches a core's rate there in
    a tenth of 2048's time, a cost every rank pays at each start)."""
    n = n or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    a @ b
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def total_peak_flops(
    per_device_tflops: float | None, device: torch.device, dtype: torch.dtype, world: int
) -> float:
    """The peak FLOP/s of all ranks together (see module docstring)."""
    if per_device_tflops is not None:
        return per_device_tflops * 1e12 * world
    per_rank = measured_peak_flops(device, dtype)
    if device.type == "cuda":
        return per_rank * world
    return per_rank * max(1, min(world, (os.cpu_count() or 1) // torch.get_num_threads()))


def restart_peak_memory(device: torch.device) -> None:
    """Start this rank's peak memory (``memory_gb``) afresh from what it holds now, so that it is the steps'
    own: CUDA's peak allocated, or on CPU the process's peak resident memory (``VmHWM``; where the kernel refuses
    the restart, the peak keeps what came before)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        reset_host_peak()


def memory_gb(device: torch.device) -> float:
    """This rank's peak memory since it started or since ``restart_peak_memory``: CUDA max allocated, or on CPU
    the peak resident memory (the process's max RSS where ``/proc`` has no ``VmHWM``)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        return host_peak_bytes() / 2**30
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _status_bytes(field: str) -> int:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in bytes (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/self/status has no {field}")


def host_rss_bytes() -> int:
    """This process's resident memory now."""
    return _status_bytes("VmRSS")


def host_peak_bytes() -> int:
    """This process's peak resident memory since it started or since ``reset_host_peak``."""
    return _status_bytes("VmHWM")


def reset_host_peak() -> bool:
    """Restart the peak (``VmHWM``) from the present resident memory (Linux ≥ 4.0); False where that is refused,
    and the peak then also covers what came before."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
