"""The training side of offloaded Engram tables (``model.engram.offload``, ``HostTables``), called by the
backend's ``Trainer`` around its optimizer step: ``HostTablesStep.prefetch`` and ``advance`` gather each micro-batch's
rows ahead of its forward; ``before_step`` adds the gradients still on their way from the device and, with dp > 1,
averages the rows any rank read (whole tables: over the data-parallel ranks, their row masks all-reduced with MAX,
then the union's rows only; sharded tables, ``ShardedHostTables``: each row's gradients sent to its owner, then
over the other nodes' copies with one copy per node); DeepSpeed's global gradient norm includes the host tables'
(``host_norm_on``), so its clipping and the logged norm are the dense run's; ``after_step`` clips with that norm and
steps a fused ``torch.optim.AdamW`` on every row, as the dense tables (``model.engram.offload_update=lazy``: on the
rows read only, with the same step count and Adam state, so a checkpoint of either resumes in either). The checkpoint
files: ``mhf_dist.train.host_table_files``. Why and how: docs/design-engram.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from mhf_dist.model.dtypes import DTYPES
from mhf_dist.model.host_tables import HostTables
from mhf_dist.parallel.scalars import ScalarCollectives, communication_device
from mhf_dist.parallel.sharded_host_tables import HostShards, ShardedHostTables
from mhf_dist.train.host_adamw import HostAdamW
from mhf_dist.train.host_table_files import (
    HOST_TABLES_FILE,
    SHARD_FILE,
    HostTableFiles,
    shard_metadata,
)
from mhf_dist.train.optim import group_key, group_settings

if TYPE_CHECKING:
    from mhf_dist.backend import HostTableFactory, Trainer
    from mhf_dist.config import RunConfig
    from mhf_dist.parallel.groups import ParallelGroups


def host_table_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The offloaded tables of a checkpoint in the LanguageModel's naming, whole (empty without offloaded tables)."""
    try:
        files = HostTableFiles(checkpoint)
    except FileNotFoundError:
        return {}
    return {
        f"backbone.{name.removesuffix('.weight')}.engram.tables.weight": files.read(name).float()
        for name in files.names()
        if name.endswith(".weight")
    }


ALL_REDUCE_ROWS = 1 << 16  # rows per all-reduce of the dense host gradient (bounds the device copy)


def host_tables(model: nn.Module, layers: Sequence[int] | None = None) -> dict[int, HostTables]:
    """``{layer: HostTables}`` of the model's offloaded memories (of ``layers`` only: a pipeline stage's)."""
    return {
        i: block.engram.tables
        for i, block in enumerate(model.backbone.layers)
        if block.engram is not None
        and isinstance(block.engram.tables, HostTables)
        and (layers is None or i in layers)
    }


def host_shards(
    cfg: RunConfig, world: int, rank: int, per_node: int, tp: int, pp: int = 1
) -> HostShards | None:
    """Every rank, in the same order: the groups that split sharded host tables (``model.engram.offload=sharded``;
    ``per_node`` ranks on each node, tp groups of ``tp``, ``pp`` stages), None for any other model."""
    engram = cfg.model.engram
    if engram is None or engram.offload != "sharded":
        return None
    per_node = per_node if engram.offload_shards == "node" else None
    return HostShards.create(world, rank, per_node, tp, pp)


def host_tables_factory(
    cfg: RunConfig, groups: ParallelGroups, shards: HostShards | None = None
) -> HostTableFactory | None:
    """What the backend makes the host tables' step with, for a model whose Engram tables are in host memory
    (``model.engram.offload``; ``shards``: how sharded ones are split); None for any other."""
    engram = cfg.model.engram
    if engram is None or not engram.offload:
        return None
    # what crosses to the device
    dtype = torch.bfloat16 if cfg.train.dtype == "bf16" else torch.float32
    # the Engram tables' optimizer.groups settings (every layer's alike)
    settings = group_settings(
        group_key("backbone.layers.0.engram.tables.weight", 3, cfg.optimizer), cfg.optimizer
    )
    return lambda model, trainer: HostTablesStep(
        model,
        trainer,
        compute_dtype=dtype,
        dp_group=groups.dp_group,
        dp=groups.dp,
        update=engram.offload_update,
        settings=settings,
        shards=shards,
        moment_dtype=DTYPES[engram.moment_dtype],
    )


class HostTablesStep:
    def __init__(
        self,
        model: nn.Module,
        trainer: Trainer,
        *,
        compute_dtype: torch.dtype,
        dp_group,
        dp: int,
        update: str,
        settings: tuple[float, float],
        shards: HostShards | None = None,
        moment_dtype: torch.dtype = torch.float32,
    ):
        self.tables = host_tables(model, trainer.layers)  # this rank's stage's
        self.memories = [model.backbone.layers[i].engram for i in self.tables]
        self.trainer, self.dp_group, self.dp, self.shards = trainer, dp_group, dp, shards
        self.lazy = update == "lazy"
        self.lr_scale, self.weight_decay = (
            settings  # the tables' optimizer group's (optimizer.groups)
        )
        for t in self.tables.values():
            t.device, t.transfer_dtype = trainer.device, compute_dtype
            t.grad = torch.zeros_like(t.weight, dtype=torch.float32)
            if (
                self.lazy or dp > 1
            ):  # the rows read: the lazy update's, and the only ones a reduction over ranks needs
                t.touched = torch.zeros(t.weight.shape[0] * t.weight.shape[1], dtype=torch.bool)
        # updates the tables in place
        self.adamw = HostAdamW({i: t.weight for i, t in self.tables.items()}, moment_dtype)
        # host values that go to the device are staged in pinned memory
        self.pin = trainer.device.type == "cuda"
        self.host_norm = torch.zeros(())
        self.grads: dict[
            int, torch.Tensor
        ] = {}  # this step's gradients: each table's, or its touched rows' (lazy)
        self.rows: dict[int, torch.Tensor] = {}  # lazy: this step's touched flat rows of each table
        self.ready = False  # before_step ran in this step

    def _hyper(self) -> dict:
        """This step's AdamW settings: the schedule's learning rate (the trainer's first group has lr_scale 1) times
        the tables' scale, and their weight decay."""
        group = self.trainer.optimizer.param_groups[0]
        return {
            "lr": group["lr"] * self.lr_scale,
            "betas": group["betas"],
            "eps": group["eps"],
            "weight_decay": self.weight_decay,
        }

    # ------------------------------------------------------------------ gathering
    def prefetch(self, input_ids: torch.Tensor) -> None:
        for memory in self.memories:
            memory.prefetch(input_ids)

    def advance(self) -> None:
        for t in self.tables.values():
            t.advance()

    # ------------------------------------------------------------------ the step
    def host_norm_on(self, like: torch.Tensor) -> torch.Tensor:
        """The host tables' gradient norm on ``like``'s device and dtype: from pinned memory without blocking (then
        converted there) on CUDA."""
        return self.host_norm.to(like.device, non_blocking=self.pin).to(like.dtype)

    def norm_in_step_on(self, like: torch.Tensor) -> torch.Tensor:
        """``before_step``, then ``host_norm_on``: for the pipeline engine, whose schedule runs the optimizer step
        (this is asked inside it, after the stage's last backward)."""
        self.before_step()
        return self.host_norm_on(like)

    def before_step(self) -> None:
        """At the accumulation boundary, before DeepSpeed's step: dp-average the host gradients, take their norm
        and this step's hyperparameters."""
        # the ranks whose gradients are averaged here: dp, or with sharded tables the other copies of this rank's rows
        group = self.dp_group if self.shards is None else self.shards.replicas
        collectives = None
        if group is not None and dist.get_world_size(group) > 1:
            collectives = ScalarCollectives(communication_device(dist.get_backend(group)))
        for i, t in self.tables.items():
            t.accumulate()
            if isinstance(t, ShardedHostTables):  # the owners: the sums over the shards' group
                t.send_gradients()
            grad = t.grad.view(-1, t.grad.shape[-1])
            if (
                t.touched is not None
            ):  # lazy, or dp > 1: only the rows read on some rank have a gradient
                if collectives:  # the union of the ranks' rows, one byte a row
                    collectives.max_into(t.touched, group, ALL_REDUCE_ROWS * t.grad.shape[-1])
                rows = t.touched.nonzero().squeeze(1)
                t.touched.zero_()
                # the other rows' gradients are zero on every rank
                selected = grad.index_select(0, rows)
                if collectives:
                    collectives.mean_into(selected, group, ALL_REDUCE_ROWS * t.grad.shape[-1])
                if isinstance(
                    t, ShardedHostTables
                ):  # a sum over the contributing ranks: dp of them
                    selected.div_(self.dp // (dist.get_world_size(group) if collectives else 1))
                if self.lazy:
                    self.rows[i], grad = rows, selected
                else:  # dense: the averaged rows back into the whole gradient
                    grad.index_copy_(0, rows, selected)
            self.grads[i] = grad
        norms = [torch.linalg.vector_norm(g) for g in self.grads.values()]
        norm = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
        norm_group = None if self.shards is None else self.shards.norms or self.shards.group
        if norm_group is not None and dist.get_world_size(norm_group) > 1:
            # each rank of a copy holds its rows' part of the norm, each stage its layers'
            host = ScalarCollectives(torch.device("cpu"))  # gloo
            (squares,) = host.sum([norm.square().item()], norm_group)
            norm = torch.tensor(squares, dtype=torch.float64).sqrt().float()
        # copied to the device inside DeepSpeed's step
        self.host_norm = norm.pin_memory() if self.pin else norm
        self.hyper = self._hyper()
        self.ready = True

    @torch.no_grad()
    def after_step(self, global_norm: float | None = None) -> None:
        """After DeepSpeed's step: clip with the global norm it used (``global_norm``, as the trainer read it; else
        read from the trainer here), then AdamW on the host tables."""
        # the engine left the step out before its norm: the gradients still reach their owners
        if not self.ready:
            self.before_step()
        if not self.trainer.step_skipped():
            clip = self.trainer.gradient_clipping()
            if (
                clip > 0
            ):  # DeepSpeed's coefficient, from the global norm it stashed (the host tables' included)
                if global_norm is None:  # not read by the caller: read here (a host sync on a GPU)
                    global_norm = self.trainer.global_grad_norm()
                total = torch.tensor(global_norm, dtype=torch.float32)
                scale = 1.0 / torch.clamp((total + 1e-6) / clip, min=1.0)
                for g in self.grads.values():
                    g.mul_(scale)
            for i, grad in self.grads.items():
                self.adamw.step(i, grad, self.rows[i] if self.lazy else None, self.hyper)
        for i, t in self.tables.items():
            if self.lazy:
                t.grad.view(-1, t.grad.shape[-1]).index_fill_(0, self.rows[i], 0.0)
            else:
                t.grad.zero_()
            t.release()
        self.grads, self.rows, self.ready = {}, {}, False

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_file(self, rank: int) -> str | None:
        """The file global rank ``rank`` writes into a checkpoint (None: none): rank 0 the whole tables, or each rank
        of one copy of sharded tables its rows (of its stage's layers)."""
        if self.shards is None:
            return HOST_TABLES_FILE if rank == 0 else None
        if not self.tables or not self.shards.first_copy:  # a stage without memories; a copy's rank
            return None
        shards = self.shards  # numbered stage by stage
        return SHARD_FILE.format(
            shards.stage * shards.size + shards.rank, shards.stages * shards.size
        )

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """The tables (this rank's rows of sharded ones) and their AdamW state as safetensors
        ``(tensors, metadata)``."""
        tensors = {}
        for i, t in self.tables.items():
            tensors[f"layers.{i}.weight"] = t.weight
            for key, value in self.adamw.state.get(i, {}).items():
                tensors[f"layers.{i}.{key}"] = value
        metadata = {"layers": ",".join(map(str, self.tables))}
        if self.shards is not None:
            t = next(iter(self.tables.values()))
            metadata |= shard_metadata(*t.rows, t.num_rows)
        return tensors, metadata

    def load(self, checkpoint: Path) -> None:
        """The tables and their AdamW state from ``checkpoint``'s host-table files, whatever the ranks that wrote
        them held: this rank's rows only."""
        files = HostTableFiles(checkpoint)
        names = set(files.names())
        for i, t in self.tables.items():
            if files.num_rows != t.num_rows:
                raise ValueError(
                    f"{checkpoint}'s host tables have {files.num_rows} rows, the model's {t.num_rows}"
                )
            first, last = t.rows if isinstance(t, ShardedHostTables) else (0, t.num_rows)
            t.weight.copy_(files.read(f"layers.{i}.weight", first, last))
            state = {
                key: files.read(f"layers.{i}.{key}", first, last)
                for key in ("step", "exp_avg", "exp_avg_sq")
                if f"layers.{i}.{key}" in names
            }
            if state:
                self.adamw.load(i, state)
