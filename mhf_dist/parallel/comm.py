"""Tensor-parallel collectives with the right autograd, and byte accounting.

Megatron's conjugate pair: ``copy_to_tp`` (identity forward, all-reduce backward) where replicated values enter a
region each rank computes only part of, ``reduce_from_tp`` (all-reduce forward, identity backward) where partial
results leave it; ``all_reduce_max`` and ``all_reduce_sum`` carry no gradient. ``count_collectives`` records every
collective issued here (operation, phase, payload bytes: the tensor's size). Why each backward is right:
docs/design-model.md, "Tensor and pipeline parallelism".
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class CollectiveLog:
    calls: Counter = field(default_factory=Counter)  # (op, phase) -> number of calls
    bytes: Counter = field(default_factory=Counter)  # (op, phase) -> payload bytes
    seconds: float = 0.0  # wall time inside the collectives (on GPUs: until the call returns)

    def record(self, op: str, phase: str, tensor: torch.Tensor) -> None:
        self.calls[(op, phase)] += 1
        self.bytes[(op, phase)] += tensor.numel() * tensor.element_size()

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())


_active: list[CollectiveLog] = []


@contextlib.contextmanager
def count_collectives():
    """``with count_collectives() as log:`` — every tensor-parallel collective inside is recorded."""
    log = CollectiveLog()
    _active.append(log)
    try:
        yield log
    finally:
        _active.remove(log)


def _all_reduce(
    tensor: torch.Tensor, group, op: str, phase: str, reduce_op=dist.ReduceOp.SUM
) -> torch.Tensor:
    for log in _active:
        log.record(op, phase, tensor)
    tensor = tensor.contiguous()
    start = time.perf_counter()
    dist.all_reduce(tensor, op=reduce_op, group=group)
    for log in _active:
        log.seconds += time.perf_counter() - start
    return tensor


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(), ctx.group, "all_reduce_sum", "backward"), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group, "all_reduce_sum", "forward")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return _ReduceFromTP.apply(x, group)


def all_reduce_max(x: torch.Tensor, group) -> torch.Tensor:
    return _all_reduce(x.detach().clone(), group, "all_reduce_max", "forward", dist.ReduceOp.MAX)


def all_reduce_sum(x: torch.Tensor, group, phase: str = "backward") -> torch.Tensor:
    """The sum over the group, without autograd: for values recomputed inside a custom ``backward``."""
    return _all_reduce(x.detach().clone(), group, "all_reduce_sum", phase)
