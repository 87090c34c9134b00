"""DeepSpeed engines for every layout: pp = 1, ``deepspeed.initialize`` on the (tensor-parallel) model, ZeRO-3 by
default (the bucket tables route every use through their ``forward``, so ZeRO-3 gathers them like any tied
embedding); pp > 1, a ``PipelineModule`` (:mod:`mhf_dist.backend.deepspeed.pipeline`) with ZeRO-1 (DeepSpeed's
pipeline engine refuses ZeRO-2/3, so asking for them is a config error).

The model arrives as a skeleton (:mod:`mhf_dist.parallel.construct`) with the ``materialise`` that makes it real:
pp = 1 materialises it whole (partitioned leaf by leaf under ZeRO-3) before ``deepspeed.initialize``; pp > 1 hands it
to the pipeline, whose stages materialise their own layers. Without ``materialise`` the model is taken as built. The
DeepSpeed config comes from :mod:`mhf_dist.backend.deepspeed.config`. Both trainers are the backend's
:class:`~mhf_dist.backend.Trainer`: the same ``train_step`` / ``evaluate``, checkpoint files and optimizer state. A
training step reads its numbers from the device once (:func:`read_step`: the losses, the global gradient norm and the
loop's flags in one transfer); what else waits for the device in a step is DeepSpeed's own (docs/design-training.md,
"Host syncs"; ``tests/test_host_syncs.py`` counts them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import deepspeed
import torch
from torch import nn

from mhf_dist.backend import (
    BatchSource,
    FileWriter,
    HostTableFactory,
    HostTableStep,
    LossWrapper,
    OptimizerFactory,
    SpikeLimits,
    StepStats,
    Trainer,
    TrainingFlags,
)
from mhf_dist.backend.deepspeed.checkpoint import load_checkpoint, save_checkpoint
from mhf_dist.backend.deepspeed.config import zero_stage
from mhf_dist.backend.deepspeed.grad_norm import include_in_global_norm
from mhf_dist.backend.deepspeed.health import EngineHealth, counted_here, layout_for
from mhf_dist.backend.deepspeed.pipeline import VOCAB, build_pipeline, canonical_name
from mhf_dist.backend.deepspeed.universal import copy_for_rank
from mhf_dist.backend.deepspeed.zero import full_ndim, held_values
from mhf_dist.config import RunConfig
from mhf_dist.model.calibration import fit_temperature, validation_metrics
from mhf_dist.model.health import ForwardHealth
from mhf_dist.model.lm import LanguageModel
from mhf_dist.model.scoring import EvalSums
from mhf_dist.parallel.groups import ParallelGroups
from mhf_dist.parallel.layout import Layout
from mhf_dist.parallel.scalars import ScalarCollectives
from mhf_dist.parallel.tensor_parallel import tp_split_dims


class SpikeVerdict:
    """Whether a step is left out under ``limits``, as the torch optimizer's ``skip_if``: decided when the ZeRO
    optimizer first calls it in the step (it has the step's global gradient norm by then) from ``loss()`` (the
    step's global mean loss, on the device) and that norm, agreed over all ranks (a MAX), on the device: 1.0 to
    leave the step out. An overflow that DeepSpeed skips itself never asks (:attr:`value` stays None)."""

    def __init__(self, limits: SpikeLimits, loss: Callable[[], torch.Tensor], zero_optimizer,
                 scalars: ScalarCollectives):
        self.limits, self.loss, self.zero_optimizer, self.scalars = limits, loss, zero_optimizer, scalars
        self.value: torch.Tensor | None = None

    def __call__(self) -> torch.Tensor:
        if self.value is None:
            loss = self.loss().double()
            over = ~(loss <= self.limits.loss)  # NaN is past any limit
            norm = self.zero_optimizer._global_grad_norm  # the step's, set before the torch optimizer's step
            if norm is not None:  # compared in float64, as the host compares the norm it reads
                over |= ~(torch.as_tensor(norm, device=loss.device).double() <= self.limits.grad_norm)
            self.value = self.scalars.max_tensor(over.double()).reshape(())  # a scalar, as the kernel takes it
        return self.value


def read_step(scalars: ScalarCollectives, stats: torch.Tensor, engine, flags: TrainingFlags | None,
              verdict: SpikeVerdict | None = None, extra: torch.Tensor | None = None
              ) -> tuple[list[float], float | None, list[bool] | None, bool, list[float]]:
    """``(stats, grad norm, flags agreed over all ranks, left out, extra)`` in one host transfer: ``stats`` (already
    reduced, on the device), the engine's global gradient norm (a device scalar under ZeRO; a Python number after an
    overflow), ``flags()`` (all-reduced with MAX on the device), the step's ``verdict`` where it was asked and the
    device values ``extra`` (the health metrics of a log step)."""
    norm = engine.get_global_grad_norm()
    tail = [] if extra is None else [extra]
    parts = [stats] + ([norm] if torch.is_tensor(norm) else [])
    if flags is not None:
        parts.append(scalars.any_tensor(*flags()))
    decided = verdict is not None and verdict.value is not None
    if decided:
        parts.append(verdict.value)
    values = scalars.read(*parts, *tail)
    if extra is not None:
        values, extra_values = values[:-extra.numel()], values[-extra.numel():]
    n = stats.numel()
    grad_norm = values[n] if torch.is_tensor(norm) else None if norm is None else float(norm)
    rest = values[n + torch.is_tensor(norm):]
    skipped = decided and bool(rest.pop())
    agreed = [bool(v) for v in rest] if flags is not None else None
    return values[:n], grad_norm, agreed, skipped, extra_values if extra is not None else []


class EngineTrainer:
    """What both trainers share of their DeepSpeed engine (``self.engine``): the :class:`~mhf_dist.backend.Trainer`
    protocol but the steps and the evaluation."""

    engine: deepspeed.DeepSpeedEngine
    host_tables: HostTableStep | None = None
    wrap_loss: LossWrapper | None = None  # what each training micro-batch's loss becomes (LossWrapper)
    left_out = False  # the last step was past its spike limits
    health: EngineHealth | None = None  # train.health_metrics

    def _measure_health(self, cfg: RunConfig, model: LanguageModel, named: Sequence[tuple[str, nn.Parameter]],
                        ds_config: dict, forward: ForwardHealth) -> None:
        """Set up the health metrics (:mod:`~mhf_dist.backend.deepspeed.health`) of ``model`` (the whole model's
        skeleton), whose parameters this rank trains are ``named`` (the model's naming)."""
        if not cfg.train.health_metrics:
            return
        counted = counted_here(self.groups, tp_split_dims(cfg.model, self.groups.tp), zero_stage(ds_config) > 0,
                               self.groups.pp_rank == 0)
        self.health = EngineHealth(self.optimizer, named, counted, forward, self.engine.device)

    def _health_summary(self, measured: bool) -> torch.Tensor | None:
        """A measured step's health values, on the device (None when not measured)."""
        if not measured:
            return None
        return self.health.summary(self.scalars, self.engine.get_global_grad_norm(), self.gradient_clipping())

    @property
    def lr(self) -> float:
        return self.engine.get_lr()[0]

    @property
    def skipped_steps(self) -> int:
        return self.engine.skipped_steps

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer the run's factory made, which a ZeRO optimizer wraps."""
        return getattr(self.engine.optimizer, "optimizer", self.engine.optimizer)

    @property
    def lr_scheduler(self) -> torch.optim.lr_scheduler.LRScheduler:
        return self.engine.lr_scheduler

    def local_parameters(self) -> Iterator[torch.Tensor]:
        return (held_values(p) for p in self.engine.module.parameters())

    def gradient_clipping(self) -> float:
        return self.engine.gradient_clipping()

    def step_skipped(self) -> bool:
        return self.left_out or getattr(self.engine.optimizer, "overflow", False)

    def _arm(self, limits: SpikeLimits | None, loss: Callable[[], torch.Tensor]) -> SpikeVerdict | None:
        """The verdict the torch optimizer asks for in this step's update, under ``limits``."""
        verdict = None if limits is None else SpikeVerdict(limits, loss, self.engine.optimizer, self.scalars)
        self.optimizer.skip_if = verdict
        return verdict

    def global_grad_norm(self) -> float:
        return float(self.engine.optimizer._global_grad_norm)

    def save_files(self, path: Path, client: dict, writer: FileWriter) -> None:
        save_checkpoint(self.engine, path, client, writer)

    def load_files(self, path: Path, universal: bool) -> dict | None:
        if universal:  # under ZeRO-3 each tensor-parallel rank has its own copy
            path = copy_for_rank(path, self.groups.tp_rank)
        return load_checkpoint(self.engine, self.optimizer, path, universal)


class DataParallelTrainer(EngineTrainer):
    """pp = 1: the model (tensor-parallel or not) under a DeepSpeed engine, ZeRO-0…3."""

    def __init__(self, cfg: RunConfig, model: LanguageModel, groups: ParallelGroups, ds_config: dict, layout: Layout,
                 make_optimizer: OptimizerFactory, materialise: Callable[[nn.Module], nn.Module] | None = None,
                 host_tables: HostTableFactory | None = None, wrap_loss: LossWrapper | None = None):
        self.wrap_loss = wrap_loss
        if materialise is not None:
            model = materialise(model)
        optimizer, scheduler = make_optimizer(list(model.named_parameters()), full_ndim)
        self.engine, *_ = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config, mpu=groups
        )
        self.groups, self.accum, self.micro = groups, layout.accum, cfg.train.micro_batch_size
        self.scalars = ScalarCollectives()
        first = groups.tp_rank == 0
        self._measure_health(cfg, model, list(model.named_parameters()), ds_config,
                             ForwardHealth(model.vocab, layout_for(model), self.engine.device, first, first))
        if host_tables is not None:
            self.host_tables = host_tables(model, self)
            include_in_global_norm(self.engine.optimizer, self.host_tables.host_norm_on)

    def train_step(self, reader: BatchSource, flags: TrainingFlags | None = None, limits: SpikeLimits | None = None,
                   health: bool = False) -> StepStats:
        """One optimizer step; ``flags`` (e.g. stop and save requests) are asked for at its end and come back
        agreed over all ranks in :attr:`StepStats.flags`, read with the step's other numbers; past ``limits``, no
        update (:class:`SpikeVerdict`); ``health``: measure the health metrics (:attr:`StepStats.health`)."""
        self.engine.train()
        losses = []
        verdict = self._arm(limits, lambda: means[0])
        measured = health and self.health is not None
        if measured:
            self.health.arm()
        host, device = self.host_tables, self.engine.device
        pin = device.type == "cuda"  # pinned micro-batches: copies to the device that do not block the host
        batch = reader.next_batch(self.micro, pin=pin)
        if host:
            host.prefetch(batch[:, :-1])
        for i in range(self.accum):
            if host:
                host.advance()
            on_device = batch.to(device, non_blocking=True)
            out = self.engine(on_device[:, :-1], on_device[:, 1:], entropy=measured)
            if self.health is not None:
                self.health.forward.count_targets(on_device[:, 1:])
                self.health.forward.add_entropy(out.head_entropy, 1 / (self.accum * self.groups.dp))
            if self.wrap_loss is not None:
                out = out._replace(loss=self.wrap_loss(out.loss))
            if i + 1 < self.accum:  # the next micro-batch's rows are gathered while this one computes
                batch = reader.next_batch(self.micro, pin=pin)
                if host:
                    host.prefetch(batch[:, :-1])
            self.engine.backward(out.loss)
            # a training forward returns a P_inf NLL only with the loss's log P_inf term (λ > 0)
            p_inf = [] if out.p_inf_nll is None else [out.p_inf_nll.detach()[None]]
            values = [out.loss.detach()[None], out.head_losses.detach(), *p_inf]
            losses.append(torch.cat([v.to(out.loss.dtype) for v in values]))
            if i + 1 == self.accum:  # the step's losses, before its update (which a spike verdict reads)
                means = self.scalars.mean_tensor(torch.stack(losses).mean(0), self.groups.dp_group)
                if host:
                    host.before_step()
            self.engine.step()
        stats, grad_norm, agreed, self.left_out, measures = read_step(self.scalars, means, self.engine, flags,
                                                                      verdict, self._health_summary(measured))
        self.optimizer.skip_if = None
        if host:
            host.after_step(grad_norm)
        heads = len(out.head_losses)
        return StepStats(loss=stats[0], head_losses=stats[1:1 + heads], grad_norm=grad_norm,
                         p_inf_loss=stats[1 + heads] if p_inf else None, flags=agreed, skipped=self.left_out,
                         health=self.health.metrics(measures) if measured else None)

    @torch.no_grad()
    def evaluate(self, reader: BatchSource, batches: int, progress: Callable[[], None] = lambda: None) -> dict:
        """The ``val_*`` metrics over ``batches`` micro-batches on each data-parallel rank (``progress`` called after
        each one): the training loss and
        head losses (means over micro-batches and ranks), and ``P_inf``'s NLL, top-1/top-5 and temperature fit
        from sums over every token of every rank (:func:`~mhf_dist.model.calibration.fit_temperature`: two
        passes over the same micro-batches)."""
        self.engine.eval()
        device = self.engine.device
        data = [reader.next_batch(self.micro, pin=device.type == "cuda").to(device, non_blocking=True)
                for _ in range(batches)]
        losses = []

        def one_pass(temperatures: torch.Tensor) -> list[float]:
            sums = 0
            for batch in data:
                # nothing to differentiate: the model's own entry point (ZeRO-3 gathers the weights per submodule)
                out = self.engine.module.evaluation(batch[:, :-1], batch[:, 1:], temperatures)
                sums = sums + out.sums
                progress()
                if len(losses) < len(data):  # the first pass's
                    losses.append(torch.cat([out.loss.detach().float()[None], out.head_losses.detach().float()]))
            return self.scalars.sum(sums, self.groups.dp_group)

        fit = fit_temperature(one_pass)
        loss, *heads = self.scalars.mean(torch.stack(losses).mean(0), self.groups.dp_group)
        return validation_metrics(loss, heads, fit)


class PipelineTrainer(EngineTrainer):
    """pp > 1: DeepSpeed's pipeline engine over the stages of :func:`build_pipeline`, ZeRO-0/1."""

    def __init__(self, cfg: RunConfig, model: LanguageModel, groups: ParallelGroups, ds_config: dict, layout: Layout,
                 make_optimizer: OptimizerFactory, materialise: Callable[[nn.Module], nn.Module] | None = None,
                 wrap_loss: LossWrapper | None = None):
        health = layout_for(model)  # before the stages freeze their unused parts: the same on every rank
        self.pipe, self.loss_fn = build_pipeline(model, groups, cfg.data.seq_len, materialise)
        self.loss_fn.wrap_loss = wrap_loss
        named = [(canonical_name(n), p) for n, p in self.pipe.named_parameters()]  # this stage's
        optimizer, scheduler = make_optimizer(named, torch.Tensor.dim)
        self.engine, *_ = deepspeed.initialize(
            model=self.pipe, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config
        )
        self.groups, self.accum, self.micro = groups, layout.accum, cfg.train.micro_batch_size
        self.num_heads = model.vocab.decoder.num_heads
        self.p_inf_term = model.vocab.p_inf_loss_weight > 0
        self.scalars = ScalarCollectives()
        vocab = self.pipe.tied_modules[VOCAB].vocab if VOCAB in self.pipe.tied_modules else None
        first = groups.tp_rank == 0
        forward = ForwardHealth(vocab, health, self.engine.device,
                                counts=first and self.engine.is_last_stage(), gate=first and groups.pp_rank == 0)
        self._measure_health(cfg, model, named, ds_config, forward)
        if self.health is not None:  # the targets on the device, where the last stage's loss takes them
            self.loss_fn.count_targets = forward.count_targets

    def _batches(self, reader: BatchSource, count: int):
        for _ in range(count):
            batch = reader.next_batch(self.micro)
            yield batch[:, :-1], batch[:, 1:]

    def _last_stage_means(self, fields: Sequence[str], clear: bool = True) -> torch.Tensor:
        """Means over micro-batches and dp of loss outputs kept on the last stage (``fields``, concatenated), summed
        into every rank and left on the device (``clear``: then forget the outputs)."""
        sizes = [self.num_heads if f == "head_losses" else 1 for f in fields]
        values = [0.0] * sum(sizes)
        if self.engine.is_last_stage() and self.groups.tp_rank == 0:
            values = torch.stack([torch.cat([getattr(o, f).detach().float().reshape(n) for f, n in zip(fields, sizes)])
                                  for o in self.loss_fn.outputs])
            values = values.mean(0) / self.groups.dp
        if clear:
            self.loss_fn.outputs.clear()
        return self.scalars.sum_tensor(values)

    def _last_stage_mean(self, field: str, clear: bool = True) -> list[float]:
        return self.scalars.read(self._last_stage_means([field], clear))

    def train_step(self, reader: BatchSource, flags: TrainingFlags | None = None, limits: SpikeLimits | None = None,
                   health: bool = False) -> StepStats:
        """As :meth:`DataParallelTrainer.train_step`: the loss, the last stage's head losses (and P_inf term), the
        gradient norm, ``flags`` (and the health metrics) in one host transfer. The update is the pipeline
        schedule's last instruction, so a spike verdict reads the loss the last stage kept of each micro-batch."""
        verdict = self._arm(limits, lambda: self._last_stage_means(["loss"], clear=False)[0])
        measured = health and self.health is not None
        self.loss_fn.entropy = measured
        if measured:
            self.health.arm()
        loss = self.engine.train_batch(data_iter=self._batches(reader, self.accum))
        self.optimizer.skip_if = None
        if measured:  # the last stage's micro-batches, on every tp rank (each holds its rows' share)
            for out in self.loss_fn.outputs:
                self.health.forward.add_entropy(out.head_entropy, 1 / (self.accum * self.groups.dp))
        fields = ["head_losses"] + (["p_inf_nll"] if self.p_inf_term else [])
        sums = self._last_stage_means(fields)
        stats, grad_norm, agreed, self.left_out, measures = read_step(
            self.scalars, torch.cat([loss.detach().reshape(1).to(sums), sums]), self.engine, flags, verdict,
            self._health_summary(measured))
        heads = stats[1:1 + self.num_heads]
        p_inf = stats[1 + self.num_heads] if self.p_inf_term else None
        return StepStats(loss=stats[0], head_losses=heads, grad_norm=grad_norm, p_inf_loss=p_inf, flags=agreed,
                         skipped=self.left_out, health=self.health.metrics(measures) if measured else None)

    def _last_stage_sum(self, field: str, length: int) -> list[float]:
        """Sum over micro-batches and dp of a loss output ``[length]`` kept on the last stage, sent to every rank;
        then forget the outputs."""
        values = [0.0] * length
        if self.engine.is_last_stage() and self.groups.tp_rank == 0:
            values = torch.stack([getattr(o, field).detach().double() for o in self.loss_fn.outputs]).sum(0)
        self.loss_fn.outputs.clear()
        return self.scalars.sum(values)

    @torch.no_grad()
    def evaluate(self, reader: BatchSource, batches: int, progress: Callable[[], None] = lambda: None) -> dict:
        """As :meth:`DataParallelTrainer.evaluate` (``progress`` called after each pass over the micro-batches);
        the last stage computes the loss outputs."""
        data = [reader.next_batch(self.micro) for _ in range(batches)]
        first = {}

        def one_pass(temperatures: torch.Tensor) -> list[float]:
            with self.loss_fn.evaluating(temperatures):
                loss = self.engine.eval_batch(data_iter=iter([(b[:, :-1], b[:, 1:]) for b in data]),
                                              num_micro_batches=batches)
            if not first:
                first.update(loss=float(loss), heads=self._last_stage_mean("head_losses", clear=False))
            progress()
            return self._last_stage_sum("sums", EvalSums.length(len(temperatures)))

        fit = fit_temperature(one_pass)
        return validation_metrics(first["loss"], first["heads"], fit)


def build_trainer(cfg: RunConfig, model: LanguageModel, groups: ParallelGroups, ds_config: dict, layout: Layout,
                  make_optimizer: OptimizerFactory, materialise: Callable[[nn.Module], nn.Module] | None = None,
                  load_universal: bool = False, host_tables: HostTableFactory | None = None,
                  wrap_loss: LossWrapper | None = None) -> Trainer:
    """The trainer of ``layout``; ``load_universal``: its checkpoint will be loaded from a universal conversion;
    ``host_tables``: the step of host-memory tables (pp = 1 only); ``wrap_loss``: what each training micro-batch's
    loss becomes."""
    if load_universal:
        ds_config = ds_config | {"checkpoint": {"load_universal": True}}
    if layout.pp > 1:
        return PipelineTrainer(cfg, model, groups, ds_config, layout, make_optimizer, materialise, wrap_loss)
    return DataParallelTrainer(cfg, model, groups, ds_config, layout, make_optimizer, materialise, host_tables,
                               wrap_loss)
