"""Partitioned model construction: every rank creates only the parameters it keeps.

Meta-device construction with per-rank materialisation (as torchtitan does), each leaf handed to ZeRO-3 at once:
``model_skeleton`` builds the model on the meta device with this rank's tensor-parallel modules
(``shard_modules``); ``Materialiser`` makes it real one leaf module at a time, filling each tensor-parallel shard
with its initial values by name (``SeededValues``, or ``FileValues`` of a ``train.init_from`` file) or, under ZeRO-3,
handing the leaf to the backend's ``Partitioner`` first and writing only this rank's range. With pp > 1 the backend
builds each pipeline layer on its own stage. The steps, the peak memory and work, and why neither ``zero.Init`` nor
``to_empty``: docs/design-model.md, "Model construction".
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from mhf_dist.model.init import draw_size, host_tables, initial_shard
from mhf_dist.model.lm import LanguageModel, model_structure
from mhf_dist.model.modes import ModelModes
from mhf_dist.parallel.sharded_host_tables import (
    HostShards,
    host_table_split,
    shard_host_tables,
)
from mhf_dist.parallel.state_dict import split_dim
from mhf_dist.parallel.tensor_parallel import shard_modules, tp_split_dims


class Partitioner(Protocol):
    """Partitions a module's freshly made parameters over the data-parallel group (ZeRO-3): what construction needs of
    the backend, which provides one (``mhf_dist.backend.parameter_partitioner``)."""

    dtype: torch.dtype  # the dtype the partitioned parameters train in
    # Whether a partition may be written after partitioning (``held``): then the leaf need not hold its values
    # when it is partitioned; else it must hold them all
    writes_held: bool

    def __call__(self, leaf: nn.Module) -> None:
        """Replace ``leaf``'s own parameters by this rank's partitions of them."""

    def held(self, param: nn.Parameter) -> tuple[int, torch.Tensor]:
        """For a parameter partitioned by this rank: where its partition begins in the flattened parameter, and the
        partition's values (a flat tensor, padding left out), which the rank may write in place."""


def model_skeleton(
    cfg,
    vocab_size: int,
    codes: torch.Tensor | None,
    *,
    compression,
    tp_group=None,
    tp_rank: int = 0,
    tp: int = 1,
    modes: ModelModes = ModelModes(),
    host_shards: HostShards | None = None,
) -> LanguageModel:
    """The model in ``modes`` with this rank's tensor-parallel modules, every parameter on the meta device
    (docs/design-model.md, "Model construction"), and with ``host_shards`` this rank's rows of the host tables;
    ``Materialiser`` makes them real."""
    with torch.device("meta"):
        model = model_structure(cfg, vocab_size, codes, compression, modes)
        shard_modules(model, tp_group, tp_rank, tp)
        if host_shards is not None:
            shard_host_tables(model, host_shards)
    return model


class SeededValues:
    """Initial values from the run's seed (``mhf_dist.model.init``). Between ``reserve`` and
    ``release``, the draws that cannot go straight into a parameter share one buffer."""

    def __init__(self, std: float, seed: int):
        self.std, self.seed = std, seed
        self.buffer: torch.Tensor | None = None

    def reserve(self, names: dict[str, tuple[int, ...]]) -> None:
        """A draw buffer (one block) for the parameters ``{name: full shape}`` about to be initialised."""
        size = max((draw_size(n, s) for n, s in names.items()), default=0)
        self.buffer = torch.empty(size) if size else None

    def release(self) -> None:
        self.buffer = None

    def shard(
        self,
        name: str,
        full_shape: tuple[int, ...],
        out: torch.Tensor,
        *,
        dim: int | None,
        rank: int,
        parts: int,
        start: int = 0,
    ) -> None:
        """``out`` <- chunk ``rank`` of ``parts`` along ``dim`` of parameter ``name``, or from ``start`` the next
        ``out.numel()`` elements of that chunk flattened (``initial_shard``)."""
        initial_shard(
            name,
            full_shape,
            out,
            std=self.std,
            seed=self.seed,
            dim=dim,
            rank=rank,
            parts=parts,
            buffer=self.buffer,
            start=start,
        )


class FileValues:
    """Initial values from a safetensors file of full weights in the LanguageModel's naming (``train.init_from``):
    each rank reads only its slices, one parameter at a time. Raises ValueError, naming the tensors, unless
    the file holds exactly the model's parameters at their full shapes (``shapes``)."""

    def reserve(self, names: dict[str, tuple[int, ...]]) -> None:
        pass

    def release(self) -> None:
        pass

    def __init__(self, path: Path, shapes: dict[str, tuple[int, ...]]):
        from safetensors import safe_open

        self.path = path
        self.file = safe_open(str(path), "pt")
        held = {name: tuple(self.file.get_slice(name).get_shape()) for name in self.file.keys()}
        problems = [f"missing {n}" for n in shapes if n not in held]
        problems += [f"unexpected {n}" for n in held if n not in shapes]
        problems += [
            f"{n} is {list(held[n])}, the model's {list(s)}"
            for n, s in shapes.items()
            if n in held and held[n] != s
        ]
        if problems:
            more = f" and {len(problems) - 5} more" if len(problems) > 5 else ""
            raise ValueError("; ".join(problems[:5]) + more)

    def shard(
        self,
        name: str,
        full_shape: tuple[int, ...],
        out: torch.Tensor,
        *,
        dim: int | None,
        rank: int,
        parts: int,
        start: int = 0,
    ) -> None:
        """As ``SeededValues.shard``: only the rows (along the first dimension) that hold the elements are read."""
        index, shape = [slice(None)] * len(full_shape), list(full_shape)
        if dim is not None:
            size = shape[dim] = full_shape[dim] // parts
            index[dim] = slice(rank * size, (rank + 1) * size)
        n = out.numel()
        if n == 0:
            return
        if not shape:  # a scalar
            out.copy_(self.file.get_tensor(name))
            return
        row = math.prod(shape[1:])
        first, last = start // row, (start + n - 1) // row + 1
        offset = index[0].start if dim == 0 else 0
        index[0] = slice(offset + first, offset + last)
        values = self.file.get_slice(name)[tuple(index)].reshape(-1)[start - first * row :][:n]
        out.copy_(values.view(out.shape))


def full_shapes(model: LanguageModel, tp: int) -> dict[str, tuple[int, ...]]:
    """``{name: full shape}`` of a (skeleton) model whose tensor-parallel modules hold 1/tp of their split dim."""
    dims = tp_split_dims(model.cfg, tp)
    out = {}
    for name, param in model.named_parameters():
        shape, dim = list(param.shape), split_dim(name, dims) if tp > 1 else None
        if dim is not None:
            shape[dim] *= tp
        out[name] = tuple(shape)
    # tp = 1 only; sharded host tables hold a slice of their rows
    return out | {
        name: (tables.weight.shape[0], tables.num_rows, tables.weight.shape[2])
        for name, tables in host_tables(model)
    }


class Materialiser:
    """``materialise(module)``: the meta parameters of ``module`` (``model`` or a part of it) become real on this
    rank, initialised from ``values``, leaf by leaf; with a ``partition`` (pp = 1 under ZeRO-3) each leaf is
    partitioned over the data-parallel group as soon as it is made, in the partitioner's dtype, and this rank's
    partitions are then written in place (the leaf filled in full first where the partitioner cannot have them
    written afterwards). Buffers move to ``device``. Returns ``module``."""

    def __init__(
        self,
        model: LanguageModel,
        values,
        device: torch.device,
        tp_rank: int = 0,
        tp: int = 1,
        partition: Partitioner | None = None,
    ):
        self.prefixes = {id(m): prefix for prefix, m in model.named_modules()}
        self.shapes = full_shapes(model, tp)
        self.dims = tp_split_dims(model.cfg, tp) if tp > 1 else []
        self.values, self.device, self.tp_rank, self.tp = values, device, tp_rank, tp
        self.partition = partition
        self.dtype = partition.dtype if partition is not None else None

    def __call__(self, module: nn.Module) -> nn.Module:
        base = self.prefixes[id(module)]
        # [(leaf, [(attribute, full parameter name, meta parameter)])] for the leaves with meta parameters
        leaves = [
            (
                leaf,
                [
                    (n, f"{prefix}.{n}" if prefix else n, p)
                    for n, p in leaf.named_parameters(recurse=False)
                    if p.is_meta
                ],
            )
            for prefix, leaf in module.named_modules(prefix=base)
        ]
        leaves = [(leaf, params) for leaf, params in leaves if params]
        names = [name for _, params in leaves for _, name, _ in params]
        self.values.reserve({name: self.shapes[name] for name in names})  # one block's draw buffer
        scratch = None
        if self.partition is not None and leaves:
            # Each leaf is made in one buffer, reused leaf after leaf: ZeRO-3 keeps a copy of its slice and lets
            # the leaf's tensors go, so the only other allocations are the slices, which stay packed (a fresh
            # full-size tensor per leaf would leave the allocator holes that later, larger leaves cannot reuse).
            scratch = torch.empty(
                max(sum(meta.numel() for *_, meta in params) for _, params in leaves),
                dtype=self.dtype,
                device=self.device,
            )
        # Under ZeRO-3, a rank writes only its partitions, once partitioned (the leaf's own values are not read)
        after = self.partition is not None and self.partition.writes_held
        for leaf, params in leaves:
            offset = 0
            for n, name, meta in params:
                out = None
                if scratch is not None:
                    out = scratch[offset : offset + meta.numel()].view(meta.shape)
                    offset += meta.numel()
                setattr(leaf, n, self._real(name, meta, out, fill=not after))
            if scratch is not None:
                self.partition(leaf)
            if after:
                for n, name, _ in params:
                    start, held = self.partition.held(getattr(leaf, n))
                    self.values.shard(
                        name,
                        self.shapes[name],
                        held,
                        dim=split_dim(name, self.dims),
                        rank=self.tp_rank,
                        parts=self.tp,
                        start=start,
                    )
        self.values.release()
        for name, tables in host_tables(module):  # model.engram.offload: whole or sharded
            dim, rank, parts = host_table_split(tables)
            prefix = self.prefixes[id(module)]
            full = f"{prefix}.{name}" if prefix else name
            self.values.shard(
                full, self.shapes[full], tables.weight, dim=dim, rank=rank, parts=parts
            )
        for owner in module.modules():
            for n, buffer in list(owner.named_buffers(recurse=False)):
                setattr(owner, n, buffer.to(self.device))
        return module

    def _real(
        self, name: str, meta: nn.Parameter, out: torch.Tensor | None = None, fill: bool = True
    ) -> nn.Parameter:
        """The parameter ``name`` on this rank in ``out`` (or a new tensor), its values written there with ``fill``."""
        if out is None:
            out = torch.empty(meta.shape, dtype=meta.dtype, device=self.device)
        if fill:
            self.values.shard(
                name,
                self.shapes[name],
                out,
                dim=split_dim(name, self.dims),
                rank=self.tp_rank,
                parts=self.tp,
            )
        param = nn.Parameter(out, requires_grad=meta.requires_grad)
        param.__dict__.update(meta.__dict__)  # tensor_model_parallel and the like
        return param
