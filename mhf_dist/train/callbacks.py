"""Callbacks: what the training loop tells the code that watches a run, and asks of it, at the points of its phases.

The loop names no monitor: the hang watchdog, the straggler watch, the loss watch, the save clock and the logs are
``Callback`` subclasses (``monitors`` assembles them), as are the test suite's injected
faults and a user's own (``train.callbacks``, ``installed``). Every rank calls every hook, in the callbacks'
order; a hook that answers (``Callback.wants_save``, ``Callback.flag``, ``Callback.wants_rollback``,
``Callback.allows_save``) answers alike on every rank. docs/design-training.md, "Training loop", says why the
hooks are these.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from mhf_dist.backend import SpikeLimits
from mhf_dist.config import ConfigError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from pathlib import Path

    import torch

    from mhf_dist.backend import LossWrapper, StepStats, Trainer
    from mhf_dist.config import RunConfig
    from mhf_dist.data.training_data import TrainingData
    from mhf_dist.storage.run_dir import RunDir
    from mhf_dist.train.checkpoint import Checkpointer
    from mhf_dist.train.process_group import Job
    from mhf_dist.train.progress import Progress
    from mhf_dist.train.run_assets import RunAssets


class Stepped(NamedTuple):
    """One optimizer step: what the engine reported, the learning rate it used, and its wall time."""

    stats: StepStats
    lr: float
    seconds: float


@dataclass(frozen=True)
class RunContext:
    """What a callback may use of the run, handed to ``Callback.on_start``."""

    cfg: RunConfig
    run: RunDir
    job: Job  # this rank's place in the job: rank, world, layout, device, groups, collectives
    assets: RunAssets  # the tokenizer, signature table, Engram compression table, shards and skipped ranges
    trainer: Trainer
    data: TrainingData
    checkpointer: Checkpointer
    progress: Progress  # the step reached, the first and last of this start, which steps are logged
    data_restarted: str | None  # data.restart dropped the resumed position, in other data: why
    # back to a checkpoint as a resume loads it (engine, RNG and every registered state); its client state
    load: Callable[[Path], dict]


class Callback:
    """The hooks, each doing nothing here; a callback overrides those it needs. A callback with state of its own
    returns it from ``state_dict``, under keys of its own, and the checkpoints keep it (``client_state``)."""

    wrap_loss: LossWrapper | None = (
        None  # a change to each training micro-batch's loss, given to the trainer
    )
    save_reason = "callback"  # what a save this callback asked for (wants_save) is recorded as

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        """``state``: the keys of ``state_dict``, from a checkpoint (one saved before they were kept: as at the
        callback's start)."""

    def on_start(self, run: RunContext) -> None:
        """Set-up is done (a resumed checkpoint loaded); the steps follow ``run.progress.start``."""

    def before_step(self, step: int) -> None:
        """``step`` begins."""

    def spike_limits(self) -> SpikeLimits | None:
        """What the next step may reach and still update the weights (None: no limit)."""
        return None

    def wants_save(self) -> bool:
        """Asked at the end of each step: whether to save it (the ranks agree: one rank asking saves on all)."""
        return False

    def flag(self) -> bool:
        """Asked at the end of each step, beside ``wants_save``: this rank's answer to a question of the callback's
        own, which the ranks agree on in the same transfer (raised on one rank: raised on all)."""
        return False

    def flag_agreed(self, step: int, raised: bool) -> None:
        """What the ranks agreed on ``flag`` at the end of ``step``; told before ``after_step``."""

    def after_step(self, step: int, stepped: Stepped) -> None:
        """``step`` is done."""

    def record(self, step: int, stepped: Stepped) -> dict:
        """What this callback adds to a logged step's record (rank 0's is logged)."""
        return {}

    def before_eval(self, step: int) -> None:
        """An evaluation at ``step`` begins."""

    def eval_progress(self) -> None:
        """The evaluation under way made progress (a micro-batch, or a pipeline's pass)."""

    def evaluates(self, step: int) -> bool:
        """After the validation pass of ``step`` (the same answer on every rank): whether ``evaluation`` runs."""
        return False

    def evaluation(self, step: int, progress: Callable[[], None]) -> dict:
        """An evaluation of the callback's own at ``step`` (``evaluates``; ``before_eval`` told first): what it
        adds to the step's record (rank 0's is logged); ``progress`` called as it goes (``eval_progress``)."""
        return {}

    def on_log(self, step: int, record: dict) -> None:
        """``record`` is the step's complete record (its measures, callbacks' fields, evaluation)."""

    def wants_rollback(self, step: int) -> bool:
        """After the step's log: whether the run goes back to an earlier checkpoint (``on_rollback``). A
        callback may raise here instead, to stop the run."""
        return False

    def on_rollback(self, step: int) -> None:
        """The run goes back from ``step``: the callback that asked loads its checkpoint (``RunContext.load``)."""

    def after_rollback(self, step: int) -> None:
        """The run went back to ``step``, the checkpoint's; training goes on from there."""

    def allows_save(self, step: int, stepped: Stepped, reason: str) -> bool:
        """Whether ``step`` may be saved (for ``reason``)."""
        return True

    def before_save(self, step: int) -> None:
        """``step`` is about to be saved."""

    def after_save(self, step: int, path: Path) -> None:
        """``step`` was saved in ``path`` (its files maybe still being written, with ``train.checkpoint_async``)."""

    def on_end(self, step: int) -> None:
        """The steps are over (at the last step, or on a signal); the last save is waited for next."""

    def close(self, finished: bool) -> None:
        """Last, also after an error (``finished`` False): release what the callback holds."""


class Callbacks:
    """A run's callbacks in order; each hook of theirs called on every one, its answers combined."""

    def __init__(self, callbacks: list[Callback]):
        self.callbacks = list(callbacks)

    def __iter__(self) -> Iterator[Callback]:
        return iter(self.callbacks)

    def loss_wrapper(self) -> LossWrapper | None:
        """The callbacks' changes to a training loss, one after the other (None: none)."""
        wrappers = [c.wrap_loss for c in self if c.wrap_loss is not None]
        if not wrappers:
            return None

        def wrapped(loss: torch.Tensor) -> torch.Tensor:
            for wrap in wrappers:
                loss = wrap(loss)
            return loss

        return wrapped

    def on_start(self, run: RunContext) -> None:
        for c in self:
            c.on_start(run)

    def before_step(self, step: int) -> None:
        for c in self:
            c.before_step(step)

    def spike_limits(self) -> SpikeLimits | None:
        """The tightest of the callbacks' limits."""
        limits = [lim for c in self if (lim := c.spike_limits()) is not None]
        if not limits:
            return None
        return SpikeLimits(min(lim.loss for lim in limits), min(lim.grad_norm for lim in limits))

    def wants_save(self) -> list[bool]:
        """The callbacks' flags at a step's end, which the loop asks last of its flags: each callback's
        ``Callback.wants_save``, then each one's ``Callback.flag``."""
        return [c.wants_save() for c in self] + [c.flag() for c in self]

    def save_reason(self, wanted: list[bool]) -> str | None:
        """The reason of the first callback whose ``Callback.wants_save`` the ranks agreed on (``wanted``, which
        goes on with the flags)."""
        return next((c.save_reason for c, w in zip(self, wanted) if w), None)

    def after_step(self, step: int, stepped: Stepped) -> None:
        """Each callback's agreed ``Callback.flag`` (the last of the step's agreed flags), then ``after_step``."""
        agreed, n = stepped.stats.flags, len(self.callbacks)
        raised = agreed[-n:] if agreed is not None and n and len(agreed) >= n else [False] * n
        for c, flag in zip(self, raised):
            c.flag_agreed(step, flag)
        for c in self:
            c.after_step(step, stepped)

    def record(self, step: int, stepped: Stepped) -> dict:
        return {key: value for c in self for key, value in c.record(step, stepped).items()}

    def before_eval(self, step: int) -> None:
        for c in self:
            c.before_eval(step)

    def eval_progress(self) -> None:
        for c in self:
            c.eval_progress()

    def evaluation(self, step: int) -> dict:
        """The record's fields of each callback that ``evaluates`` at ``step``, the phase marked first."""
        found = {}
        for c in self:
            if c.evaluates(step):
                self.before_eval(step)
                found |= c.evaluation(step, self.eval_progress)
        return found

    def on_log(self, step: int, record: dict) -> None:
        for c in self:
            c.on_log(step, record)

    def wants_rollback(self, step: int) -> bool:
        # every callback asked: one may stop the run instead
        return any([c.wants_rollback(step) for c in self])

    def on_rollback(self, step: int) -> None:
        for c in self:
            c.on_rollback(step)

    def after_rollback(self, step: int) -> None:
        for c in self:
            c.after_rollback(step)

    def allows_save(self, step: int, stepped: Stepped, reason: str) -> bool:
        # the first refusal ends the asking
        return all(c.allows_save(step, stepped, reason) for c in self)

    def before_save(self, step: int) -> None:
        for c in self:
            c.before_save(step)

    def after_save(self, step: int, path: Path) -> None:
        for c in self:
            c.after_save(step, path)

    def on_end(self, step: int) -> None:
        for c in self:
            c.on_end(step)

    def close(self, finished: bool) -> None:
        for c in self:
            c.close(finished)


def installed(paths: list[str]) -> list[Callback]:
    """The callbacks ``train.callbacks`` names, each ``module:Class`` (importable where the ranks run: installed, or
    on PYTHONPATH), made without arguments."""
    found = []
    for path in paths:
        module, _, name = path.partition(":")
        try:
            kind = getattr(importlib.import_module(module), name) if name else None
        except (ImportError, AttributeError) as e:
            raise ConfigError(
                f"train.callbacks: {path!r} cannot be imported ({e}); name a Callback class as "
                "module:Class, its module installed or on PYTHONPATH"
            ) from e
        if not (isinstance(kind, type) and issubclass(kind, Callback)):
            raise ConfigError(
                f"train.callbacks: {path!r} is not a Callback class (mhf_dist.train.callbacks."
                "Callback); name one as module:Class"
            )
        found.append(kind())
    return found
