"""The process group and the parallel topology, as DeepSpeed's engines expect them."""

from __future__ import annotations

import logging
from datetime import timedelta


def init_distributed(backend: str, timeout: timedelta) -> None:
    """Join the job's process group over ``backend`` through DeepSpeed, which sets up its own communication layer on
    it for the engines."""
    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)  # DeepSpeed's per-step info lines
    deepspeed.init_distributed(dist_backend=backend, timeout=timeout)


def pipe_model_data_topology(pp: int, tp: int, dp: int):
    """DeepSpeed's grid of ranks, axes pipe, data and model (tensor parallel, innermost), which its pipeline engine
    cuts the stages over: the grid of :mod:`mhf_dist.parallel.groups`."""
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    return PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
