"""The parallel layout of a run and its DeepSpeed config, resolved before any rank starts.

``plan``, ``submit`` and ``train`` share these checks; nothing here imports
DeepSpeed or torch, so they run in a fraction of a second on a login node.

The DeepSpeed config is a file from ``deepspeed_configs/`` (``parallel.deepspeed_config``)
completed from the run config — batch sizes, gradient accumulation, clipping,
bf16, ZeRO stage — and finally overridden by ``parallel.deepspeed``. A bf16 run
accumulates its gradients over micro-batches and reduces them over dp in fp32
(:data:`BF16_GRADIENTS`, beneath the file: DeepSpeed's own default for both is
bf16, and under ZeRO-1 only fp32 accumulation selects its bf16 optimizer).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from mhf_dist.config import ConfigError, RunConfig, TrainConfig, check_data_source, deep_merge

CONFIG_DIR = resources.files("mhf_dist") / "deepspeed_configs"  # the named configs, shipped in the package
# What a bf16 run's DeepSpeed config says unless its file or parallel.deepspeed says otherwise: gradients accumulated
# (ZeRO-3: its gradient partitions; ZeRO-1: the bf16 optimizer's whole fp32 gradients) and reduced over dp in fp32.
# The bf16 optimizer adds each parameter's gradient into fp32 as soon as backward has made it (immediate_grad_update).
# Otherwise it keeps the bf16 gradients to the step and clears them between micro-batches only in a hook DeepSpeed
# attaches to the forward's output tensors; where that hook does not run, every micro-batch's gradient is added again
# with each later one (seen under ZeRO-1, pp = 1 and pp = 2). immediate_grad_update depends on no such hook.
BF16_GRADIENTS = {"bf16": {"immediate_grad_update": True}, "data_types": {"grad_accum_dtype": "fp32"},
                  "communication_data_type": "fp32"}


@dataclass
class Layout:
    tp: int
    pp: int
    dp: int
    accum: int  # micro-batches per optimizer step on each data-parallel rank


def data_parallel_size(world_size: int, tp: int, pp: int) -> int:
    """dp of ``world_size = tp · pp · dp`` ranks; a clear error when tp·pp does not divide the world."""
    if world_size % (tp * pp):
        raise ConfigError(
            f"world size {world_size} does not fit parallel.tp={tp} × parallel.pp={pp}: launch a multiple of "
            f"{tp * pp} ranks (dp = world / (tp·pp)) or change tp/pp"
        )
    return world_size // (tp * pp)


def resolve_layout(cfg: RunConfig, world_size: int) -> Layout:
    """tp × pp × dp for ``world_size`` ranks; a clear error before any collective runs."""
    tp, pp = cfg.parallel.tp, cfg.parallel.pp
    dp = data_parallel_size(world_size, tp, pp)
    fit_micro_batch(cfg.train, dp)
    return Layout(tp=tp, pp=pp, dp=dp, accum=cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp))


def fit_micro_batch(train: TrainConfig, dp: int) -> None:
    """Each optimizer step is ``global_batch_size`` sequences in micro-batches of ``micro_batch_size`` on each of
    ``dp`` replicas. A preset's micro-batch is lowered to the largest that divides (the global batch is the
    recipe; the micro-batch only trades memory for steps); one the user set is kept or refused, with what fits."""
    total, micro = train.global_batch_size, train.micro_batch_size
    if total % (micro * dp) == 0:
        return
    fitting = [m for m in range(min(micro, total // dp), 0, -1) if total % (m * dp) == 0]
    if fitting and train.micro_batch_from_preset:
        train.micro_batch_size = fitting[0]
        return
    step = dp if train.micro_batch_from_preset else micro * dp  # what the global batch must be a multiple of
    near = " or ".join(f"train.global_batch_size={g}" for g in (total // step * step, (total // step + 1) * step) if g)
    other_micro = f"train.micro_batch_size={' or '.join(map(str, fitting[:3]))}, or " if fitting else ""
    raise ConfigError(
        f"train.global_batch_size={total} is not a multiple of train.micro_batch_size × dp = {micro} × {dp}; "
        f"set {other_micro}{near}")


def deepspeed_config(cfg: RunConfig, layout: Layout, device_type: str) -> dict:
    """The DeepSpeed config for this run (see module docstring for the precedence)."""
    name = cfg.parallel.deepspeed_config
    if name == "auto":
        name = "cpu_fp32" if device_type == "cpu" else ("zero3_bf16_actckpt" if layout.pp == 1 else "zero1_pp_bf16")
    path = Path(name) if name.endswith(".json") else CONFIG_DIR / f"{name}.json"
    bf16 = cfg.train.dtype == "bf16"
    try:
        base = deep_merge(BF16_GRADIENTS if bf16 else {}, json.loads(path.read_text()))
    except (OSError, json.JSONDecodeError) as e:
        available = ", ".join(sorted(p.name.removesuffix(".json") for p in CONFIG_DIR.iterdir()
                                     if p.name.endswith(".json")))
        raise ConfigError(f"parallel.deepspeed_config={name!r}: cannot read {path} ({e}); use one of {available} "
                          "or a path to a .json file") from e
    stage = cfg.parallel.zero_stage
    if stage is None:
        stage = base.get("zero_optimization", {}).get("stage", 3 if layout.pp == 1 else 1)
        cfg.check_zero_stage(stage, f"ZeRO stage {stage}")  # the DeepSpeed file's stage, or its default
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
        raise ConfigError("train.dtype=bf16 with ZeRO stage 0: DeepSpeed accumulates gradients in fp32 only under "
                          "ZeRO; use parallel.zero_stage 1, 2 or 3 (or accept bf16 accumulation: --set "
                          "parallel.deepspeed.data_types.grad_accum_dtype=bf16)")
    return resolved


def preflight(cfg: RunConfig, world_size: int, device: str, data_here: bool = True) -> tuple[Layout, dict]:
    """Every check before a launch on ``device`` ranks (cpu, cuda): the data source (on this machine unless
    ``data_here`` is False), the layout for ``world_size`` and the DeepSpeed config; before any rank starts."""
    check_data_source(cfg, data_here)
    backend_name(cfg.train.dist_backend, device)
    layout = resolve_layout(cfg, world_size)
    return layout, deepspeed_config(cfg, layout, device)


def backend_name(setting: str, device_type: str) -> str:
    """``train.dist_backend`` resolved for ranks on ``device_type`` (cpu, cuda): ``auto`` is NCCL (RCCL on ROCm
    builds, under the same name) on GPUs and gloo on CPUs."""
    if setting == "auto":
        return "gloo" if device_type == "cpu" else "nccl"
    if setting == "nccl" and device_type == "cpu":
        raise ConfigError("train.dist_backend=nccl needs GPUs; this run is on CPUs (use auto or gloo)")
    return setting


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
