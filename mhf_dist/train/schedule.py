"""The learning-rate schedules (``optimizer.schedule``): the multiplier of ``optimizer.lr`` at each step
(``lr_factor``), where the decay begins (``decay_begins``), the phase a step is in (``phase``), and the check that a
resume changing the schedule's timing keeps the learning rate continuous (``check_continuous``). Torch-free:
``status`` reads it too. What each schedule is for: docs/schedules.md.
"""

from __future__ import annotations

import math

from mhf_dist.config import ConfigError, OptimizerConfig
from mhf_dist.config.schema import WSD_DECAY_FRACTION, WSD_DECAY_SHAPE

SHAPES = {  # a decay's curve: the share of (lr - min) left at progress p in [0, 1]
    "linear": lambda p: 1 - p,
    "cosine": lambda p: 0.5 * (1 + math.cos(math.pi * p)),
    "1-sqrt": lambda p: 1 - math.sqrt(p),
}
# the settings that place the schedule's phases in time (with train.max_steps); lr, min_lr_ratio and the groups'
# scales are values, which a resume applies as given
TIMING = ("schedule", "warmup_steps", "decay_start", "decay_fraction", "decay_shape")


def decay_begins(cfg: OptimizerConfig, max_steps: int) -> int:
    """The 0-based step at which the decay begins (its factor is still 1 there): the warm-up's end for cosine and
    linear; for wsd ``decay_start``, else ``max_steps`` less ``decay_fraction`` of it (rounded), not before the
    warm-up's end; ``max_steps`` (never) for constant."""
    if cfg.schedule == "constant":
        return max_steps
    if cfg.schedule != "wsd":
        return cfg.warmup_steps
    if cfg.decay_start is not None:
        return cfg.decay_start
    fraction = WSD_DECAY_FRACTION if cfg.decay_fraction is None else cfg.decay_fraction
    return max(cfg.warmup_steps, max_steps - round(fraction * max_steps))


def lr_factor(step: int, cfg: OptimizerConfig, max_steps: int) -> float:
    """Multiplier of ``cfg.lr`` for 0-based optimizer ``step``: the linear warm-up, 1 until the decay begins, then
    the decay's curve from 1 to ``min_lr_ratio``, which it reaches at ``max_steps``."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    begins = decay_begins(cfg, max_steps)
    if cfg.schedule == "constant" or step < begins:
        return 1.0
    progress = min(1.0, (step - begins) / max(1, max_steps - begins))
    shape = cfg.schedule if cfg.schedule != "wsd" else cfg.decay_shape or WSD_DECAY_SHAPE
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * SHAPES[shape](progress)


def phase(step: int, cfg: OptimizerConfig, max_steps: int) -> str:
    """The phase of 0-based ``step``: ``warm-up``, ``stable`` (wsd before its decay), ``constant`` or ``decay``."""
    if step < cfg.warmup_steps:
        return "warm-up"
    if cfg.schedule == "constant":
        return "constant"
    return "stable" if step < decay_begins(cfg, max_steps) else "decay"


def check_continuous(
    start: int, was: OptimizerConfig, was_max_steps: int, cfg: OptimizerConfig, max_steps: int
) -> None:
    """A resume after ``start`` steps under ``cfg`` and ``max_steps``, from a checkpoint of schedule ``was`` and
    ``was_max_steps``: a ``ConfigError`` naming the fix when the factor of the first resumed step differs from the
    one the checkpoint's schedule gives it (with the new ``min_lr_ratio``: a value, applied as given), unless
    ``cfg.allow_lr_jump`` or no step is left to train."""
    if cfg.allow_lr_jump or start >= max_steps:
        return
    before = lr_factor(
        start, was.model_copy(update={"min_lr_ratio": cfg.min_lr_ratio}), was_max_steps
    )
    after = lr_factor(start, cfg, max_steps)
    if before == after:
        return
    changed = (
        [f"train.max_steps {was_max_steps} -> {max_steps}"] if max_steps != was_max_steps else []
    )
    changed += [
        f"optimizer.{k} {getattr(was, k)} -> {getattr(cfg, k)}"
        for k in TIMING
        if getattr(was, k) != getattr(cfg, k)
    ]
    raise ConfigError(
        f"{', '.join(changed)} would make the learning rate jump at the resumed step {start + 1}, from "
        f"{before:.4g} to {after:.4g} x optimizer.lr: "
        + _fix(start, was, was_max_steps, cfg, max_steps)
        + "; or take the jump on purpose: --set optimizer.allow_lr_jump=true (for this start)"
    )


def _fix(
    start: int, was: OptimizerConfig, was_max_steps: int, cfg: OptimizerConfig, max_steps: int
) -> str:
    """What keeps the learning rate continuous, for ``check_continuous``'s message."""
    if (
        cfg.schedule in ("cosine", "linear")
        and was.schedule == cfg.schedule
        and max_steps != was_max_steps
    ):
        return (
            f"optimizer.schedule={cfg.schedule} decays from the warm-up's end to train.max_steps, so a run past "
            "its warm-up cannot change its length without that jump; keep train.max_steps="
            f"{was_max_steps} (train.stop_at_step ends a run earlier without changing its schedule), and train "
            "the runs you may extend with optimizer.schedule=wsd (the learning rate stays at its peak until the "
            "decay, which a longer run moves later)"
        )
    if cfg.decay_start is not None and cfg.decay_start < start:
        return (
            f"optimizer.decay_start={cfg.decay_start} is before step {start}, the checkpoint's: decay from the "
            f"checkpoint of step {cfg.decay_start} (--resume RUN/checkpoints/step-{cfg.decay_start:08d}), or set "
            f"decay_start to {start} or later"
        )
    if start > (begins := decay_begins(was, was_max_steps)):
        return (
            f"step {start}, the checkpoint's, is past step {begins}, after which the schedule it was trained with "
            f"(optimizer.schedule={was.schedule}, train.max_steps={was_max_steps}) decays; resume from a checkpoint "
            f"saved before its decay, at step {begins} or earlier (--resume RUN/checkpoints/step-N), or keep "
            f"train.max_steps={was_max_steps} and its schedule"
        )
    return "keep the checkpoint's schedule settings, or change them at a checkpoint where the learning rates agree"
