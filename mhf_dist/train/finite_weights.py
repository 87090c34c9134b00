"""Never a checkpoint of non-finite numbers: a save is refused when its step's loss or gradient norm, or any rank's
weights, are NaN or infinite, and the newest checkpoint stays the one to resume from."""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from mhf_dist.backend import Trainer
from mhf_dist.parallel.scalars import ScalarCollectives
from mhf_dist.train.callbacks import Callback, RunContext, Stepped
from mhf_dist.train.divergence import LossWatch


def weights_finite(trainer: Trainer, scalars: ScalarCollectives) -> bool:
    """Whether every rank's parameters (its ZeRO-3 partition, or its whole stage) hold only finite values."""
    bad = any(not torch.isfinite(p).all() for p in trainer.local_parameters())
    return not scalars.any(bad)[0]


class FiniteWeights(Callback):
    """The check before each save (the loss first: global, so the ranks skip the weights' collective alike)."""

    def on_start(self, run: RunContext) -> None:
        self.run = run

    def allows_save(self, step: int, stepped: Stepped, reason: str) -> bool:
        run, stats = self.run, stepped.stats
        if LossWatch.finite(stats.loss, stats.grad_norm) and weights_finite(
            run.trainer, run.job.scalars
        ):
            return True
        if run.job.rank == 0:
            tqdm.write(
                f"warning: not saving step {step} ({reason}): its loss or weights are not finite; the newest "
                f"checkpoint, {run.checkpointer.latest()}, stays the one to resume from"
            )
        return False
