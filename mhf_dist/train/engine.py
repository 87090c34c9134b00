"""DeepSpeed engines for every layout (SPEC §7).

- pp = 1: ``deepspeed.initialize`` on the (tensor-parallel) model, ZeRO-3 by
  default (the bucket tables route every use through their ``forward``, so
  ZeRO-3 gathers them like any tied embedding).
- pp > 1: a ``PipelineModule`` (:mod:`mhf_dist.parallel.pipeline`) with ZeRO-1;
  DeepSpeed's pipeline engine refuses ZeRO-2/3, so asking for them is a
  config error.

The DeepSpeed config comes from :mod:`mhf_dist.parallel.layout`. Both engines expose the same ``train_step`` / ``evaluate``.
"""

from __future__ import annotations

from dataclasses import dataclass

import deepspeed
import torch

from mhf_dist.config import RunConfig
from mhf_dist.data.reader import ShardReader
from mhf_dist.model.lm import LanguageModel
from mhf_dist.parallel.groups import ParallelGroups
from mhf_dist.parallel.layout import Layout
from mhf_dist.parallel.pipeline import build_pipeline
from mhf_dist.parallel.scalars import ScalarCollectives
from mhf_dist.train.host_tables import HostTablesStep
from mhf_dist.train.optim import build_optimizer


def device_type(cfg: RunConfig) -> str:
    if cfg.train.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.train.device


def checkpoint_interval(cfg: RunConfig, ds_config: dict) -> int:
    interval = cfg.parallel.activation_checkpoint_interval
    return interval if interval is not None else int("activation_checkpointing" in ds_config)


@dataclass
class StepStats:
    loss: float  # mean over the global batch
    head_losses: list[float]
    grad_norm: float | None  # DeepSpeed reports none without ZeRO


def _grad_norm(engine) -> float | None:
    norm = engine.get_global_grad_norm()
    return None if norm is None else float(norm)


class DataParallelTrainer:
    """pp = 1: the model (tensor-parallel or not) under a DeepSpeed engine, ZeRO-0…3."""

    def __init__(self, cfg: RunConfig, model: LanguageModel, groups: ParallelGroups, ds_config: dict, layout: Layout):
        model.backbone.checkpoint_interval = checkpoint_interval(cfg, ds_config)
        optimizer, scheduler = build_optimizer(model, cfg.optimizer, cfg.train.max_steps)
        self.engine, *_ = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config, mpu=groups
        )
        self.groups, self.accum, self.micro = groups, layout.accum, cfg.train.micro_batch_size
        self.scalars = ScalarCollectives()
        self.host = None  # model.engram.offload: the Engram tables in host memory
        if cfg.model.engram is not None and cfg.model.engram.offload:
            dtype = torch.bfloat16 if cfg.train.dtype == "bf16" else torch.float32
            self.host = HostTablesStep(model, self.engine, dtype, groups.dp_group, groups.dp)

    @property
    def lr(self) -> float:
        return self.engine.get_lr()[0]

    def train_step(self, reader: ShardReader) -> StepStats:
        self.engine.train()
        losses = []
        host = self.host
        batch = reader.next_batch(self.micro)
        if host:
            host.prefetch(batch[:, :-1])
        for i in range(self.accum):
            if host:
                host.advance()
            batch = batch.to(self.engine.device)
            out = self.engine(batch[:, :-1], batch[:, 1:])
            if i + 1 < self.accum:  # the next micro-batch's rows are gathered while this one computes
                batch = reader.next_batch(self.micro)
                if host:
                    host.prefetch(batch[:, :-1])
            self.engine.backward(out.loss)
            if host and i + 1 == self.accum:
                host.before_step()
            self.engine.step()
            losses.append(torch.cat([out.loss.detach()[None], out.head_losses.detach()]))
        if host:
            host.after_step()
        stats = self.scalars.mean(torch.stack(losses).mean(0), self.groups.dp_group)
        return StepStats(loss=stats[0], head_losses=stats[1:], grad_norm=_grad_norm(self.engine))

    @torch.no_grad()
    def evaluate(self, reader: ShardReader, batches: int) -> tuple[float, float]:
        """(mean training loss, mean -log P_inf) over ``batches`` micro-batches on each data-parallel rank."""
        self.engine.eval()
        values = []
        for _ in range(batches):
            batch = reader.next_batch(self.micro).to(self.engine.device)
            out = self.engine(batch[:, :-1], batch[:, 1:], with_p_inf=True)
            values.append(torch.stack([out.loss, out.p_inf_nll]))
        loss, nll = self.scalars.mean(torch.stack(values).mean(0), self.groups.dp_group)
        return loss, nll


class PipelineTrainer:
    """pp > 1: DeepSpeed's pipeline engine over the stages of :func:`build_pipeline`, ZeRO-0/1."""

    def __init__(self, cfg: RunConfig, model: LanguageModel, groups: ParallelGroups, ds_config: dict, layout: Layout):
        self.pipe, self.loss_fn = build_pipeline(model, groups.topology, cfg.data.seq_len,
                                                 checkpoint_interval(cfg, ds_config))
        optimizer, scheduler = build_optimizer(self.pipe, cfg.optimizer, cfg.train.max_steps)
        self.engine, *_ = deepspeed.initialize(
            model=self.pipe, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config
        )
        self.groups, self.accum, self.micro = groups, layout.accum, cfg.train.micro_batch_size
        self.num_heads = model.vocab.decoder.num_heads
        self.scalars = ScalarCollectives()

    @property
    def lr(self) -> float:
        return self.engine.get_lr()[0]

    def _batches(self, reader: ShardReader, count: int):
        for _ in range(count):
            batch = reader.next_batch(self.micro)
            yield batch[:, :-1], batch[:, 1:]

    def _last_stage_mean(self, field: str) -> list[float]:
        """Mean over micro-batches and dp of a loss output kept on the last stage, sent to every rank."""
        n = self.num_heads if field == "head_losses" else 1
        values = [0.0] * n
        if self.engine.is_last_stage() and self.groups.tp_rank == 0:
            values = torch.stack([getattr(o, field).detach().float().reshape(n) for o in self.loss_fn.outputs])
            values = values.mean(0) / self.groups.dp
        self.loss_fn.outputs.clear()
        return self.scalars.sum(values)

    def train_step(self, reader: ShardReader) -> StepStats:
        loss = self.engine.train_batch(data_iter=self._batches(reader, self.accum))
        heads = self._last_stage_mean("head_losses")
        return StepStats(loss=float(loss), head_losses=heads, grad_norm=_grad_norm(self.engine))

    @torch.no_grad()
    def evaluate(self, reader: ShardReader, batches: int) -> tuple[float, float]:
        self.loss_fn.with_p_inf = True
        loss = self.engine.eval_batch(data_iter=self._batches(reader, batches), num_micro_batches=batches)
        self.loss_fn.with_p_inf = False
        return float(loss), self._last_stage_mean("p_inf_nll")[0]


def build_trainer(cfg: RunConfig, model: LanguageModel, groups: ParallelGroups, ds_config: dict, layout: Layout):
    cls = PipelineTrainer if layout.pp > 1 else DataParallelTrainer
    return cls(cfg, model, groups, ds_config, layout)
