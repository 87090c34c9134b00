"""Watching the loss for divergence: non-finite steps and spikes (``train.on_nonfinite``, ``train.spike_factor``,
``train.grad_spike_factor``, ``train.on_spike``).

The logged loss and gradient norm are global (averaged over the data-parallel ranks, norm over every shard), so every
rank reaches the same verdict at the same step without another collective. A run whose loss stays non-finite for
``train.max_nonfinite_steps`` steps stops with ``TrainingDiverged`` (exit 2) instead of training on and saving NaN
weights. A spike is a loss (or gradient norm) above its factor times the median of the last ``SPIKE_WINDOW``
finite, unspiked ones (once ``MIN_WINDOW`` are known). Under ``on_spike=skip`` (and ``rollback``, which also counts
the recent spikes, ``mhf_dist.train.rollback``) the limits of the next step (``LossWatch.limits``) go to the
trainer, which leaves a step past them out on the device, before its update; the watch counts what the trainer
reports. Its window and counts are saved in checkpoints, so a resumed run judges its steps as the run it continues
would have. ``DivergenceWatch`` is the watch as a run's callback.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Literal

from mhf_dist.backend import SpikeLimits
from mhf_dist.config import TrainConfig
from mhf_dist.errors import MhfError

SPIKE_WINDOW = 50  # finite, unspiked values the spike test compares against
MIN_WINDOW = 5  # values known before the test starts


class TrainingDiverged(MhfError, RuntimeError):
    """The loss or gradient norm stayed NaN/inf for ``train.max_nonfinite_steps`` steps in a row."""


@dataclass(frozen=True)
class DivergenceSettings:
    """What a diverging run does: stop after ``max_nonfinite_steps`` non-finite steps in a row (or warn), the spike
    factors of the loss and the gradient norm (None: not watched), and what a spike does (``on_spike``), a rollback
    after ``spike_patience`` spikes within the window, at most ``max_rollbacks`` of them."""

    on_nonfinite: Literal["stop", "warn"]
    max_nonfinite_steps: int
    spike_factor: float | None
    grad_spike_factor: float | None
    on_spike: Literal["warn", "skip", "rollback"]
    spike_patience: int
    max_rollbacks: int

    @classmethod
    def of(cls, train: TrainConfig) -> DivergenceSettings:
        return cls(
            train.on_nonfinite,
            train.max_nonfinite_steps,
            train.spike_factor,
            train.grad_spike_factor,
            train.on_spike,
            train.spike_patience,
            train.max_rollbacks,
        )


class LossWatch:
    """Counts non-finite steps, spikes and steps left out, one ``observe`` per optimizer step."""

    def __init__(self, cfg: DivergenceSettings):
        self.cfg = cfg
        self.streak: list[int] = []  # steps of the current run of non-finite steps
        self.nonfinite_steps = self.loss_spikes = self.grad_spikes = self.skipped = 0
        self.recent: deque[float] = deque(maxlen=SPIKE_WINDOW)
        self.recent_norms: deque[float] = deque(maxlen=SPIKE_WINDOW)
        self.spike_steps: deque[int] = deque(maxlen=SPIKE_WINDOW)  # the steps of the recent spikes

    @staticmethod
    def finite(loss: float, grad_norm: float | None) -> bool:
        return math.isfinite(loss) and (grad_norm is None or math.isfinite(grad_norm))

    @staticmethod
    def _limit(factor: float | None, window: deque[float]) -> float:
        return (
            factor * statistics.median(window)
            if factor is not None and len(window) >= MIN_WINDOW
            else math.inf
        )

    def limits(self) -> SpikeLimits:
        """The loss and gradient norm the next step may reach without being a spike."""
        return SpikeLimits(
            self._limit(self.cfg.spike_factor, self.recent),
            self._limit(self.cfg.grad_spike_factor, self.recent_norms),
        )

    def observe(
        self, step: int, loss: float, grad_norm: float | None, skipped: bool = False
    ) -> list[str]:
        """Record ``step``'s loss and norm (``skipped``: the trainer left the step out); returns warnings to log."""
        left_out = "; the step applied no update (train.on_spike=skip)" if skipped else ""
        self.skipped += skipped
        if not self.finite(loss, grad_norm):
            self.nonfinite_steps += 1
            self.streak.append(step)
            return [
                f"step {step}: loss {loss:.4g}, gradient norm {grad_norm} (not finite){left_out}"
            ]
        self.streak = []
        limits, warnings = self.limits(), []
        if loss > limits.loss:
            self.loss_spikes += 1
            warnings.append(
                f"step {step}: loss spike {loss:.4g} > {self.cfg.spike_factor:g} x median of the last "
                f"{len(self.recent)} ({statistics.median(self.recent):.4g}){left_out}"
            )
        if grad_norm is not None and grad_norm > limits.grad_norm:
            self.grad_spikes += 1
            warnings.append(
                f"step {step}: gradient spike {grad_norm:.4g} > {self.cfg.grad_spike_factor:g} x median "
                f"of the last {len(self.recent_norms)} ({statistics.median(self.recent_norms):.4g})"
                f"{left_out}"
            )
        if warnings:
            self.spike_steps.append(step)
        else:
            self.recent.append(loss)
            if grad_norm is not None:
                self.recent_norms.append(grad_norm)
        return warnings

    def spikes_within(self, step: int) -> list[int]:
        """The steps of the spikes among the last ``SPIKE_WINDOW`` steps up to ``step``."""
        return [s for s in self.spike_steps if s > step - SPIKE_WINDOW]

    def state_dict(self) -> dict:
        """The window and counts, for a checkpoint."""
        return {
            "recent": list(self.recent),
            "recent_norms": list(self.recent_norms),
            "streak": self.streak,
            "spike_steps": list(self.spike_steps),
            "nonfinite_steps": self.nonfinite_steps,
            "loss_spikes": self.loss_spikes,
            "grad_spikes": self.grad_spikes,
            "skipped": self.skipped,
        }

    def load_state_dict(self, state: dict) -> None:
        self.recent.extend(state["recent"])
        self.recent_norms.extend(state["recent_norms"])
        self.spike_steps.extend(state["spike_steps"])
        self.streak = list(state["streak"])
        self.nonfinite_steps, self.loss_spikes = state["nonfinite_steps"], state["loss_spikes"]
        self.grad_spikes, self.skipped = state["grad_spikes"], state["skipped"]

    def stop_if_diverged(self) -> None:
        """Under ``on_nonfinite=stop``: raise ``TrainingDiverged`` once the streak is long enough."""
        if self.cfg.on_nonfinite == "stop" and len(self.streak) >= self.cfg.max_nonfinite_steps:
            raise TrainingDiverged(
                f"the loss or gradient norm was not finite for {len(self.streak)} steps in a row (steps "
                f"{self.streak[0]}-{self.streak[-1]}); stopped without saving them. Resume from the newest checkpoint "
                "(saved while the loss was finite) with a lower optimizer.lr, a longer optimizer.warmup_steps or a "
                "tighter optimizer.grad_clip (changes apply on resume), or set train.on_nonfinite=warn"
            )
