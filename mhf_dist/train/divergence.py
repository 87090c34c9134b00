"""Watching the loss for divergence: non-finite steps and spikes (``train.on_nonfinite``, ``train.spike_factor``).

The logged loss and gradient norm are global (averaged over the data-parallel
ranks, norm over every shard), so every rank reaches the same verdict at the
same step without another collective. A run whose loss stays non-finite for
``train.max_nonfinite_steps`` steps stops with :class:`TrainingDiverged`
(exit 2) instead of training on and saving NaN weights; the checkpoint it can
resume from is the newest one, which was saved while the loss was finite.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from mhf_dist.config import TrainConfig
from mhf_dist.errors import MhfError

SPIKE_WINDOW = 50  # finite losses the spike test compares against


class TrainingDiverged(MhfError, RuntimeError):
    """The loss or gradient norm stayed NaN/inf for ``train.max_nonfinite_steps`` steps in a row."""


class LossWatch:
    """Counts non-finite steps and loss spikes, one :meth:`observe` per optimizer step."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.streak: list[int] = []  # steps of the current run of non-finite steps
        self.nonfinite_steps = self.loss_spikes = 0
        self.recent: deque[float] = deque(maxlen=SPIKE_WINDOW)

    @staticmethod
    def finite(loss: float, grad_norm: float | None) -> bool:
        return math.isfinite(loss) and (grad_norm is None or math.isfinite(grad_norm))

    def observe(self, step: int, loss: float, grad_norm: float | None) -> list[str]:
        """Record ``step``'s loss; returns warnings to log."""
        if not self.finite(loss, grad_norm):
            self.nonfinite_steps += 1
            self.streak.append(step)
            return [f"step {step}: loss {loss:.4g}, gradient norm {grad_norm} (not finite)"]
        self.streak = []
        spike = (self.cfg.spike_factor is not None and len(self.recent) >= 5
                 and loss > self.cfg.spike_factor * statistics.median(self.recent))
        if spike:
            self.loss_spikes += 1
            return [f"step {step}: loss spike {loss:.4g} > {self.cfg.spike_factor:g} x median of the last "
                    f"{len(self.recent)} ({statistics.median(self.recent):.4g})"]
        self.recent.append(loss)
        return []

    def stop_if_diverged(self) -> None:
        """Under ``on_nonfinite=stop``: raise :class:`TrainingDiverged` once the streak is long enough."""
        if self.cfg.on_nonfinite == "stop" and len(self.streak) >= self.cfg.max_nonfinite_steps:
            raise TrainingDiverged(
                f"the loss or gradient norm was not finite for {len(self.streak)} steps in a row (steps "
                f"{self.streak[0]}-{self.streak[-1]}); stopped without saving them. Resume from the newest checkpoint "
                "(saved while the loss was finite) with a lower optimizer.lr, a longer optimizer.warmup_steps or a "
                "tighter optimizer.grad_clip (changes apply on resume), or set train.on_nonfinite=warn")
