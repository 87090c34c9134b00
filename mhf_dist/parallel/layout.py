"""The parallel layout of a run (tp × pp × dp, micro-batches) and its process-group backend, resolved before any
rank starts (``mhf_dist.train.preflight.preflight`` adds the engine config). Nothing here imports torch, so
``plan``, ``submit`` and ``train`` check a layout in a fraction of a second on a login node."""

from __future__ import annotations

from dataclasses import dataclass

from mhf_dist.config import ConfigError, RunConfig, TrainConfig


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
    return Layout(
        tp=tp, pp=pp, dp=dp, accum=cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp)
    )


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
    # what the global batch must be a multiple of
    step = dp if train.micro_batch_from_preset else micro * dp
    near = " or ".join(
        f"train.global_batch_size={g}"
        for g in (total // step * step, (total // step + 1) * step)
        if g
    )
    other_micro = (
        f"train.micro_batch_size={' or '.join(map(str, fitting[:3]))}, or " if fitting else ""
    )
    raise ConfigError(
        f"train.global_batch_size={total} is not a multiple of train.micro_batch_size × dp = {micro} × {dp}; "
        f"set {other_micro}{near}"
    )


def backend_name(setting: str, device_type: str) -> str:
    """``train.dist_backend`` resolved for ranks on ``device_type`` (cpu, cuda): ``auto`` is NCCL (RCCL on ROCm
    builds, under the same name) on GPUs and gloo on CPUs."""
    if setting == "auto":
        return "gloo" if device_type == "cpu" else "nccl"
    if setting == "nccl" and device_type == "cpu":
        raise ConfigError(
            "train.dist_backend=nccl needs GPUs; this run is on CPUs (use auto or gloo)"
        )
    return setting
