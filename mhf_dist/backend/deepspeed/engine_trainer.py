"""What both DeepSpeed trainers share (``EngineTrainer``): the backend's ``Trainer`` protocol but the steps and
the evaluation; a step's one read from the device (``read_step``: the losses, the global gradient norm and the loop's
flags in one transfer), the verdict on a spike (``SpikeVerdict``, asked by the torch optimizer within DeepSpeed's
step) and, with document masking, what the micro-batches' losses divide by (``loss_divisor``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import deepspeed
import torch
from torch import nn

from mhf_dist.backend import (
    FileWriter,
    HostTableStep,
    LossWrapper,
    SpikeLimits,
    TrainingFlags,
)
from mhf_dist.backend.deepspeed.checkpoint import load_checkpoint, save_checkpoint
from mhf_dist.backend.deepspeed.config import zero_stage
from mhf_dist.backend.deepspeed.health import EngineHealth, counted_here
from mhf_dist.backend.deepspeed.universal import copy_for_rank
from mhf_dist.backend.deepspeed.zero import held_values
from mhf_dist.config import RunConfig
from mhf_dist.model.health import ForwardHealth
from mhf_dist.model.lm import LanguageModel
from mhf_dist.parallel.scalars import ScalarCollectives
from mhf_dist.parallel.tensor_parallel import tp_split_dims


class SpikeVerdict:
    """Whether a step is left out under ``limits``, as the torch optimizer's ``skip_if``: decided when the ZeRO
    optimizer first calls it in the step (it has the step's global gradient norm by then) from ``loss()`` (the
    step's global mean loss, on the device) and that norm, agreed over all ranks (a MAX), on the device: 1.0 to
    leave the step out. An overflow that DeepSpeed skips itself never asks (``value`` stays None)."""

    def __init__(
        self,
        limits: SpikeLimits,
        loss: Callable[[], torch.Tensor],
        zero_optimizer,
        scalars: ScalarCollectives,
    ):
        self.limits, self.loss, self.zero_optimizer, self.scalars = (
            limits,
            loss,
            zero_optimizer,
            scalars,
        )
        self.value: torch.Tensor | None = None

    def __call__(self) -> torch.Tensor:
        if self.value is None:
            loss = self.loss().double()
            over = ~(loss <= self.limits.loss)  # NaN is past any limit
            # the step's, set before the torch optimizer's step
            norm = self.zero_optimizer._global_grad_norm
            if norm is not None:  # compared in float64, as the host compares the norm it reads
                over |= ~(
                    torch.as_tensor(norm, device=loss.device).double() <= self.limits.grad_norm
                )
            # a scalar, as the kernel takes it
            self.value = self.scalars.max_tensor(over.double()).reshape(())
        return self.value


def loss_divisor(
    scalars: ScalarCollectives, targets: Sequence[torch.Tensor], group, dp: int
) -> torch.Tensor:
    """What each of this rank's micro-batches ``targets`` (its share of a global batch) divides its loss's sums by, so
    that their mean over the micro-batches and the ``dp`` ranks of ``group`` (what gradient accumulation, DeepSpeed's
    data-parallel gradient average and the logged means take) is the mean over every kept target (``>= 0``) of the
    global batch: their count over all micro-batches and ranks / (micro-batches × dp). A device scalar (float64), from
    one all-reduce and no host read; with as many kept targets in every micro-batch, their count in one."""
    count = torch.stack([(t >= 0).sum() for t in targets]).sum()
    return scalars.sum_tensor(count, group).div_(len(targets) * dp).reshape(())


def read_step(
    scalars: ScalarCollectives,
    stats: torch.Tensor,
    engine,
    flags: TrainingFlags | None,
    verdict: SpikeVerdict | None = None,
    extra: torch.Tensor | None = None,
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
        values, extra_values = values[: -extra.numel()], values[-extra.numel() :]
    n = stats.numel()
    grad_norm = values[n] if torch.is_tensor(norm) else None if norm is None else float(norm)
    rest = values[n + torch.is_tensor(norm) :]
    skipped = decided and bool(rest.pop())
    agreed = [bool(v) for v in rest] if flags is not None else None
    return values[:n], grad_norm, agreed, skipped, extra_values if extra is not None else []


class EngineTrainer:
    """What both trainers share of their DeepSpeed engine (``self.engine``): the ``Trainer``
    protocol but the steps and the evaluation."""

    engine: deepspeed.DeepSpeedEngine
    host_tables: HostTableStep | None = None
    layers: Sequence[int] | None = None  # the backbone blocks this rank computes (None: all)
    wrap_loss: LossWrapper | None = (
        None  # what each training micro-batch's loss becomes (LossWrapper)
    )
    left_out = False  # the last step was past its spike limits
    health: EngineHealth | None = None  # train.health_metrics
    eos: int | None = None  # data.document_masking's EOS id, whose inputs predict nothing

    def _measure_health(
        self,
        cfg: RunConfig,
        model: LanguageModel,
        named: Sequence[tuple[str, nn.Parameter]],
        ds_config: dict,
        forward: ForwardHealth,
    ) -> None:
        """Set up the health metrics (``health``) of ``model`` (the whole model's
        skeleton), whose parameters this rank trains are ``named`` (the model's naming)."""
        if not cfg.train.health_metrics:
            return
        counted = counted_here(
            self.groups,
            tp_split_dims(cfg.model, self.groups.tp),
            zero_stage(ds_config) > 0,
            self.groups.pp_rank == 0,
        )
        self.health = EngineHealth(self.optimizer, named, counted, forward, self.engine.device)

    def _divisor(self, targets: Sequence[torch.Tensor]) -> torch.Tensor:
        """``loss_divisor`` of this rank's micro-batches ``targets`` over the data-parallel ranks."""
        return loss_divisor(self.scalars, targets, self.groups.dp_group, self.groups.dp)

    def _health_summary(self, measured: bool) -> torch.Tensor | None:
        """A measured step's health values, on the device (None when not measured)."""
        if not measured:
            return None
        return self.health.summary(
            self.scalars, self.engine.get_global_grad_norm(), self.gradient_clipping()
        )

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

    def _arm(
        self, limits: SpikeLimits | None, loss: Callable[[], torch.Tensor]
    ) -> SpikeVerdict | None:
        """The verdict the torch optimizer asks for in this step's update, under ``limits``."""
        verdict = (
            None
            if limits is None
            else SpikeVerdict(limits, loss, self.engine.optimizer, self.scalars)
        )
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
