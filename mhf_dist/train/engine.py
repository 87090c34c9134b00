"""DeepSpeed engines for every layout (docs/spec.md §7).

- pp = 1: ``deepspeed.initialize`` on the (tensor-parallel) model, ZeRO-3 by
  default (the bucket tables route every use through their ``forward``, so
  ZeRO-3 gathers them like any tied embedding).
- pp > 1: a ``PipelineModule`` (:mod:`mhf_dist.parallel.pipeline`) with ZeRO-1;
  DeepSpeed's pipeline engine refuses ZeRO-2/3, so asking for them is a
  config error.

The model arrives as a skeleton (:mod:`mhf_dist.parallel.construct`) with the
``materialise`` that makes it real: pp = 1 materialises it whole (partitioned
leaf by leaf under ZeRO-3) before ``deepspeed.initialize``; pp > 1 hands it to the
pipeline, whose stages materialise their own layers. Without ``materialise``
the model is taken as built.

The DeepSpeed config comes from :mod:`mhf_dist.parallel.layout`. Both engines expose the same ``train_step`` /
``evaluate``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import deepspeed
import torch
from torch import nn

from mhf_dist.config import RunConfig
from mhf_dist.data.reader import ShardReader
from mhf_dist.model.calibration import fit_temperature, validation_metrics
from mhf_dist.model.lm import LanguageModel
from mhf_dist.parallel.groups import ParallelGroups
from mhf_dist.parallel.layout import Layout, checkpoint_interval
from mhf_dist.parallel.pipeline import build_pipeline
from mhf_dist.parallel.scalars import ScalarCollectives
from mhf_dist.train.host_tables import HostTablesStep
from mhf_dist.train.optim import build_optimizer


def device_type(cfg: RunConfig) -> str:
    if cfg.train.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.train.device


@dataclass
class StepStats:
    loss: float  # mean over the global batch
    head_losses: list[float]
    grad_norm: float | None  # DeepSpeed reports none without ZeRO
    p_inf_loss: float | None = None  # mean -log P_inf(target) of the loss's term (model.hash.p_inf_loss_weight > 0)


def _grad_norm(engine) -> float | None:
    norm = engine.get_global_grad_norm()
    return None if norm is None else float(norm)


class DataParallelTrainer:
    """pp = 1: the model (tensor-parallel or not) under a DeepSpeed engine, ZeRO-0…3."""

    def __init__(self, cfg: RunConfig, model: LanguageModel, groups: ParallelGroups, ds_config: dict, layout: Layout,
                 materialise: Callable[[nn.Module], nn.Module] | None = None):
        if materialise is not None:
            model = materialise(model)
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
            self.host = HostTablesStep(model, self.engine, dtype, groups.dp_group, groups.dp,
                                       cfg.model.engram.offload_update)

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
            # a training forward returns a P_inf NLL only with the loss's log P_inf term (λ > 0)
            p_inf = [] if out.p_inf_nll is None else [out.p_inf_nll.detach()[None]]
            values = [out.loss.detach()[None], out.head_losses.detach(), *p_inf]
            losses.append(torch.cat([v.to(out.loss.dtype) for v in values]))
        if host:
            host.after_step()
        stats = self.scalars.mean(torch.stack(losses).mean(0), self.groups.dp_group)
        heads = len(out.head_losses)
        return StepStats(loss=stats[0], head_losses=stats[1:1 + heads], grad_norm=_grad_norm(self.engine),
                         p_inf_loss=stats[1 + heads] if p_inf else None)

    @torch.no_grad()
    def evaluate(self, reader: ShardReader, batches: int) -> dict:
        """The ``val_*`` metrics over ``batches`` micro-batches on each data-parallel rank: the training loss and
        head losses (means over micro-batches and ranks), and ``P_inf``'s NLL, top-1/top-5 and temperature fit
        from sums over every token of every rank (:func:`~mhf_dist.model.calibration.fit_temperature`: two
        passes over the same micro-batches)."""
        self.engine.eval()
        data = [reader.next_batch(self.micro).to(self.engine.device) for _ in range(batches)]
        losses = []

        def one_pass(temperatures: torch.Tensor) -> list[float]:
            sums = 0
            for batch in data:
                out = self.engine(batch[:, :-1], batch[:, 1:], with_p_inf=True, temperatures=temperatures)
                sums = sums + out.eval_sums
                if len(losses) < len(data):  # the first pass's
                    losses.append(torch.cat([out.loss.detach().float()[None], out.head_losses.detach().float()]))
            return self.scalars.sum(sums, self.groups.dp_group)

        fit = fit_temperature(one_pass)
        loss, *heads = self.scalars.mean(torch.stack(losses).mean(0), self.groups.dp_group)
        return validation_metrics(loss, heads, fit)


class PipelineTrainer:
    """pp > 1: DeepSpeed's pipeline engine over the stages of :func:`build_pipeline`, ZeRO-0/1."""

    def __init__(self, cfg: RunConfig, model: LanguageModel, groups: ParallelGroups, ds_config: dict, layout: Layout,
                 materialise: Callable[[nn.Module], nn.Module] | None = None):
        self.pipe, self.loss_fn = build_pipeline(model, groups.topology, cfg.data.seq_len,
                                                 checkpoint_interval(cfg, ds_config), materialise)
        optimizer, scheduler = build_optimizer(self.pipe, cfg.optimizer, cfg.train.max_steps)
        self.engine, *_ = deepspeed.initialize(
            model=self.pipe, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config
        )
        self.groups, self.accum, self.micro = groups, layout.accum, cfg.train.micro_batch_size
        self.num_heads = model.vocab.decoder.num_heads
        self.p_inf_term = model.vocab.p_inf_loss_weight > 0
        self.scalars = ScalarCollectives()

    @property
    def lr(self) -> float:
        return self.engine.get_lr()[0]

    def _batches(self, reader: ShardReader, count: int):
        for _ in range(count):
            batch = reader.next_batch(self.micro)
            yield batch[:, :-1], batch[:, 1:]

    def _last_stage_mean(self, field: str, clear: bool = True) -> list[float]:
        """Mean over micro-batches and dp of a loss output kept on the last stage, sent to every rank (``clear``:
        then forget the outputs)."""
        n = self.num_heads if field == "head_losses" else 1
        values = [0.0] * n
        if self.engine.is_last_stage() and self.groups.tp_rank == 0:
            values = torch.stack([getattr(o, field).detach().float().reshape(n) for o in self.loss_fn.outputs])
            values = values.mean(0) / self.groups.dp
        if clear:
            self.loss_fn.outputs.clear()
        return self.scalars.sum(values)

    def train_step(self, reader: ShardReader) -> StepStats:
        loss = self.engine.train_batch(data_iter=self._batches(reader, self.accum))
        heads = self._last_stage_mean("head_losses", clear=not self.p_inf_term)
        p_inf = self._last_stage_mean("p_inf_nll")[0] if self.p_inf_term else None
        return StepStats(loss=float(loss), head_losses=heads, grad_norm=_grad_norm(self.engine), p_inf_loss=p_inf)

    def _last_stage_sum(self, field: str, length: int) -> list[float]:
        """Sum over micro-batches and dp of a loss output ``[length]`` kept on the last stage, sent to every rank;
        then forget the outputs."""
        values = [0.0] * length
        if self.engine.is_last_stage() and self.groups.tp_rank == 0:
            values = torch.stack([getattr(o, field).detach().double() for o in self.loss_fn.outputs]).sum(0)
        self.loss_fn.outputs.clear()
        return self.scalars.sum(values)

    @torch.no_grad()
    def evaluate(self, reader: ShardReader, batches: int) -> dict:
        """As :meth:`DataParallelTrainer.evaluate`; the last stage computes the loss outputs."""
        data = [reader.next_batch(self.micro) for _ in range(batches)]
        first = {}

        def one_pass(temperatures: torch.Tensor) -> list[float]:
            self.loss_fn.with_p_inf, self.loss_fn.temperatures = True, temperatures
            loss = self.engine.eval_batch(data_iter=iter([(b[:, :-1], b[:, 1:]) for b in data]),
                                          num_micro_batches=batches)
            self.loss_fn.with_p_inf, self.loss_fn.temperatures = False, None
            if not first:
                first.update(loss=float(loss), heads=self._last_stage_mean("head_losses", clear=False))
            return self._last_stage_sum("eval_sums", 4 + 2 * len(temperatures))

        fit = fit_temperature(one_pass)
        return validation_metrics(first["loss"], first["heads"], fit)


def build_trainer(cfg: RunConfig, model: LanguageModel, groups: ParallelGroups, ds_config: dict, layout: Layout,
                  materialise: Callable[[nn.Module], nn.Module] | None = None):
    cls = PipelineTrainer if layout.pp > 1 else DataParallelTrainer
    return cls(cfg, model, groups, ds_config, layout, materialise)
