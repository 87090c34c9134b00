"""Process groups for tensor, pipeline and data parallelism.

The ranks form a grid with axes pipe, data, model (model = tensor parallel,
innermost, so a tp group is consecutive ranks, one node's GPUs): the grid
DeepSpeed's pipeline engine cuts its stages over
(a contract test checks the two agree), so the engine and our
tensor-parallel layers agree on who is who. ``torch.distributed`` must already
be initialised.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from mhf_dist.parallel.layout import data_parallel_size

AXES = ("pipe", "data", "model")  # outermost first


def grid_coordinates(rank: int, pp: int, dp: int, tp: int) -> dict[str, int]:
    """``{"pipe": p, "data": d, "model": m}`` of ``rank`` in the ``pp × dp × tp`` grid."""
    return {"pipe": rank // (dp * tp), "data": rank // tp % dp, "model": rank % tp}


def grid_groups(axis: str, pp: int, dp: int, tp: int) -> list[list[int]]:
    """The ranks that differ only along ``axis``, one list per group, ordered by rank."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank in range(pp * dp * tp):
        coord = grid_coordinates(rank, pp, dp, tp)
        groups.setdefault(tuple(coord[a] for a in AXES if a != axis), []).append(rank)
    return list(groups.values())


@dataclass
class ParallelGroups:
    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_group: dist.ProcessGroup | None
    pp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None

    @classmethod
    def create(cls, tp: int = 1, pp: int = 1) -> "ParallelGroups":
        """Groups for ``world = tp · pp · dp`` (dp derived); every rank must call this, in the same order."""
        dp = data_parallel_size(dist.get_world_size(), tp, pp)
        rank = dist.get_rank()
        mine = {}
        for axis in ("model", "pipe", "data"):
            for ranks in grid_groups(axis, pp, dp, tp):
                group = dist.new_group(ranks)  # collective: all ranks create every group
                if rank in ranks:
                    mine[axis] = group
        coord = grid_coordinates(rank, pp, dp, tp)
        return cls(
            tp=tp,
            pp=pp,
            dp=dp,
            tp_rank=coord["model"],
            pp_rank=coord["pipe"],
            dp_rank=coord["data"],
            tp_group=mine["model"],
            pp_group=mine["pipe"],
            dp_group=mine["data"],
        )

    # The `mpu` interface DeepSpeed's engine and ZeRO read (Megatron's names).
    def get_model_parallel_rank(self) -> int:
        return self.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.tp

    def get_model_parallel_group(self):
        return self.tp_group

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.dp

    def get_data_parallel_group(self):
        return self.dp_group
