"""``BucketTables``: the rows tied between input lookup and output logits (docs/spec.md §2, §4).

``weight [T, R, d]`` holds ``T`` tables of ``R`` rows: the MultiHashFormer's ``H`` bucket tables ``E_i`` (R = B), or
the Standard model's single token table (T = 1, R = padded vocabulary). Every operation the models need on them
(lookup, logits, the softmax normaliser, picking a row's value, soft retrieval) is a method here, written for rows
``[row_offset, row_offset + R)``: this class holds all rows (the reductions are identities), the tensor-parallel
``BucketParallelEmbedding`` a slice, with collectives for the reductions. Every use of ``weight`` enters through
``forward``, which hands it to the operation asked for, so that ZeRO-3 gathers it (docs/design-model.md,
"Vocabulary"). ``TableGradients``: the one gradient buffer the tables' per-head views share.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from mhf_dist.model.fused_head import FusedHead, KernelPolicy


class TableGradients:
    """One ``[T, R, d]`` buffer whose slices the heads' backward write their tables' gradients into (allocated
    by the first head to need it), so ``_TableViews`` hands it on whole instead of stacking T copies."""

    def __init__(self):
        self.num_tables = 0
        self.buffer: torch.Tensor | None = None

    def slot(self, table: int, like: torch.Tensor) -> torch.Tensor:
        """The gradient of table ``table`` (shaped ``like``), a slice of the shared buffer."""
        if self.buffer is None:
            self.buffer = like.new_empty(self.num_tables, *like.shape)
        return self.buffer[table]


class _TableViews(torch.autograd.Function):
    """``weight [T, R, d]`` -> its ``T`` tables as views. Backward takes the shared buffer when every table's
    gradient is its own slice of it (the fused heads' case), and stacks the gradients otherwise."""

    @staticmethod
    def forward(ctx, weight, gradients):
        gradients.num_tables = weight.shape[0]
        ctx.gradients = gradients
        return weight.unbind(0)

    @staticmethod
    def backward(ctx, *grads):
        # released here, so autograd may add the lookup's gradient into it in place
        buffer, ctx.gradients.buffer = ctx.gradients.buffer, None
        # (autograd hands unused views' gradients in as zeros, so every table has one)
        if buffer is not None and all(
            g.data_ptr() == buffer[i].data_ptr() and g.stride() == buffer[i].stride()
            for i, g in enumerate(grads)
        ):
            return buffer, None
        return torch.stack(grads), None


class SplitTables(NamedTuple):
    """``BucketTables.per_table``: the tables ``E_i [R_local, d]`` and the buffer their gradients share."""

    tables: tuple[torch.Tensor, ...]
    gradients: TableGradients


class BucketTables(nn.Module):
    def __init__(self, num_tables: int, num_rows: int, dim: int):
        super().__init__()
        self.num_rows = num_rows  # global rows per table
        # rows held here (a tensor-parallel shard's fewer): not read off the weight, which ZeRO-3 partitions
        # between the calls of forward
        self.local_rows = num_rows
        self.weight = nn.Parameter(torch.empty(num_tables, num_rows, dim))

    # Row range held by this module and the reductions over the other ranges.
    @property
    def row_offset(self) -> int:
        return 0

    def reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def recompute_sum(self, x: torch.Tensor) -> torch.Tensor:
        """``reduce_sum`` without autograd, for a custom ``backward`` that recomputes a reduced value."""
        return x

    def replicated_input(self, x: torch.Tensor) -> torch.Tensor:
        """Marks a replicated input of the per-shard logits (its gradient is summed over shards)."""
        return x

    # ------------------------------------------------------------------
    def local_index(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Global row ids -> (local ids clamped into range, mask of rows held here)."""
        local = rows - self.row_offset
        owned = (local >= 0) & (local < self.local_rows)
        return local.clamp(0, self.local_rows - 1), owned

    def forward(self, op: Callable[..., torch.Tensor], *args) -> torch.Tensor:
        """``op(weight, *args)``: the one read of ``weight`` (module docstring)."""
        return op(self.weight, *args)

    def lookup(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows [..., T]`` (row of each table) -> ``[..., T, d]``: ``u_i = E_i[rows_i]``."""
        return self(self._lookup, rows)

    def logits(self, x: torch.Tensor, table: int) -> torch.Tensor:
        """``x [..., d]`` -> ``[..., R_local]``: ``o = E_table x`` over the rows held here."""
        return self(self._logits, x, table)

    def retrieve(self, probs: torch.Tensor, table: int) -> torch.Tensor:
        """Soft retrieval ``ē = E_tableᵀ p``: ``probs [..., R_local]`` -> ``[..., d]``."""
        return self(self._retrieve, probs, table)

    def per_table(self) -> SplitTables:
        """The ``T`` tables ``E_i [R_local, d]`` as views, split by one autograd node, so their gradients make one
        ``[T, R, d]`` tensor (indexing each table separately would zero-fill one per table); heads that write
        them into the shared ``TableGradients`` leave the split no copy to make."""
        gradients = TableGradients()
        return SplitTables(self(self._per_table, gradients), gradients)

    def fused_head(
        self,
        c: torch.Tensor,
        split: SplitTables,
        table: int,
        *,
        targets: torch.Tensor,
        retrieve: bool,
        chunk: int,
        kernels: KernelPolicy,
        num_valid_rows: int | None = None,
        entropy: bool = False,
    ):
        """``(log Z, target logit, ē or None, entropy or None)`` of one head for ``c [N, d]``, ``targets [N]``
        (global rows) and table ``table`` of ``split`` (``per_table``), chunked over tokens
        (``FusedHead``, its elementwise passes run by ``kernels``); rows ``>= num_valid_rows`` are never
        predicted. ``entropy``: also the head's entropy over the rows held here ``[N]`` (detached)."""
        rows, owned = self.local_index(targets)
        valid = None
        # a mask only where some row held here is padding: an all-true mask would cost a masked copy of every
        # chunk's logits in each elementwise pass
        if num_valid_rows is not None and self.row_offset + self.local_rows > num_valid_rows:
            valid = (
                torch.arange(self.local_rows, device=c.device) + self.row_offset < num_valid_rows
            )
        return FusedHead.apply(
            self.replicated_input(c),
            split.tables[table],
            rows,
            owned,
            valid,
            retrieve,
            chunk,
            self,
            split.gradients,
            table,
            kernels,
            entropy,
        )

    def _lookup(self, weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        t, r, d = weight.shape
        local, owned = self.local_index(rows)
        flat = local + torch.arange(t, device=rows.device) * r
        out = F.embedding(flat, weight.reshape(t * r, d))
        return self.reduce_sum(torch.where(owned.unsqueeze(-1), out, 0.0))

    def _logits(self, weight: torch.Tensor, x: torch.Tensor, table: int) -> torch.Tensor:
        return self.replicated_input(x) @ weight[table].t()

    @staticmethod
    def _per_table(weight: torch.Tensor, gradients: TableGradients) -> tuple[torch.Tensor, ...]:
        return _TableViews.apply(weight, gradients)

    def log_softmax(self, logits: torch.Tensor) -> torch.Tensor:
        """``log p = logits - logsumexp(logits)`` over all rows (one kernel here; the sharded tables reduce the
        normaliser across shards), computed in fp32 (or wider) and rounded once: PyTorch's bf16 kernel rounds the
        normaliser to bf16 on its own, off by up to half its spacing in every log-probability."""
        return logits.log_softmax(
            dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32)
        ).to(logits.dtype)

    def log_softmax_and_normaliser(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(log p, log Z)``: ``log_softmax`` and the normaliser ``log Z = logsumexp(logits) [...]`` over all rows,
        kept in fp32 (or wider), both differentiable (the z-loss takes ``log Z``; the sharded tables reduce it
        across shards, and its gradient reaches each shard's logits without a collective)."""
        wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
        log_z = wide.logsumexp(dim=-1)
        return (wide - log_z[..., None]).to(logits.dtype), log_z

    def softmax(self, logits: torch.Tensor) -> torch.Tensor:
        """``p = softmax(logits)`` over all rows (the sharded tables normalise across shards)."""
        return logits.softmax(dim=-1)

    def pick(self, values: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``values [..., R_local]``, ``rows [...]`` (global) -> ``values[..., rows]``."""
        local, owned = self.local_index(rows)
        picked = values.gather(-1, local.unsqueeze(-1)).squeeze(-1)
        return self.reduce_sum(torch.where(owned, picked, 0.0))

    def _retrieve(self, weight: torch.Tensor, probs: torch.Tensor, table: int) -> torch.Tensor:
        return self.reduce_sum(probs @ weight[table])
