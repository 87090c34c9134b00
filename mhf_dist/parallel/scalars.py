"""Collectives on the run's own bookkeeping: stop and save decisions, logged losses, the measured peak, and the
host-side buffers kept outside DeepSpeed (the offloaded Engram tables' gradients and row masks).

``ScalarCollectives`` is the one place that builds such tensors, since NCCL moves only device tensors and gloo only
host ones: it takes Python numbers or any tensor, moves them to the process group's communication device
(``communication_device``) and hands Python numbers back. Its ``*_tensor`` methods reduce without reading, and
``ScalarCollectives.read`` brings any number of such results to the host in one transfer. Why, and what a step
reads: docs/design-training.md, "Host syncs".
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

    @property
    def _pin(self) -> bool:
        """Host values are staged in pinned memory, so their copy to the device does not block the host."""
        return self.device.type == "cuda"

    def _tensor(self, values: torch.Tensor | Sequence[float]) -> torch.Tensor:
        """``values`` as a new float64 vector on the communication device: tensors already on a device are copied
        there directly, host values go through pinned memory on CUDA."""
        if torch.is_tensor(values):
            values = values.detach().reshape(-1)
            if not (self._pin and values.device.type == "cpu"):
                return values.to(self.device, torch.float64, copy=True)
            staged = torch.empty(values.shape, dtype=torch.float64, pin_memory=True)
            staged.copy_(values)
        else:
            staged = torch.tensor(list(values), dtype=torch.float64, pin_memory=self._pin)
        return staged.to(self.device, non_blocking=True, copy=True)

    # ------------------------------------------------------------------ reductions that stay on the device
    def sum_tensor(self, values: torch.Tensor | Sequence[float], group=None) -> torch.Tensor:
        """Element-wise sum over the ranks of ``group`` (default: all), left on the communication device (float64):
        read it with ``read``."""
        t = self._tensor(values)
        dist.all_reduce(t, group=group)
        return t

    def mean_tensor(self, values: torch.Tensor | Sequence[float], group=None) -> torch.Tensor:
        """Element-wise mean over the ranks of ``group``, left on the communication device (float64)."""
        return self.sum_tensor(values, group).div_(dist.get_world_size(group))

    def max_tensor(self, values: torch.Tensor | Sequence[float], group=None) -> torch.Tensor:
        """Element-wise maximum over the ranks of ``group`` (default: all), left on the communication device
        (float64)."""
        t = self._tensor(values)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return t

    def any_tensor(self, *flags: bool) -> torch.Tensor:
        """Each flag raised on any rank (1.0, else 0.0), left on the communication device (float64)."""
        return self.max_tensor([float(f) for f in flags])

    def read(self, *parts: torch.Tensor) -> list[float]:
        """The elements of ``parts`` (tensors anywhere, e.g. the results above and device scalars), in order, as
        Python numbers: one transfer to the host, so one wait for the device."""
        return torch.cat(
            [p.detach().reshape(-1).to(self.device, torch.float64) for p in parts]
        ).tolist()

    # ------------------------------------------------------------------ reductions read at once
    def any(self, *flags: bool) -> list[bool]:
        """Each flag raised on any rank, in order: the same decisions on every rank."""
        return [bool(v) for v in self.read(self.any_tensor(*flags))]

    def from_rank0(self, value: float) -> float:
        """Rank 0's ``value`` on every rank (a measurement made once)."""
        t = self._tensor([value])
        dist.broadcast(t, src=0)
        return t.item()

    def sum(self, values: torch.Tensor | Sequence[float], group=None) -> list[float]:
        """Element-wise sum over the ranks of ``group`` (default: all)."""
        return self.read(self.sum_tensor(values, group))

    def mean(self, values: torch.Tensor | Sequence[float], group=None) -> list[float]:
        """Element-wise mean over the ranks of ``group`` (default: all)."""
        return [v / dist.get_world_size(group) for v in self.sum(values, group)]

    # ------------------------------------------------------------------ host buffers, in place
    def mean_into(self, tensor: torch.Tensor, group=None, chunk: int = 1 << 24) -> None:
        """``tensor`` (a contiguous host buffer, e.g. gradients kept outside DeepSpeed) <- its element-wise mean over
        the ranks of ``group``, sent through the communication device ``chunk`` elements at a time."""
        self._reduce_into(tensor, group, chunk, dist.ReduceOp.SUM, dist.get_world_size(group))

    def max_into(self, tensor: torch.Tensor, group=None, chunk: int = 1 << 24) -> None:
        """``tensor`` (a contiguous host buffer; bool or uint8 for a mask: one byte an element on the wire) <- its
        element-wise maximum over the ranks of ``group``, ``chunk`` elements at a time."""
        if (
            tensor.dtype == torch.bool
        ):  # no collective reduces bool: the same bytes as uint8 (0 or 1)
            tensor = tensor.view(torch.uint8)
        self._reduce_into(tensor, group, chunk, dist.ReduceOp.MAX, 1)

    def _reduce_into(self, tensor: torch.Tensor, group, chunk: int, op, divisor: int) -> None:
        flat = tensor.view(-1)
        if (
            self.device.type != "cuda"
        ):  # gloo: the host tensor is the communication buffer's source and target
            for start in range(0, flat.numel(), chunk):
                part = flat[start : start + chunk]
                buf = part.to(self.device, copy=True)
                dist.all_reduce(buf, op=op, group=group)
                part.copy_(buf)
                if divisor != 1:
                    part.div_(divisor)
            return
        # CUDA: each chunk goes host -> pinned staging buffer -> device, is reduced (and divided) there and comes back
        # the same way. Two staging and two device buffers alternate, all copies on the current stream without
        # blocking, so chunk k+1 is staged on the host while chunk k moves and reduces; the host waits for a chunk's
        # event only to take its result out of the staging buffer it is about to reuse (and at the end).
        size = min(chunk, flat.numel())
        staging = [torch.empty(size, dtype=flat.dtype, pin_memory=True) for _ in range(2)]
        on_device = [torch.empty(size, dtype=flat.dtype, device=self.device) for _ in range(2)]
        waiting: list[tuple[torch.Tensor, torch.cuda.Event] | None] = [None, None]

        def take(slot: int) -> None:
            if waiting[slot] is not None:
                part, done = waiting[slot]
                done.synchronize()
                part.copy_(staging[slot][: part.numel()])
                waiting[slot] = None

        for k, start in enumerate(range(0, flat.numel(), chunk)):
            slot = k % 2
            take(slot)
            part = flat[start : start + chunk]
            host, buf = staging[slot][: part.numel()], on_device[slot][: part.numel()]
            host.copy_(part)
            buf.copy_(host, non_blocking=True)
            dist.all_reduce(buf, op=op, group=group)
            if divisor != 1:
                buf.div_(divisor)
            host.copy_(buf, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            waiting[slot] = (part, done)
        take(0)
        take(1)
