"""Which GPU a rank drives.

A launcher, or the scheduler that started the rank's task, tells each rank its index
among the ranks of its node (``LOCAL_RANK``). Where every task sees all of the node's GPUs, that index is
its GPU; where a site binds each task to its own GPU (``--gpus-per-task=1``,
``--gpu-bind``, a container given one device) every task sees one GPU, at index
0, and the local rank is no GPU index at all. ``device_index`` covers both,
and also several ranks sharing fewer GPUs (checks that run two ranks on one GPU).
"""

from __future__ import annotations

import os

import torch

from mhf_dist.errors import MhfError


def device_index(local_rank: int, visible: int) -> int:
    """The visible GPU that the rank with node-local index ``local_rank`` drives, among ``visible`` GPUs: its own
    when the task sees the whole node, the only one when the task is bound to one, round-robin in between."""
    if visible < 1:
        raise MhfError(
            "no GPU is visible to this rank (CUDA_VISIBLE_DEVICES / ROCR_VISIBLE_DEVICES, or the "
            "job's GPU binding); ask for GPUs in the job, or train on CPUs with train.device=cpu"
        )
    return local_rank % visible


def bind_gpu(local_rank: int) -> torch.device:
    """Make this rank's GPU the current device, and ``LOCAL_RANK`` its index: DeepSpeed places parameters on
    ``cuda:$LOCAL_RANK`` (ZeRO-3's partitioning, the pipeline module), which must be the device this rank drives."""
    index = device_index(local_rank, torch.cuda.device_count())
    torch.cuda.set_device(index)
    os.environ["LOCAL_RANK"] = str(index)
    return torch.device("cuda", index)


def device_type(cfg) -> str:
    """The device type ``train.device`` names (a GPU when one is visible, under ``auto``)."""
    if cfg.train.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.train.device
