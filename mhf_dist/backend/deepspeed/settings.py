"""The run config's settings of the DeepSpeed engine (``parallel.deepspeed_config``, ``parallel.deepspeed``) and
the ZeRO stages its engines accept. Pydantic only: the config schema takes these in without loading the engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from mhf_dist.errors import ConfigError

if TYPE_CHECKING:
    from mhf_dist.config import RunConfig


class EngineSettings(BaseModel):
    """``parallel``'s keys for the DeepSpeed engine."""

    deepspeed_config: str = Field(
        "auto",
        description="a file in deepspeed_configs/ (name without .json) or a path; auto: cpu_fp32 on CPU, "
        "zero3_bf16_actckpt (pp = 1) or zero1_pp_bf16 (pp > 1) on GPUs",
    )
    deepspeed: dict[str, Any] = Field(
        default_factory=dict, description="DeepSpeed keys that override everything else (nested dicts merge)"
    )


def check_zero_stage(cfg: RunConfig, stage: int, source: str) -> None:
    """The ZeRO ``stage`` ``cfg`` trains with (``source`` says where it is set) must fit its layout: DeepSpeed's
    pipeline engine takes ZeRO-0/1 only, and host-memory Engram tables need ZeRO's optimizer."""
    if cfg.model.engram is not None and cfg.model.engram.offload and stage == 0:
        raise ConfigError(
            f"model.engram.offload with {source}: the host tables' gradient norm joins the clipping norm of "
            "DeepSpeed's ZeRO optimizer; use parallel.zero_stage 1, 2 or 3")
    if cfg.parallel.pp > 1 and stage >= 2:
        raise ConfigError(
            f"{source} with parallel.pp={cfg.parallel.pp}: DeepSpeed's pipeline engine refuses ZeRO-2/3; "
            "use parallel.zero_stage=1 (or leave it unset with deepspeed_config auto or zero1_pp_bf16)"
        )
