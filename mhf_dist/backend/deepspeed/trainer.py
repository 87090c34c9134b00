"""DeepSpeed trainers for every layout (``build_trainer``): pp = 1, ``DataParallelTrainer``, ``deepspeed.initialize``
on the (tensor-parallel) model, ZeRO-3 by default; pp > 1, ``PipelineTrainer`` (``pipeline_trainer.py``) with ZeRO-1
(DeepSpeed's pipeline engine refuses ZeRO-2/3). The model arrives as a skeleton with the ``materialise`` that makes
it real (pp = 1 whole, pp > 1 stage by stage). What both trainers share, and a step's one read from the device, are
in ``engine_trainer.py``; docs/design-training.md ("Host syncs") says what else waits for the device.
"""

from __future__ import annotations

from collections.abc import Callable

import deepspeed
import torch
from torch import nn

from mhf_dist.backend import (
    BatchSource,
    HostTableFactory,
    LossWrapper,
    OptimizerFactory,
    SpikeLimits,
    StepStats,
    Trainer,
    TrainingFlags,
)
from mhf_dist.backend.deepspeed.engine_trainer import EngineTrainer, read_step
from mhf_dist.backend.deepspeed.grad_norm import include_in_global_norm
from mhf_dist.backend.deepspeed.health import layout_for
from mhf_dist.backend.deepspeed.pipeline_trainer import PipelineTrainer
from mhf_dist.backend.deepspeed.zero import full_ndim
from mhf_dist.config import RunConfig
from mhf_dist.model.calibration import fit_temperature, validation_metrics
from mhf_dist.model.documents import targets_of
from mhf_dist.model.health import ForwardHealth
from mhf_dist.model.lm import LanguageModel
from mhf_dist.parallel.groups import ParallelGroups
from mhf_dist.parallel.layout import Layout
from mhf_dist.parallel.scalars import ScalarCollectives


class DataParallelTrainer(EngineTrainer):
    """pp = 1: the model (tensor-parallel or not) under a DeepSpeed engine, ZeRO-0…3."""

    def __init__(
        self,
        cfg: RunConfig,
        model: LanguageModel,
        groups: ParallelGroups,
        *,
        ds_config: dict,
        layout: Layout,
        make_optimizer: OptimizerFactory,
        materialise: Callable[[nn.Module], nn.Module] | None = None,
        host_tables: HostTableFactory | None = None,
        wrap_loss: LossWrapper | None = None,
    ):
        self.wrap_loss, self.z_loss_weight = wrap_loss, cfg.train.z_loss_weight
        if materialise is not None:
            model = materialise(model)
        optimizer, scheduler = make_optimizer(list(model.named_parameters()), full_ndim)
        self.engine, *_ = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config, mpu=groups
        )
        self.groups, self.accum, self.micro = groups, layout.accum, cfg.train.micro_batch_size
        self.eos = model.backbone.document_eos  # data.document_masking: EOS inputs predict nothing
        self.scalars = ScalarCollectives()
        first = groups.tp_rank == 0
        self._measure_health(
            cfg,
            model,
            list(model.named_parameters()),
            ds_config,
            ForwardHealth(model.vocab, layout_for(model), self.engine.device, first, first),
        )
        if host_tables is not None:
            self.host_tables = host_tables(model, self)
            include_in_global_norm(self.engine.optimizer, self.host_tables.host_norm_on)

    def train_step(
        self,
        reader: BatchSource,
        flags: TrainingFlags | None = None,
        limits: SpikeLimits | None = None,
        health: bool = False,
    ) -> StepStats:
        """One optimizer step; ``flags`` (e.g. stop and save requests) are asked for at its end and come back
        agreed over all ranks in ``StepStats.flags``, read with the step's other numbers; past ``limits``, no
        update (``SpikeVerdict``); ``health``: measure the health metrics (``StepStats.health``)."""
        self.engine.train()
        losses = []
        verdict = self._arm(limits, lambda: means[0])
        measured = health and self.health is not None
        if measured:
            self.health.arm()
        host, device = self.host_tables, self.engine.device
        # pinned micro-batches: copies to the device that do not block the host
        pin = device.type == "cuda"
        # with document masking the step's micro-batches are read first: the losses divide by the count of kept
        # targets over all of them and the dp ranks (loss_divisor), known before the first forward
        masked = self.eos is not None
        ahead = (
            [reader.next_batch(self.micro, pin=pin) for _ in range(self.accum)] if masked else []
        )
        divisor = self._divisor([targets_of(b, self.eos) for b in ahead]) if masked else None
        batch = ahead[0] if ahead else reader.next_batch(self.micro, pin=pin)
        if host:
            host.prefetch(batch[:, :-1])
        for i in range(self.accum):
            if host:
                host.advance()
            on_device = batch.to(device, non_blocking=True)
            targets = targets_of(on_device, self.eos)
            out = self.engine(
                on_device[:, :-1],
                targets,
                entropy=measured,
                z_loss_weight=self.z_loss_weight,
                divisor=divisor,
            )
            if self.health is not None:
                self.health.forward.count_targets(targets)
                self.health.forward.add_entropy(out.head_entropy, 1 / (self.accum * self.groups.dp))
            if self.wrap_loss is not None:
                out = out._replace(loss=self.wrap_loss(out.loss))
            if (
                i + 1 < self.accum
            ):  # the next micro-batch's rows are gathered while this one computes
                batch = ahead[i + 1] if ahead else reader.next_batch(self.micro, pin=pin)
                if host:
                    host.prefetch(batch[:, :-1])
            self.engine.backward(out.loss)
            # a training forward returns a P_inf NLL only with the loss's log P_inf term (λ > 0), a z-loss only
            # with train.z_loss_weight > 0; the loss logged leaves the z-loss out
            p_inf = [] if out.p_inf_nll is None else [out.p_inf_nll.detach()[None]]
            z_loss = [] if out.z_loss is None else [out.z_loss[None]]
            values = [out.logged_loss[None], out.head_losses.detach(), *p_inf, *z_loss]
            losses.append(torch.cat([v.to(out.loss.dtype) for v in values]))
            if (
                i + 1 == self.accum
            ):  # the step's losses, before its update (which a spike verdict reads)
                means = self.scalars.mean_tensor(torch.stack(losses).mean(0), self.groups.dp_group)
                if host:
                    host.before_step()
            self.engine.step()
        stats, grad_norm, agreed, self.left_out, measures = read_step(
            self.scalars, means, self.engine, flags, verdict, self._health_summary(measured)
        )
        self.optimizer.skip_if = None
        if host:
            host.after_step(grad_norm)
        heads = len(out.head_losses)
        return StepStats(
            loss=stats[0],
            head_losses=stats[1 : 1 + heads],
            grad_norm=grad_norm,
            p_inf_loss=stats[1 + heads] if p_inf else None,
            z_loss=stats[1 + heads + len(p_inf)] if z_loss else None,
            flags=agreed,
            skipped=self.left_out,
            health=self.health.metrics(measures) if measured else None,
        )

    @torch.no_grad()
    def evaluate(
        self, reader: BatchSource, batches: int, progress: Callable[[], None] = lambda: None
    ) -> dict:
        """The ``val_*`` metrics over ``batches`` micro-batches on each data-parallel rank (``progress`` called after
        each one): the training loss and
        head losses (means over micro-batches and ranks; with document masking over every counted token, as a
        training step's), and ``P_inf``'s NLL, top-1/top-5 and temperature fit
        from sums over every token of every rank (``fit_temperature``: two
        passes over the same micro-batches)."""
        self.engine.eval()
        device = self.engine.device
        data = [
            reader.next_batch(self.micro, pin=device.type == "cuda").to(device, non_blocking=True)
            for _ in range(batches)
        ]
        targets = [targets_of(batch, self.eos) for batch in data]
        divisor = self._divisor(targets) if self.eos is not None else None
        losses = []

        def one_pass(temperatures: torch.Tensor) -> list[float]:
            sums = 0
            for batch, wanted in zip(data, targets):
                # nothing to differentiate: the model's own entry point (ZeRO-3 gathers the weights per submodule)
                out = self.engine.module.evaluation(batch[:, :-1], wanted, temperatures, divisor)
                sums = sums + out.sums
                progress()
                if len(losses) < len(data):  # the first pass's
                    losses.append(
                        torch.cat(
                            [out.loss.detach().float()[None], out.head_losses.detach().float()]
                        )
                    )
            return self.scalars.sum(sums, self.groups.dp_group)

        fit = fit_temperature(one_pass)
        loss, *heads = self.scalars.mean(torch.stack(losses).mean(0), self.groups.dp_group)
        return validation_metrics(loss, heads, fit)

    @torch.no_grad()
    def score(
        self,
        batches: list[tuple[torch.Tensor, torch.Tensor]],
        progress: Callable[[], None] = lambda: None,
    ) -> torch.Tensor:
        """Per row of this data-parallel rank's micro-batches ``(inputs [B, S], targets [B, S])`` (the same
        number of them on every rank), ``Σ -log P_inf`` over its targets ``>= 0``, their top-1 hits and count
        (``LanguageModel.row_scores``); ``progress`` called after each. Returns every dp rank's, float64
        ``[dp, rows, 3]`` on the host, on every rank."""
        self.engine.eval()
        device = self.engine.device
        rows = sum(len(inputs) for inputs, _ in batches)
        found = torch.zeros(self.groups.dp, rows, 3, dtype=torch.float64)
        scores = []
        for inputs, targets in batches:
            scores.append(self.engine.module.row_scores(inputs.to(device), targets.to(device)))
            progress()
        if scores and self.groups.tp_rank == 0:  # the tensor-parallel ranks scored the same rows
            found[self.groups.dp_rank] = torch.cat(scores).cpu()
        return self.scalars.sum_tensor(found.flatten()).cpu().view_as(found)


def build_trainer(
    cfg: RunConfig,
    model: LanguageModel,
    groups: ParallelGroups,
    *,
    ds_config: dict,
    layout: Layout,
    make_optimizer: OptimizerFactory,
    materialise: Callable[[nn.Module], nn.Module] | None = None,
    load_universal: bool = False,
    host_tables: HostTableFactory | None = None,
    wrap_loss: LossWrapper | None = None,
) -> Trainer:
    """The trainer of ``layout``; ``load_universal``: its checkpoint will be loaded from a universal conversion;
    ``host_tables``: the step of host-memory tables; ``wrap_loss``: what each training micro-batch's
    loss becomes."""
    if load_universal:
        ds_config = ds_config | {"checkpoint": {"load_universal": True}}
    if layout.pp > 1:
        return PipelineTrainer(
            cfg,
            model,
            groups,
            ds_config=ds_config,
            layout=layout,
            make_optimizer=make_optimizer,
            materialise=materialise,
            host_tables=host_tables,
            wrap_loss=wrap_loss,
        )
    return DataParallelTrainer(
        cfg,
        model,
        groups,
        ds_config=ds_config,
        layout=layout,
        make_optimizer=make_optimizer,
        materialise=materialise,
        host_tables=host_tables,
        wrap_loss=wrap_loss,
    )
