"""ZeRO-3 partitioning of a model built module by module (``Materialiser``)."""

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
    """The values of ``p`` this rank holds: its ZeRO-3 partition (``ds_tensor``) less its padding
    (``unpadded``); the parameter itself when it is not partitioned."""
    part = getattr(p, "ds_tensor", None)
    return p if part is None else unpadded(p, part)


def unpadded(p: nn.Parameter, partition: torch.Tensor) -> torch.Tensor:
    """``partition`` (this rank's ZeRO-3 partition of ``p``, or a tensor laid out as it, such as its fp32 master
    copy) less the padding at the end of the last partitions, which DeepSpeed allocates uninitialised."""
    start = partition.numel() * dist.get_rank(group=p.ds_process_group)
    return partition.narrow(0, 0, min(partition.numel(), max(0, p.ds_numel - start)))


class Zero3Partitioner:
    """``partition(leaf)`` converts the parameters of an allocated module to ZeRO-3's partitioned ones, keeping this
    rank's 1/dp: the first module through ``deepspeed.zero.Init(module=...)`` (the documented way to partition an
    allocated module), each later one through the first partitioned parameter's ``convert_to_zero_parameters``, the
    same partitioning without another ``Init``.

    Partitioning broadcasts each parameter from the group's first rank, then copies this rank's range of it into the
    partition (``ds_tensor``: ``ceil(numel / dp)`` elements, the last partitions padded at the end): the values a leaf
    holds when it is partitioned are the first rank's, and a rank's own values reach its partition only when written
    there afterwards (``held``). That partition is the only copy the rank keeps unless the config keeps a second
    one (hpZeRO's ``zero_hpz_partition_size``), moves it to NVMe (``offload_param``) or quantizes the frozen
    parameters (``zero_quantized_nontrainable_weights``): then the leaf must hold its values in full
    (``writes_held`` is False)."""

    def __init__(self, config: dict, groups, dtype: torch.dtype):
        self.config, self.groups, self.dtype = config, groups, dtype
        self.first: nn.Parameter | None = (
            None  # the first partitioned parameter: it converts the later ones
        )
        zero = config.get("zero_optimization") or {}
        self.writes_held = (
            zero.get("zero_hpz_partition_size", 1) <= 1
            and (zero.get("offload_param") or {}).get("device") != "nvme"
            and not zero.get("zero_quantized_nontrainable_weights", False)
        )

    def __call__(self, leaf: nn.Module) -> None:
        params = list(leaf.parameters(recurse=False))
        if self.first is None:
            import deepspeed

            deepspeed.zero.Init(
                module=leaf,
                data_parallel_group=self.groups.dp_group,
                config_dict_or_path=self.config,
                mpu=self.groups,
                dtype=self.dtype,
            )
            self.first = params[0]
        else:
            self.first.convert_to_zero_parameters(param_list=params)

    def held(self, param: nn.Parameter) -> tuple[int, torch.Tensor]:
        """Where this rank's partition of ``param`` begins in the flattened parameter, and its values (in place)."""
        return param.ds_tensor.numel() * dist.get_rank(group=param.ds_process_group), held_values(
            param
        )
