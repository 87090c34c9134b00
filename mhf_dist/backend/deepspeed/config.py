"""The DeepSpeed config of a run, and what the rest of the package reads from one.

A file from ``deepspeed_configs/`` (``parallel.deepspeed_config``) completed from the run config — batch sizes,
gradient accumulation, clipping, bf16, ZeRO stage — and finally overridden by ``parallel.deepspeed``. A bf16 run
accumulates its gradients over micro-batches and reduces them over dp in fp32 (``BF16_GRADIENTS``, beneath the
file: DeepSpeed's own default for both is bf16, and under ZeRO-1 only fp32 accumulation selects its bf16 optimizer).
Nothing here imports DeepSpeed or torch (``plan`` and ``submit`` read it on a login node).
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from mhf_dist.config import ConfigError, RunConfig, deep_merge

if TYPE_CHECKING:
    from mhf_dist.parallel.layout import Layout

# the named configs, shipped in the package
CONFIG_DIR = resources.files("mhf_dist") / "deepspeed_configs"
# What a bf16 run's DeepSpeed config says unless its file or parallel.deepspeed says otherwise: gradients accumulated
# (ZeRO-3: its gradient partitions; ZeRO-1: the bf16 optimizer's whole fp32 gradients) and reduced over dp in fp32.
# The bf16 optimizer adds each parameter's gradient into fp32 as soon as backward has made it (immediate_grad_update).
# Otherwise it keeps the bf16 gradients to the step and clears them between micro-batches only in a hook DeepSpeed
# attaches to the forward's output tensors; where that hook does not run, every micro-batch's gradient is added again
# with each later one (seen under ZeRO-1, pp = 1 and pp = 2). immediate_grad_update depends on no such hook.
BF16_GRADIENTS = {
    "bf16": {"immediate_grad_update": True},
    "data_types": {"grad_accum_dtype": "fp32"},
    "communication_data_type": "fp32",
}


def engine_config(cfg: RunConfig, layout: Layout, device_type: str) -> dict:
    """The DeepSpeed config of this run on ``device_type`` ranks (cpu, cuda; the module docstring gives the
    precedence)."""
    name = cfg.parallel.deepspeed_config
    if name == "auto":
        name = (
            "cpu_fp32"
            if device_type == "cpu"
            else ("zero3_bf16_actckpt" if layout.pp == 1 else "zero1_pp_bf16")
        )
    path = Path(name) if name.endswith(".json") else CONFIG_DIR / f"{name}.json"
    bf16 = cfg.train.dtype == "bf16"
    try:
        base = deep_merge(BF16_GRADIENTS if bf16 else {}, json.loads(path.read_text()))
    except (OSError, json.JSONDecodeError) as e:
        available = ", ".join(
            sorted(
                p.name.removesuffix(".json")
                for p in CONFIG_DIR.iterdir()
                if p.name.endswith(".json")
            )
        )
        raise ConfigError(
            f"parallel.deepspeed_config={name!r}: cannot read {path} ({e}); use one of {available} "
            "or a path to a .json file"
        ) from e
    stage = cfg.parallel.zero_stage
    if stage is None:
        stage = base.get("zero_optimization", {}).get("stage", 3 if layout.pp == 1 else 1)
        # the DeepSpeed file's stage, or its default
        cfg.check_zero_stage(stage, f"ZeRO stage {stage}")
    derived = {
        "train_micro_batch_size_per_gpu": cfg.train.micro_batch_size,
        "gradient_accumulation_steps": layout.accum,
        "train_batch_size": cfg.train.global_batch_size,
        "gradient_clipping": cfg.optimizer.grad_clip,
        "bf16": {"enabled": bf16},
        "zero_optimization": {"stage": stage},
    }
    resolved = deep_merge(deep_merge(base, derived), cfg.parallel.deepspeed)
    if bf16 and zero_stage(resolved) == 0 and grad_accum_dtype(resolved) == "fp32":
        raise ConfigError(
            "train.dtype=bf16 with ZeRO stage 0: DeepSpeed accumulates gradients in fp32 only under "
            "ZeRO; use parallel.zero_stage 1, 2 or 3 (or accept bf16 accumulation: --set "
            "parallel.deepspeed.data_types.grad_accum_dtype=bf16)"
        )
    return resolved


def zero_stage(ds_config: dict) -> int:
    """The ZeRO stage of a DeepSpeed config (0 without a ``zero_optimization`` section)."""
    return int(ds_config.get("zero_optimization", {}).get("stage", 0))


def grad_accum_dtype(ds_config: dict) -> str:
    """The dtype a DeepSpeed config accumulates gradients in: ``data_types.grad_accum_dtype``, else the model's."""
    default = "bf16" if ds_config.get("bf16", {}).get("enabled") else "fp32"
    return ds_config.get("data_types", {}).get("grad_accum_dtype") or default


def checkpoint_interval(cfg: RunConfig, ds_config: dict) -> int:
    """Every k-th block is recomputed in backward: ``parallel.activation_checkpoint_interval``, else 1 when the
    DeepSpeed config has an ``activation_checkpointing`` section; 0: none."""
    interval = cfg.parallel.activation_checkpoint_interval
    return interval if interval is not None else int("activation_checkpointing" in ds_config)


def fp32_accumulation(ds_config: dict) -> bool:
    """Whether a bf16 DeepSpeed config accumulates its gradients in fp32 (``data_types.grad_accum_dtype``)."""
    return bool(ds_config.get("bf16", {}).get("enabled")) and grad_accum_dtype(ds_config) == "fp32"
