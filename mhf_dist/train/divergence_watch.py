"""The loss watch as a run's callback (``DivergenceWatch``): the limits of each step, the verdict on each step
and the rollbacks, over ``LossWatch`` and
``Rollbacks``."""

from __future__ import annotations

from tqdm.auto import tqdm

from mhf_dist.backend import SpikeLimits
from mhf_dist.train.callbacks import Callback, RunContext, Stepped
from mhf_dist.train.divergence import DivergenceSettings, LossWatch
from mhf_dist.train.rollback import Rollbacks


class DivergenceWatch(Callback):
    """A run's ``LossWatch``: each step's limits (``train.on_spike`` skip or rollback), its verdict on each step
    (warnings, the counters in the record, a stop), its window in checkpoints (``loss_watch``) and the rollbacks of
    ``train.on_spike=rollback`` (``Rollbacks``)."""

    def __init__(self, cfg: DivergenceSettings):
        self.cfg, self.watch = cfg, LossWatch(cfg)
        self.rolling_back = False  # this watch asked for the rollback under way

    def state_dict(self) -> dict:
        return {"loss_watch": self.watch.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.watch = LossWatch(self.cfg)
        self.watch.load_state_dict(state["loss_watch"])

    def on_start(self, run: RunContext) -> None:
        self.run, self.rollbacks = run, Rollbacks(run.run, self.cfg, run.job.rank)

    def spike_limits(self) -> SpikeLimits | None:
        return self.watch.limits() if self.cfg.on_spike != "warn" else None

    def after_step(self, step: int, stepped: Stepped) -> None:
        stats = stepped.stats
        for warning in self.watch.observe(step, stats.loss, stats.grad_norm, stats.skipped):
            if self.run.job.rank == 0:
                tqdm.write(f"warning: {warning}")

    def record(self, step: int, stepped: Stepped) -> dict:
        watch = self.watch
        return (
            {
                "nonfinite_steps": watch.nonfinite_steps,
                "skipped_steps": self.run.trainer.skipped_steps + watch.skipped,
            }
            | ({"loss_spikes": watch.loss_spikes} if self.cfg.spike_factor is not None else {})
            | ({"grad_spikes": watch.grad_spikes} if self.cfg.grad_spike_factor is not None else {})
        )

    def wants_rollback(self, step: int) -> bool:
        self.watch.stop_if_diverged()
        self.rolling_back = self.rollbacks.due(self.watch.spikes_within(step))
        return self.rolling_back

    def on_rollback(self, step: int) -> None:
        if self.rolling_back:
            self.rollbacks.go_back(
                step,
                self.watch.spikes_within(step),
                self.run.checkpointer,
                self.run.data,
                self.run.load,
            )
