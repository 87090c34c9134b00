"""The process group and the parallel topology, as DeepSpeed's engines expect them."""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import TYPE_CHECKING

from mhf_dist.errors import MhfError

if TYPE_CHECKING:
    import torch


def init_distributed(backend: str, timeout: timedelta, device: torch.device) -> None:
    """Join the job's process group over ``backend`` for a rank computing on ``device``, then set up DeepSpeed's
    communication layer on it (DeepSpeed adopts a group that exists).

    The group is created here, not by DeepSpeed: on a CUDA host DeepSpeed binds the group it creates to the rank's
    GPU (``device_id``) whatever the backend, and a gloo group bound to a device makes torch split it for every new
    subgroup, which only NCCL can do. So only an NCCL group of several ranks is bound to its device (its
    communicators are then made at once, and subgroups split from them)."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    deepspeed.utils.logger.setLevel(logging.WARNING)  # DeepSpeed's per-step info lines
    if (chosen := get_accelerator().device_name()) != device.type:
        raise MhfError(
            f"DeepSpeed computes on {chosen} but this rank trains on {device.type} (train.device): "
            f"DeepSpeed was loaded before the device was chosen; start the run with "
            f"DS_ACCELERATOR={device.type}, or let mhf-dist train start its ranks"
        )
    if not dist.is_initialized():
        bind = "nccl" in backend and int(os.environ.get("WORLD_SIZE", 1)) > 1
        dist.init_process_group(backend, timeout=timeout, device_id=device if bind else None)
    deepspeed.init_distributed(dist_backend=backend, timeout=timeout)


def pipe_model_data_topology(pp: int, tp: int, dp: int):
    """DeepSpeed's grid of ranks, axes pipe, data and model (tensor parallel, innermost), which its pipeline engine
    cuts the stages over: the grid of ``mhf_dist.parallel.groups``."""
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    return PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
