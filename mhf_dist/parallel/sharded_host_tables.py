"""``ShardedHostTables``: Engram tables in host memory whose rows are split over the ranks of a group
(``model.engram.offload=sharded``), and ``shard_host_tables``, which puts them in a model.

Rank ``g`` of ``G`` holds rows ``[g·R/G, (g+1)·R/G)`` of each of the ``T`` tables (``weight [T, R/G, d]``: a slice
along the rows, as a tensor-parallel table's). A lookup asks each row's owner for it: a micro-batch's unique rows go
out as counts per owner, then ids, by ``all_to_all_single``, and the owners send the rows back in the compute dtype;
the next micro-batch's exchange runs on a worker thread while this one computes. A step's row gradients stay with the
rank that read them until ``send_gradients`` (at the accumulation boundary) sends each row's sum over the step, in
fp32, to its owner, which adds them into its ``grad [T, R/G, d]`` and marks the rows ``touched``. Why:
docs/design-engram.md.
"""

from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from mhf_dist.model.host_tables import GatheredRows, HostTables


@dataclass(frozen=True)
class HostShards:
    """Who splits the host tables' rows: this rank is ``rank`` of the ``size`` ranks of ``group`` (gloo, host
    tensors), and with one copy of the tables per node (``model.engram.offload_shards=node``) ``replicas`` holds the
    ranks of the other nodes that keep the same rows (None: one copy over every rank). Under tensor parallelism the
    ranks of a tp group compute the same row gradients: only the first one's count (``contributes``). Under pipeline
    parallelism each stage's ranks split the tables of its layers: this rank's stage is ``stage`` of ``stages``.
    ``norms`` (gloo; None: ``group``) sums the host gradients' norm² over one copy of every stage's rows: this rank's
    copy, whose first one (``first_copy``) writes the checkpoint."""

    group: object
    rank: int
    size: int
    replicas: object | None = None
    contributes: bool = True
    stage: int = 0
    stages: int = 1
    norms: object | None = None
    first_copy: bool = True
    # the one thread that exchanges over ``group`` ahead of the forwards: every table's, in the order asked
    worker: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="engram-exchange")
    )

    @classmethod
    def create(
        cls, world: int, rank: int, per_node: int | None, tp: int = 1, pp: int = 1
    ) -> HostShards:
        """Every rank, in the same order: the groups of ``world`` ranks in ``pp`` stages of consecutive ranks, each
        stage's split over all of its ranks (``per_node`` None) or over the ranks of each node it has (``per_node``
        consecutive ranks; a node holding several stages splits each over its ranks of that stage); tp groups are
        ``tp`` consecutive ranks."""
        stage_ranks = world // pp
        size = stage_ranks if per_node is None else min(per_node, stage_ranks)
        if world % pp or stage_ranks % size or (per_node is not None and per_node % size):
            raise ValueError(
                f"{world} ranks in {pp} pipeline stages do not make whole nodes of {per_node} ranks "
                "(model.engram.offload_shards=node); use offload_shards=all"
            )
        stage = rank // stage_ranks
        mine, replicas = None, None
        for first in range(0, world, size):  # collective: every rank creates every group
            group = dist.new_group(list(range(first, first + size)), backend="gloo")
            if first <= rank < first + size:
                mine = group
        if size < stage_ranks:
            for start in range(0, world, stage_ranks):
                for local in range(size):
                    ranks = list(range(start + local, start + stage_ranks, size))
                    group = dist.new_group(ranks, backend="gloo")
                    if rank in ranks:
                        replicas = group
        norms = mine  # one copy of every stage: the ranks with this rank's copy index in each stage
        if pp > 1:
            for copy in range(stage_ranks // size):
                ranks = [r for r in range(world) if (r % stage_ranks) // size == copy]
                group = dist.new_group(ranks, backend="gloo")
                if rank in ranks:
                    norms = group
        first_copy = rank % stage_ranks < size
        return cls(mine, rank % size, size, replicas, rank % tp == 0, stage, pp, norms, first_copy)


class ShardedHostTables(HostTables):
    """This rank's rows of ``T`` tables of ``R`` rows (``R`` a multiple of the group's ``size``), looked up whole."""

    def __init__(
        self,
        num_tables: int,
        num_rows: int,
        dim: int,
        shards: HostShards,
        dtype: torch.dtype = torch.float32,
    ):
        size = shards.size
        if num_rows % size:
            raise ValueError(
                f"Engram tables of {num_rows} rows cannot be split evenly over {size} ranks "
                "(model.engram.offload=sharded); set model.engram.pad_rows_to to a multiple of "
                f"{size}"
            )
        super().__init__(num_tables, num_rows // size, dim, dtype)
        self.num_rows, self.block = num_rows, num_rows // size
        self.group, self.rank, self.size = shards.group, shards.rank, size
        self.contributes = shards.contributes
        self._worker = shards.worker
        self._outgoing: list[tuple[torch.Tensor, torch.Tensor]] = []  # (flat rows, fp32 gradients)
        self.sent_bytes = 0  # payload sent to the other ranks so far (the exchange's count)

    @property
    def rows(self) -> tuple[int, int]:
        """``[first, last)``: the rows this rank holds."""
        return self.rank * self.block, (self.rank + 1) * self.block

    def _owners(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat ids over the whole tables -> (their owners, their flat ids in the owners' ``weight``)."""
        table, row = index // self.num_rows, index % self.num_rows
        return row // self.block, table * self.block + row % self.block

    def _all_to_all(
        self, values: torch.Tensor, send: list[int], receive: list[int]
    ) -> torch.Tensor:
        """``values`` cut into ``send[r]`` rows for rank ``r``; returns the ``receive[r]`` rows of each rank, in
        rank order."""
        out = values.new_empty((sum(receive), *values.shape[1:]))
        dist.all_to_all_single(out, values.contiguous(), receive, send, group=self.group)
        row = math.prod(values.shape[1:]) * values.element_size()
        self.sent_bytes += (sum(send) - send[self.rank]) * row
        return out

    def _route(
        self, index: torch.Tensor
    ) -> tuple[torch.Tensor, list[int], list[int], torch.Tensor]:
        """For the flat ids ``index``: their order grouped by owner, the counts sent to and received from each
        rank, and the local flat ids the other ranks ask of this one."""
        owner, local = self._owners(index)
        order = torch.argsort(owner, stable=True)
        counts = torch.bincount(owner, minlength=self.size)
        received = self._all_to_all(counts, [1] * self.size, [1] * self.size)
        send, receive = counts.tolist(), received.tolist()
        asked = self._all_to_all(local[order], send, receive)
        return order, send, receive, asked

    def select(self, index: torch.Tensor, pin: bool) -> torch.Tensor:
        """The rows ``index`` (flat over the whole tables) from their owners, in ``transfer_dtype``."""
        order, send, receive, asked = self._route(index)
        served = self.weight.view(-1, self.weight.shape[-1]).index_select(0, asked)
        got = self._all_to_all(served.to(self.transfer_dtype), receive, send)
        selected = torch.empty(got.shape, dtype=got.dtype, pin_memory=pin)
        selected[order] = got
        return selected

    # ------------------------------------------------------------------ gathering ahead, on the worker
    def prefetch(self, rows: torch.Tensor) -> None:
        self._next = self._worker.submit(self._gather_ahead, rows)

    def _gather_ahead(self, rows: torch.Tensor) -> GatheredRows:
        if self.device.type != "cuda":
            return self.gather(rows)
        with torch.cuda.device(self.device):  # a new thread's current GPU is the first one
            return self.gather(rows)

    def _prefetched(self) -> GatheredRows | None:
        if isinstance(self._current, Future):
            self._current = self._current.result()
        return self._current

    # ------------------------------------------------------------------ gradients, to the owners
    def _index_add(self, index: torch.Tensor, grad: torch.Tensor) -> None:
        """Kept until ``send_gradients``: the rows' owners add them."""
        if self.contributes:
            self._outgoing.append((index, grad.float()))

    def send_gradients(self) -> None:
        """Every rank: each row's gradient summed over this rank's micro-batches goes to its owner, which adds what
        every contributing rank sent into ``grad`` (the sum over the group) and marks the rows in ``touched``."""
        if self.grad is None:
            self.grad = torch.zeros_like(self.weight, dtype=torch.float32)
        index = torch.cat([i for i, _ in self._outgoing]) if self._outgoing else torch.zeros(0)
        values = [v for _, v in self._outgoing]
        self._outgoing = []
        unique, inverse = torch.unique(index.long(), return_inverse=True)
        summed = torch.zeros(unique.numel(), self.weight.shape[-1])
        if values:
            summed.index_add_(0, inverse, torch.cat(values))
        order, send, receive, asked = self._route(unique)
        arrived = self._all_to_all(summed[order], send, receive)
        self.grad.view(-1, self.weight.shape[-1]).index_add_(0, asked, arrived)
        if self.touched is not None:
            self.touched[asked] = True


def shard_host_tables(model: nn.Module, shards: HostShards) -> nn.Module:
    """Swap every ``HostTables`` of ``model`` for this rank's ``ShardedHostTables``."""
    for name, module in list(model.named_modules()):
        if type(module) is HostTables:
            parent, _, attr = name.rpartition(".")
            count, _, dim = module.weight.shape
            setattr(
                model.get_submodule(parent),
                attr,
                ShardedHostTables(count, module.num_rows, dim, shards, module.weight.dtype),
            )
    return model


def host_table_split(tables: HostTables) -> tuple[int | None, int, int]:
    """``(dim, rank, parts)``: how ``tables.weight`` is cut from the whole tables (``initial_shard``'s terms)."""
    if isinstance(tables, ShardedHostTables):
        return 1, tables.rank, tables.size
    return None, 0, 1
