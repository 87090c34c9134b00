"""AdamW with its learning-rate schedule (``schedule``: by default the docs/spec.md §6 recipe, warm-up and cosine
decay), in parameter groups.

By default weight decay applies to matrices and tables (``ndim >= 2``), not to biases and norm gains, as in the
authors' Hugging Face Trainer set-up: two groups. ``optimizer.groups`` rules, applied in order, set a learning-rate
scale and a weight decay per parameter family (``mhf_dist.model.families``). A parameter's group is given by
whether it is a matrix and which rules match it (``GroupKey``), not by the values the rules set, so a resume may
change the values (said once, as for ``optimizer.lr``) but not which rules there are (their Adam state is kept per
group).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from mhf_dist.config import ConfigError, OptimizerConfig
from mhf_dist.model.families import FAMILIES, families
from mhf_dist.train.schedule import TIMING, check_continuous, decay_begins, lr_factor

if TYPE_CHECKING:
    from mhf_dist.backend import OptimizerFactory, Trainer
    from mhf_dist.config import RunConfig


GroupKey = tuple[bool, tuple[int, ...]]
"""A parameter's group: (a matrix or table, ``ndim >= 2``; the indices of the ``optimizer.groups`` rules that match
its families)."""

DEFAULT_KEYS: tuple[GroupKey, ...] = ((True, ()), (False, ()))  # today's two groups, always first


def group_key(name: str, ndim: int, cfg: OptimizerConfig) -> GroupKey:
    """The group of the parameter called ``name`` (LanguageModel naming) with ``ndim`` dimensions."""
    of = families(name)
    return ndim >= 2, tuple(i for i, rule in enumerate(cfg.groups) if rule.match in of)


def group_settings(key: GroupKey, cfg: OptimizerConfig) -> tuple[float, float]:
    """``(lr_scale, weight_decay)`` of group ``key``: the default, then each matching rule in order."""
    matrix, matched = key
    scale, decay = 1.0, cfg.weight_decay if matrix else 0.0
    for rule in (cfg.groups[i] for i in matched):
        scale = scale if rule.lr_scale is None else rule.lr_scale
        decay = decay if rule.weight_decay is None else rule.weight_decay
    return scale, decay


def group_name(key: GroupKey, cfg: OptimizerConfig) -> str:
    matrix, matched = key
    if not matched:
        return "matrices and tables" if matrix else "biases and gains"
    return f"{'+'.join(cfg.groups[i].match for i in matched)} ({'matrices' if matrix else 'biases and gains'})"


def describe_groups(named: Iterable[tuple[str, torch.nn.Parameter]], cfg: OptimizerConfig) -> str:
    """The start-up line of a whole model's trainable parameters (``named``): each group's size and settings.
    ConfigError when a rule's family matches no parameter."""
    sizes: dict[GroupKey, int] = {}
    present: set[str] = set()
    for name, p in named:
        if p.requires_grad:
            present |= families(name)
            key = group_key(name, p.dim(), cfg)
            sizes[key] = sizes.get(key, 0) + p.numel()
    for i, rule in enumerate(cfg.groups):
        if rule.match not in present:
            raise ConfigError(
                f"optimizer.groups[{i}].match={rule.match} matches no trainable parameter of this model; "
                f"its families: {', '.join(f for f in FAMILIES if f in present)}"
            )
    parts = []
    for key in sorted(sizes, key=_order):
        scale, decay = group_settings(key, cfg)
        parts.append(
            f"{group_name(key, cfg)} {sizes[key] / 1e6:.2f}M (lr x{scale:g}, weight decay {decay:g})"
        )
    return "optimizer groups: " + "; ".join(parts)


def _order(key: GroupKey) -> tuple:
    return key[1], not key[0]  # the default two first, matrices before the rest


def skippable(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``optimizer`` (torch's fused AdamW) made able to leave a step out without the host waiting for the device:
    its ``skip_if``, when set, returns a device scalar at the step, 1.0 to apply no update (weights, moments and
    step counts stay as they were, bit for bit), 0.0 to apply it. It becomes the fused kernel's ``found_inf``, as
    torch's AMP grad scaler leaves out a step with an overflow, through a step pre-hook (the optimizer keeps its
    class: DeepSpeed's ZeRO takes the optimizers it knows by their exact type). A ZeRO optimizer calls the step once
    per parameter group or sub-group."""
    optimizer.skip_if = None

    def before_step(opt: torch.optim.Optimizer, args, kwargs) -> None:
        # the kernel takes float32
        opt.found_inf = None if opt.skip_if is None else opt.skip_if().float()

    optimizer.register_step_pre_hook(before_step)
    return optimizer


def build_optimizer(
    named: Iterable[tuple[str, torch.nn.Parameter]],
    cfg: OptimizerConfig,
    max_steps: int,
    ndim: Callable[[torch.nn.Parameter], int] = torch.Tensor.dim,
):
    """``(AdamW, LambdaLR)`` for the trainable parameters of ``named`` (``(name in LanguageModel naming,
    parameter)``); ``ndim`` gives a parameter's dimensions (the backend's, where it has replaced parameters by flat
    partitions). The optimizer's ``group_keys`` name each param group's ``GroupKey``; it is ``skippable``."""
    members: dict[GroupKey, list[torch.nn.Parameter]] = {key: [] for key in DEFAULT_KEYS}
    for name, p in named:
        if p.requires_grad:
            members.setdefault(group_key(name, ndim(p), cfg), []).append(p)
    keys = sorted(members, key=_order)
    groups = []
    for key in keys:
        scale, decay = group_settings(key, cfg)
        groups.append({"params": members[key], "lr": cfg.lr * scale, "weight_decay": decay})
    # the fused kernel (one pass over each parameter on CPU and GPU) steps 100m 4-5x faster on CPU than foreach
    optimizer = skippable(
        torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=True)
    )
    optimizer.group_keys = keys
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, cfg, max_steps)
    )
    return optimizer, scheduler


def optimizer_factory(cfg: RunConfig) -> OptimizerFactory:
    """What the backend makes its optimizer with: ``build_optimizer`` with the run's settings."""
    return lambda named, ndim: build_optimizer(named, cfg.optimizer, cfg.train.max_steps, ndim)


def check_resumed_groups(saved: dict, cfg: OptimizerConfig) -> None:
    """A checkpoint's ``optimizer`` settings (``saved``) resume under ``cfg`` only with the same rules, in the same
    order (their values may change): ConfigError naming both otherwise."""
    was = [rule["match"] for rule in saved.get("groups") or []]
    now = [rule.match for rule in cfg.groups]
    if was != now:
        raise ConfigError(
            f"optimizer.groups matches [{', '.join(was)}] in the checkpoint and [{', '.join(now)}] "
            "now: a resume keeps which rules form the groups (their Adam state is kept per group); "
            "keep the checkpoint's rules, in its order, and change their lr_scale and weight_decay"
        )


def apply_optimizer_changes(
    trainer: Trainer, saved: dict, cfg: OptimizerConfig, max_steps: int, saved_max_steps: int
) -> list[str]:
    """After a resume, the config's optimizer settings and ``train.max_steps`` where they differ from the
    checkpoint's (``saved``, its ``optimizer`` section, and ``saved_max_steps``): the LR schedule is a function of
    the step and the new settings, the new ``max_steps`` included, from the first resumed step on (the restored
    optimizer holds the old schedule's value otherwise); Adam's betas, eps and weight decay apply from the next step
    (``grad_clip`` is DeepSpeed's, set from the config at start). A change of the schedule's length or timing that
    makes the learning rate jump is refused (``check_continuous``). Returns one line per change, for the log."""
    # a checkpoint of an earlier version lacks the settings added since: it trained with their defaults
    was = OptimizerConfig().model_dump(mode="json") | saved
    ours = cfg.model_dump(mode="json")
    changed = [
        f"optimizer.{k}: {was.get(k)!r} -> {v!r}"
        for k, v in ours.items()
        if was.get(k) != v and k != "allow_lr_jump"  # an instruction to one start
    ]
    if max_steps != saved_max_steps or any(was.get(k) != ours[k] for k in TIMING):
        check_continuous(
            trainer.lr_scheduler.last_epoch,
            OptimizerConfig.model_validate(
                {k: v for k, v in was.items() if k in OptimizerConfig.model_fields}
            ),
            saved_max_steps,
            cfg,
            max_steps,
        )
    if max_steps != saved_max_steps:
        decay = (
            f"; its decay begins after step {decay_begins(cfg, max_steps)}"
            if cfg.schedule == "wsd"
            else ""
        )
        changed.append(
            f"train.max_steps: {saved_max_steps} -> {max_steps} (the learning-rate schedule now ends at "
            f"step {max_steps}{decay})"
        )
    if not changed:
        return []
    scheduler = trainer.lr_scheduler
    factor = lr_factor(scheduler.last_epoch, cfg, max_steps)
    settings = [group_settings(key, cfg) for key in trainer.optimizer.group_keys]
    scheduler.base_lrs = [cfg.lr * scale for scale, _ in settings]
    for i, (scale, decay) in enumerate(settings):
        for group in {
            id(g): g
            for g in (trainer.optimizer.param_groups[i], scheduler.optimizer.param_groups[i])
        }.values():
            group.update(
                lr=cfg.lr * scale * factor, betas=cfg.betas, eps=cfg.eps, weight_decay=decay
            )
    return changed
