"""A slow device made visible. A rank's compute time per step (``mhf_dist.train.stragglers``) is its training
thread's CPU time: on a GPU rank that is the host's share of the step, so a device that computes slower than the
others (clocks throttled by heat or power, a degraded part) hides in the time every rank then spends waiting for it.
The probe times the same fixed work on every rank's device once per log interval: a chain of matrix products in the
run's dtype, on an idle device (it waits for the device before and after), timed by the device's own events. Same
work, same device model: the ranks' times differ only by their devices' speed. Probe and waits cost the device an
estimated millisecond per log interval in bf16 on an H100 (10 ms in fp32; gpu-check reports the measured time).

On a CPU device the products are timed by the training thread's CPU time (the device is the host; its OpenMP
workers take equal shares), as the compute time is."""

from __future__ import annotations

import time

import torch

from mhf_dist.train.fault_injection import slow_device_repeats

# (matrix size, products): 0.55 TFLOP on a GPU (an estimated 1 ms on an H100 in bf16, 10 ms in fp32: long beside the
# events' resolution of a microsecond), 0.27 GFLOP on a CPU (3 ms on a 2-core VM)
GPU_WORK, CPU_WORK = (2048, 32), (256, 8)


class DeviceProbe:
    """The seconds ``device`` takes for the fixed chain of products, in ``dtype``."""

    def __init__(self, device: torch.device, dtype: torch.dtype, rank: int):
        self.device, self.dtype, self.rank = device, dtype, rank
        self.gpu = device.type == "cuda"  # ROCm's GPUs are cuda devices to torch too
        self.n, self.products = GPU_WORK if self.gpu else CPU_WORK
        self.measure()  # the first product picks its kernel (cuBLAS/hipBLASLt heuristics): not part of a measure

    def measure(self) -> float:
        """The device's seconds for the chain (under the fault injection, a slower device's). Its matrices are made
        for the measure and freed after it: between measures the probe holds no device memory."""
        products = slow_device_repeats(self.rank, self.products)
        # a @ a is a again
        a = torch.full((self.n, self.n), 1 / self.n, device=self.device, dtype=self.dtype)
        out = torch.empty_like(a)
        if self.gpu:
            # the products' stream, whichever device is current
            stream = torch.cuda.current_stream(self.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            # an idle device: no other stream's work shares it with the probe
            torch.cuda.synchronize(self.device)
            start.record(stream)
        began = time.thread_time()
        for _ in range(products):
            torch.matmul(a, a, out=out)
        if not self.gpu:
            return time.thread_time() - began
        end.record(stream)
        end.synchronize()
        return start.elapsed_time(end) / 1000
