"""Collectives on the run's own bookkeeping: stop and save decisions, logged losses, the measured peak.

NCCL (what DeepSpeed picks on GPUs, RCCL on ROCm) moves only CUDA tensors and
gloo only host ones, so a host tensor handed to ``dist.all_reduce`` works in a
CPU test and fails on the cluster ("No backend type associated with device
type cpu"). :class:`ScalarCollectives` is therefore the one place that builds
such tensors: it takes Python numbers or any tensor, moves them to the process
group's communication device and hands Python numbers back. Outside it, only
the model's tensor-parallel collectives (:mod:`mhf_dist.parallel.comm`, on
activations and gradients that already live on the device) call ``torch.distributed``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


def communication_device(backend: str) -> torch.device:
    """Where tensors must live for collectives over ``backend`` (``dist.get_backend()``): the current GPU for NCCL
    (alone or in a per-device mix such as ``cpu:gloo,cuda:nccl``), else the host."""
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class ScalarCollectives:
    """Small reductions of host-side values over the job's ranks (or a subgroup), on the communication device."""

    def __init__(self, device: torch.device | None = None):
        self.device = device if device is not None else communication_device(dist.get_backend())

    def _tensor(self, values: torch.Tensor | Sequence[float]) -> torch.Tensor:
        if torch.is_tensor(values):
            return values.detach().to(self.device, torch.float64, copy=True).reshape(-1)
        return torch.tensor(list(values), dtype=torch.float64, device=self.device)

    def any(self, *flags: bool) -> list[bool]:
        """Each flag raised on any rank, in order: the same decisions on every rank."""
        t = self._tensor([float(f) for f in flags])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [bool(v) for v in t.tolist()]

    def from_rank0(self, value: float) -> float:
        """Rank 0's ``value`` on every rank (a measurement made once)."""
        t = self._tensor([value])
        dist.broadcast(t, src=0)
        return t.item()

    def sum(self, values: torch.Tensor | Sequence[float], group=None) -> list[float]:
        """Element-wise sum over the ranks of ``group`` (default: all)."""
        t = self._tensor(values)
        dist.all_reduce(t, group=group)
        return t.tolist()

    def mean(self, values: torch.Tensor | Sequence[float], group=None) -> list[float]:
        """Element-wise mean over the ranks of ``group`` (default: all)."""
        return [v / dist.get_world_size(group) for v in self.sum(values, group)]

    def mean_into(self, tensor: torch.Tensor, group=None, chunk: int = 1 << 24) -> None:
        """``tensor`` (a host buffer, e.g. gradients kept outside DeepSpeed) <- its element-wise mean over the ranks
        of ``group``, sent through the communication device ``chunk`` elements at a time."""
        flat, size = tensor.view(-1), dist.get_world_size(group)
        for start in range(0, flat.numel(), chunk):
            part = flat[start:start + chunk]
            buf = part.to(self.device, copy=True)
            dist.all_reduce(buf, group=group)
            part.copy_(buf).div_(size)  # copy_ brings it back across devices
