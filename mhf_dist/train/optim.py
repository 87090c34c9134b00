"""AdamW with linear warm-up and cosine decay (docs/spec.md §6 recipe).

Weight decay applies to matrices and tables (``ndim >= 2``), not to biases and
norm gains, as in the authors' Hugging Face Trainer set-up.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from mhf_dist.config import OptimizerConfig

if TYPE_CHECKING:
    from mhf_dist.backend import OptimizerFactory, Trainer
    from mhf_dist.config import RunConfig


def lr_factor(step: int, cfg: OptimizerConfig, max_steps: int) -> float:
    """Multiplier of ``cfg.lr`` for 0-based optimizer ``step``: warm-up, then cosine to ``min_lr_ratio``."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, max_steps - cfg.warmup_steps))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(model: torch.nn.Module, cfg: OptimizerConfig, max_steps: int,
                    ndim: Callable[[torch.nn.Parameter], int] = torch.Tensor.dim):
    """``(AdamW, LambdaLR)`` for ``model``'s trainable parameters; ``ndim`` gives a parameter's dimensions (the
    backend's, where it has replaced parameters by flat partitions)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if ndim(p) >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if ndim(p) < 2], "weight_decay": 0.0},
    ]
    # the fused kernel (one pass over each parameter on CPU and GPU) steps 100m 4-5x faster on CPU than foreach
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg, max_steps))
    return optimizer, scheduler


def optimizer_factory(cfg: RunConfig) -> OptimizerFactory:
    """What the backend makes its optimizer with: :func:`build_optimizer` with the run's settings."""
    return lambda module, ndim: build_optimizer(module, cfg.optimizer, cfg.train.max_steps, ndim)


def apply_optimizer_changes(trainer: Trainer, saved: dict, cfg: OptimizerConfig, max_steps: int,
                            saved_max_steps: int) -> list[str]:
    """After a resume, the config's optimizer settings and ``train.max_steps`` where they differ from the
    checkpoint's (``saved``, its ``optimizer`` section, and ``saved_max_steps``): the LR schedule is a function of
    the step and the new settings, the new ``max_steps`` included, from the first resumed step on (the restored
    optimizer holds the old schedule's value otherwise); Adam's betas, eps and weight decay apply from the next step
    (``grad_clip`` is DeepSpeed's, set from the config at start). Returns one line per change, for the log."""
    ours = cfg.model_dump(mode="json")
    changed = [f"optimizer.{k}: {saved.get(k)!r} -> {v!r}" for k, v in ours.items() if saved.get(k) != v]
    if max_steps != saved_max_steps:
        changed.append(f"train.max_steps: {saved_max_steps} -> {max_steps} (the learning-rate schedule now ends at "
                       f"step {max_steps})")
    if not changed:
        return []
    scheduler = trainer.lr_scheduler
    scheduler.base_lrs = [cfg.lr] * len(scheduler.base_lrs)
    lr = cfg.lr * lr_factor(scheduler.last_epoch, cfg, max_steps)
    for group in {id(g): g for g in [*trainer.optimizer.param_groups, *scheduler.optimizer.param_groups]}.values():
        group.update(lr=lr, betas=cfg.betas, eps=cfg.eps)
        if group["weight_decay"]:  # the decayed group (matrices and tables); the other stays at 0
            group["weight_decay"] = cfg.weight_decay
    return changed
