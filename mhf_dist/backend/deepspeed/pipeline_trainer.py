"""The pipeline trainer (pp > 1): DeepSpeed's pipeline engine over the stages of
``mhf_dist.backend.deepspeed.pipeline``, with ZeRO-1; its steps and evaluation read the last stage's numbers."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

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
    TrainingFlags,
)
from mhf_dist.backend.deepspeed.engine_trainer import EngineTrainer, read_step
from mhf_dist.backend.deepspeed.grad_norm import include_in_global_norm
from mhf_dist.backend.deepspeed.health import layout_for
from mhf_dist.backend.deepspeed.pipeline import VOCAB, build_pipeline, canonical_name
from mhf_dist.config import RunConfig
from mhf_dist.model.calibration import fit_temperature, validation_metrics
from mhf_dist.model.documents import targets_of
from mhf_dist.model.health import ForwardHealth
from mhf_dist.model.lm import LanguageModel
from mhf_dist.model.scoring import EvalSums
from mhf_dist.parallel.groups import ParallelGroups
from mhf_dist.parallel.layout import Layout
from mhf_dist.parallel.scalars import ScalarCollectives
from mhf_dist.parallel.stages import stage_blocks


class PipelineTrainer(EngineTrainer):
    """pp > 1: DeepSpeed's pipeline engine over the stages of ``build_pipeline``, ZeRO-0/1."""

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
        # before the stages freeze their unused parts: the same on every rank
        health = layout_for(model)
        self.pipe, self.loss_fn = build_pipeline(
            model, groups, cfg.data.seq_len, materialise, z_loss_weight=cfg.train.z_loss_weight
        )
        self.loss_fn.wrap_loss = wrap_loss
        named = [(canonical_name(n), p) for n, p in self.pipe.named_parameters()]  # this stage's
        optimizer, scheduler = make_optimizer(named, torch.Tensor.dim)
        self.engine, *_ = deepspeed.initialize(
            model=self.pipe, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config
        )
        self.groups, self.accum, self.micro = groups, layout.accum, cfg.train.micro_batch_size
        self.layers = stage_blocks(self.pipe.parts, cfg.model.n_layers)[groups.pp_rank]
        if host_tables is not None:  # readied inside the engine's step, which its schedule runs
            self.host_tables = host_tables(model, self)
            include_in_global_norm(
                self.engine.optimizer,
                self.host_tables.norm_in_step_on,
                counts=groups.pp_rank == 0 and groups.tp_rank == 0,
            )
        self.eos = model.backbone.document_eos  # data.document_masking: EOS inputs predict nothing
        self.num_heads = model.vocab.decoder.num_heads
        self.p_inf_term = model.vocab.p_inf_loss_weight > 0
        self.z_term = cfg.train.z_loss_weight > 0
        self.scalars = ScalarCollectives()
        vocab = self.pipe.tied_modules[VOCAB].vocab if VOCAB in self.pipe.tied_modules else None
        first = groups.tp_rank == 0
        forward = ForwardHealth(
            vocab,
            health,
            self.engine.device,
            counts=first and self.engine.is_last_stage(),
            gate=first and groups.pp_rank == 0,
        )
        self._measure_health(cfg, model, named, ds_config, forward)
        if (
            self.health is not None
        ):  # the targets on the device, where the last stage's loss takes them
            self.loss_fn.count_targets = forward.count_targets

    def _batches(
        self, reader: BatchSource, count: int
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The step's ``count`` micro-batches as ``(inputs, targets)``, read as the engine asks for them. With
        document masking the last stage reads them all first: its losses divide by the count of kept targets over
        all of them and the dp ranks (``loss_divisor``), known before the first forward."""
        if self.eos is None or not self.engine.is_last_stage():
            return (self._split(reader.next_batch(self.micro)) for _ in range(count))
        batches = [self._split(reader.next_batch(self.micro)) for _ in range(count)]
        self.loss_fn.divisor = self._divisor([targets for _, targets in batches])
        return iter(batches)

    def _split(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return batch[:, :-1], targets_of(batch, self.eos)

    def _last_stage_means(self, fields: Sequence[str], clear: bool = True) -> torch.Tensor:
        """Means over micro-batches and dp of loss outputs kept on the last stage (``fields``, concatenated), summed
        into every rank and left on the device (``clear``: then forget the outputs)."""
        sizes = [self.num_heads if f == "head_losses" else 1 for f in fields]
        values = [0.0] * sum(sizes)
        if self.engine.is_last_stage() and self.groups.tp_rank == 0:
            values = torch.stack(
                [
                    torch.cat(
                        [getattr(o, f).detach().float().reshape(n) for f, n in zip(fields, sizes)]
                    )
                    for o in self.loss_fn.outputs
                ]
            )
            values = values.mean(0) / self.groups.dp
        if clear:
            self.loss_fn.outputs.clear()
        return self.scalars.sum_tensor(values)

    def _last_stage_mean(self, field: str, clear: bool = True) -> list[float]:
        return self.scalars.read(self._last_stage_means([field], clear))

    def train_step(
        self,
        reader: BatchSource,
        flags: TrainingFlags | None = None,
        limits: SpikeLimits | None = None,
        health: bool = False,
    ) -> StepStats:
        """As ``DataParallelTrainer.train_step``: the loss, the last stage's head losses (and P_inf and z-loss
        terms), the gradient norm, ``flags`` (and the health metrics) in one host transfer. The update is the
        pipeline schedule's last instruction, so a spike verdict reads the loss the last stage kept of each
        micro-batch (without its z-loss, as logged)."""
        verdict = self._arm(limits, lambda: self._last_stage_means(["logged_loss"], clear=False)[0])
        measured = health and self.health is not None
        self.loss_fn.entropy = measured
        if measured:
            self.health.arm()
        loss = self.engine.train_batch(data_iter=self._batches(reader, self.accum))
        self.optimizer.skip_if = None
        if (
            measured
        ):  # the last stage's micro-batches, on every tp rank (each holds its rows' share)
            for out in self.loss_fn.outputs:
                self.health.forward.add_entropy(out.head_entropy, 1 / (self.accum * self.groups.dp))
        fields = ["head_losses"] + (["p_inf_nll"] if self.p_inf_term else [])
        sums = self._last_stage_means(fields + (["z_loss"] if self.z_term else []))
        # the engine's loss is the objective's mean: the loss logged leaves the z-loss (the last field) out
        loss = loss.detach().reshape(1).to(sums)
        if self.z_term:
            loss = loss - sums[-1:]
        stats, grad_norm, agreed, self.left_out, measures = read_step(
            self.scalars,
            torch.cat([loss, sums]),
            self.engine,
            flags,
            verdict,
            self._health_summary(measured),
        )
        if self.host_tables is not None:
            self.host_tables.after_step(grad_norm)
        heads = stats[1 : 1 + self.num_heads]
        p_inf = stats[1 + self.num_heads] if self.p_inf_term else None
        return StepStats(
            loss=stats[0],
            head_losses=heads,
            grad_norm=grad_norm,
            p_inf_loss=p_inf,
            z_loss=stats[-1] if self.z_term else None,
            flags=agreed,
            skipped=self.left_out,
            health=self.health.metrics(measures) if measured else None,
        )

    def _last_stage_sum(self, field: str, length: int) -> list[float]:
        """Sum over micro-batches and dp of a loss output ``[length]`` kept on the last stage, sent to every rank;
        then forget the outputs."""
        values = [0.0] * length
        if self.engine.is_last_stage() and self.groups.tp_rank == 0:
            values = torch.stack(
                [getattr(o, field).detach().double() for o in self.loss_fn.outputs]
            ).sum(0)
        self.loss_fn.outputs.clear()
        return self.scalars.sum(values)

    @torch.no_grad()
    def evaluate(
        self, reader: BatchSource, batches: int, progress: Callable[[], None] = lambda: None
    ) -> dict:
        """As ``DataParallelTrainer.evaluate`` (``progress`` called after each pass over the micro-batches);
        the last stage computes the loss outputs."""
        data = [self._split(reader.next_batch(self.micro)) for _ in range(batches)]
        divisor = None
        if self.eos is not None and self.engine.is_last_stage():
            divisor = self._divisor([targets for _, targets in data])
        first = {}

        def one_pass(temperatures: torch.Tensor) -> list[float]:
            with self.loss_fn.evaluating(temperatures, divisor):
                loss = self.engine.eval_batch(data_iter=iter(data), num_micro_batches=batches)
            if not first:
                first.update(
                    loss=float(loss), heads=self._last_stage_mean("head_losses", clear=False)
                )
            progress()
            return self._last_stage_sum("sums", EvalSums.length(len(temperatures)))

        fit = fit_temperature(one_pass)
        return validation_metrics(first["loss"], first["heads"], fit)

    @torch.no_grad()
    def score(
        self,
        batches: list[tuple[torch.Tensor, torch.Tensor]],
        progress: Callable[[], None] = lambda: None,
    ) -> torch.Tensor:
        """As ``DataParallelTrainer.score``: one ``eval_batch`` over the micro-batches, the last stage scores the
        rows (``PipelineLoss.scoring``), every rank receives every data-parallel rank's."""
        rows = sum(len(inputs) for inputs, _ in batches)
        found = torch.zeros(self.groups.dp, rows, 3, dtype=torch.float64)
        if batches:
            with self.loss_fn.scoring():
                self.engine.eval_batch(data_iter=iter(batches), num_micro_batches=len(batches))
            if self.engine.is_last_stage() and self.groups.tp_rank == 0:
                found[self.groups.dp_rank] = torch.cat(self.loss_fn.outputs).cpu()
            self.loss_fn.outputs.clear()
            progress()
        return self.scalars.sum_tensor(found.flatten()).cpu().view_as(found)
