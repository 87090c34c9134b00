"""The clocks of the profiler: elapsed time of a region (CUDA events on GPUs, wall clock on CPU)."""

from __future__ import annotations

import os
import platform
import time

import torch


class Timer:
    """Elapsed seconds of a region: CUDA events on GPUs, wall clock on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            self.start, self.end = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.end.record()
            torch.cuda.synchronize()
            self.seconds = self.start.elapsed_time(self.end) / 1000
        else:
            self.seconds = time.perf_counter() - self.t0


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a ``--dtype`` name (fp32, bf16)."""
    return torch.bfloat16 if name == "bf16" else torch.float32


def hardware_name(device: torch.device) -> str:
    """What the measurements ran on, for titles: the GPU's name, or the CPU's architecture and core count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.machine()} CPU, {os.cpu_count()} cores"
