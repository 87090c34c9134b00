"""Tensor-parallel layers, Megatron style.

``BucketParallelEmbedding``: each bucket table split along its rows; the lookup is a masked local lookup plus an
all-reduce, and the decoder's logits stay sharded while the softmax statistics (fp32 whatever the training dtype),
picked log-probabilities and soft retrieval are reduced over the group (vocab-parallel cross entropy).
``ColumnParallelLinear`` / ``RowParallelLinear``: output / input features split; a region (attention, MLP) copies
its input into the group once (``mark_region``). ``RegionRMSNorm`` and ``ReplicatedHeadsLinear``: replicated
parameters used inside a region on this rank's heads only. Sharded parameters carry ``tensor_model_parallel = True``
(DeepSpeed's gradient-norm reduction reads it). Why: docs/design-model.md, "Tensor and pipeline parallelism".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mhf_dist.model.tables import BucketTables
from mhf_dist.parallel.comm import all_reduce_max, all_reduce_sum, copy_to_tp, reduce_from_tp


class BucketParallelEmbedding(BucketTables):
    """Rows ``[rank·R/tp, (rank+1)·R/tp)`` of every table.

    Args:
        num_tables: the tables ``H`` (1 for Standard's embedding).
        num_rows: every table's rows ``R`` over all ranks; a multiple of ``size``.
        dim: the row width ``d``.
        group: the tensor-parallel process group.
        rank: this rank's index in ``group``.
        size: the group's size ``tp``.
    """

    def __init__(self, num_tables: int, num_rows: int, dim: int, group, rank: int, size: int):
        if num_rows % size:
            raise ValueError(
                f"{num_rows} table rows cannot be split over tp={size}; use a multiple of tp"
            )
        super().__init__(num_tables, num_rows // size, dim)
        self.num_rows, self.group, self.rank = num_rows, group, rank
        self.weight.tensor_model_parallel = True

    @property
    def row_offset(self) -> int:
        return self.rank * self.local_rows

    def reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from_tp(x, self.group)

    def reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce_max(x, self.group)

    def recompute_sum(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(x, self.group)

    def replicated_input(self, x: torch.Tensor) -> torch.Tensor:
        # x is replicated; each rank's logits see it, so its gradient is summed over the group.
        return copy_to_tp(x, self.group)

    def _log_probs(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(log p, log Z [..., 1])`` in fp32 (or wider) whatever the logits' dtype: in bf16 the normaliser
        ``log Z`` alone would be off by up to half its spacing, 0.03–0.06 at ``|log Z|`` of 8–32, in every
        log-probability. ``log Z`` is the same on every shard, and a gradient it receives there directly (the
        z-loss's, the same on every shard) reaches this shard's logits without a collective."""
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        peak = self.reduce_max(logits.detach().amax(dim=-1, keepdim=True))
        log_z = peak + self.reduce_sum((logits - peak).exp().sum(dim=-1, keepdim=True)).log()
        # log Z is replicated and enters every shard's log p: its gradient is the sum over the shards
        return logits - copy_to_tp(log_z, self.group), log_z

    def log_softmax(self, logits: torch.Tensor) -> torch.Tensor:
        return self._log_probs(logits)[0].to(logits.dtype)

    def log_softmax_and_normaliser(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        log_p, log_z = self._log_probs(logits)
        return log_p.to(logits.dtype), log_z.squeeze(-1)

    def softmax(self, logits: torch.Tensor) -> torch.Tensor:
        return self._log_probs(logits)[0].exp().to(logits.dtype)


class ColumnParallelLinear(nn.Linear):
    """``out_features / tp`` outputs; the input is already copied into the region (``mark_region``).

    Args:
        in_features: the input width, whole on every rank.
        out_features: the output width over all ranks; a multiple of ``size``.
        size: the tensor-parallel group's size ``tp``.
    """

    def __init__(self, in_features: int, out_features: int, size: int):
        super().__init__(in_features, out_features // size, bias=False)
        self.weight.tensor_model_parallel = True


class RowParallelLinear(nn.Linear):
    """``in_features / tp`` inputs; partial outputs all-reduced.

    Args:
        in_features: the input width over all ranks; a multiple of ``size``.
        out_features: the output width, whole on every rank.
        group: the tensor-parallel process group the partial outputs are summed over.
        size: the group's size ``tp``.
    """

    def __init__(self, in_features: int, out_features: int, group, size: int):
        super().__init__(in_features // size, out_features, bias=False)
        self.group = group
        self.weight.tensor_model_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from_tp(super().forward(x), self.group)


class RegionRMSNorm(nn.RMSNorm):
    """A replicated RMSNorm applied inside a region (q/k norm over this rank's heads).

    Args:
        dim: the normalised width (one head's).
        eps: added to the mean square.
        group: the tensor-parallel process group the weight's gradient is summed over.
    """

    def __init__(self, dim: int, eps: float, group):
        super().__init__(dim, eps=eps)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, copy_to_tp(self.weight, self.group), self.eps)


class ReplicatedHeadsLinear(nn.Linear):
    """A replicated k/v projection when there are fewer kv heads than tp ranks: output cut to this rank's head.

    Args:
        in_features: the input width.
        out_features: the whole projection's width (every kv head).
        columns: the output columns of this rank's head.
        group: the tensor-parallel process group the weight's gradient is summed over.
    """

    def __init__(self, in_features: int, out_features: int, columns: slice, group):
        super().__init__(in_features, out_features, bias=False)
        self.columns, self.group = columns, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, copy_to_tp(self.weight, self.group))[..., self.columns]


def mark_region(module: nn.Module, group) -> None:
    """Copy the module's first input into the tensor-parallel group once, at its entry."""
    module.register_forward_pre_hook(lambda _m, args: (copy_to_tp(args[0], group), *args[1:]))
