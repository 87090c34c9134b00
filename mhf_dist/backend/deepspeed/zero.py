"""ZeRO-3 partitioning of a model built module by module (:class:`~mhf_dist.parallel.construct.Materialiser`)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def training_dtype(ds_config: dict) -> torch.dtype:
    """The dtype a DeepSpeed config trains in."""
    if ds_config.get("bf16", {}).get("enabled"):
        return torch.bfloat16
    if ds_config.get("fp16", {}).get("enabled"):
        return torch.float16
    return torch.float32


def full_ndim(p: nn.Parameter) -> int:
    """Dimensions of a parameter, also when ZeRO-3 has partitioned it (its data is then a flat slice)."""
    return len(getattr(p, "ds_shape", p.shape))


def held_values(p: nn.Parameter) -> torch.Tensor:
    """The values of ``p`` this rank holds: its ZeRO-3 partition (``ds_tensor``) less the padding at the end of the
    last partitions, which DeepSpeed allocates uninitialised; the parameter itself when it is not partitioned."""
    part = getattr(p, "ds_tensor", None)
    if part is None:
        return p
    start = part.numel() * dist.get_rank(group=p.ds_process_group)
    return part.narrow(0, 0, min(part.numel(), max(0, p.ds_numel - start)))


class Zero3Partitioner:
    """``partition(leaf)`` converts the parameters of an allocated module to ZeRO-3's partitioned ones, keeping this
    rank's 1/dp: the first module through ``deepspeed.zero.Init(module=...)`` (the documented way to partition an
    allocated module), each later one through the first partitioned parameter's ``convert_to_zero_parameters``, the
    same partitioning without another ``Init``."""

    def __init__(self, config: dict, groups, dtype: torch.dtype):
        self.config, self.groups, self.dtype = config, groups, dtype
        self.first: nn.Parameter | None = None  # the first partitioned parameter: it converts the later ones

    def __call__(self, leaf: nn.Module) -> None:
        params = list(leaf.parameters(recurse=False))
        if self.first is None:
            import deepspeed

            deepspeed.zero.Init(module=leaf, data_parallel_group=self.groups.dp_group, config_dict_or_path=self.config,
                                mpu=self.groups, dtype=self.dtype)
            self.first = params[0]
        else:
            self.first.convert_to_zero_parameters(param_list=params)
