"""The clocks of the profiler: elapsed time of a region (CUDA events on GPUs, wall clock on CPU)."""

from __future__ import annotations

import time

import torch


class Timer:
    """Elapsed seconds of a region: CUDA events on GPUs, wall clock on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
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
