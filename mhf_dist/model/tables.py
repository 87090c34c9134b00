"""Bucket tables: the rows tied between input lookup and output logits (SPEC §2, §4).

``weight [T, R, d]`` holds ``T`` tables of ``R`` rows: the MultiHashFormer's
``H`` bucket tables ``E_i`` (R = B), or the Standard model's single token table
(T = 1, R = padded vocabulary). Every operation the models need on them —
lookup, logits, the softmax normaliser, picking a row's value, soft retrieval —
is a method here, written for rows ``[row_offset, row_offset + R)``. This class
holds all rows (``row_offset = 0``, the reductions are identities); the
tensor-parallel ``BucketParallelEmbedding`` holds a slice and overrides the
reductions with collectives, so the model code is the same for both.

Every use of ``weight`` enters through ``forward`` (``lookup``, ``logits``,
``retrieve`` and ``per_table`` call it), as a tied embedding's uses do in any module: ZeRO-3
gathers a module's parameters around its ``forward`` and again for its
backward, which a method reading ``self.weight`` directly would bypass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mhf_dist.model.fused_head import FusedHead


class BucketTables(nn.Module):
    def __init__(self, num_tables: int, num_rows: int, dim: int):
        super().__init__()
        self.num_rows = num_rows  # global rows per table
        self.weight = nn.Parameter(torch.empty(num_tables, num_rows, dim))

    # Row range held by this module and the reductions over the other ranges.
    @property
    def row_offset(self) -> int:
        return 0

    def reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def replicated_input(self, x: torch.Tensor) -> torch.Tensor:
        """Marks a replicated input of the per-shard logits (its gradient is summed over shards)."""
        return x

    # ------------------------------------------------------------------
    @property
    def local_rows(self) -> int:
        return self.weight.shape[1]

    def local_index(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Global row ids -> (local ids clamped into range, mask of rows held here)."""
        local = rows - self.row_offset
        owned = (local >= 0) & (local < self.local_rows)
        return local.clamp(0, self.local_rows - 1), owned

    def forward(self, op: str, *args: torch.Tensor | int) -> torch.Tensor:
        return getattr(self, f"_{op}")(*args)

    def lookup(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows [..., T]`` (row of each table) -> ``[..., T, d]``: ``u_i = E_i[rows_i]``."""
        return self("lookup", rows)

    def logits(self, x: torch.Tensor, table: int) -> torch.Tensor:
        """``x [..., d]`` -> ``[..., R_local]``: ``o = E_table x`` over the rows held here."""
        return self("logits", x, table)

    def retrieve(self, probs: torch.Tensor, table: int) -> torch.Tensor:
        """Soft retrieval ``ē = E_tableᵀ p``: ``probs [..., R_local]`` -> ``[..., d]``."""
        return self("retrieve", probs, table)

    def per_table(self) -> tuple[torch.Tensor, ...]:
        """The ``T`` tables ``E_i [R_local, d]`` as views, split by one autograd node: their gradients fill one
        ``[T, R, d]`` buffer, where indexing each table separately would zero-fill one per table."""
        return self("per_table")

    def fused_head(self, c: torch.Tensor, table: torch.Tensor, targets: torch.Tensor, retrieve: bool, chunk: int,
                   num_valid_rows: int | None = None):
        """``(log Z, target logit, ē or None)`` of one head for ``c [N, d]``, ``targets [N]`` (global rows) and
        ``table``, one of :meth:`per_table`, chunked over tokens (:class:`FusedHead`); rows ``>= num_valid_rows``
        are never predicted."""
        rows, owned = self.local_index(targets)
        valid = None
        if num_valid_rows is not None:
            valid = torch.arange(self.local_rows, device=c.device) + self.row_offset < num_valid_rows
        return FusedHead.apply(self.replicated_input(c), table, rows, owned, valid, retrieve, chunk, self)

    def _lookup(self, rows: torch.Tensor) -> torch.Tensor:
        t, r, d = self.weight.shape
        local, owned = self.local_index(rows)
        flat = local + torch.arange(t, device=rows.device) * r
        out = F.embedding(flat, self.weight.reshape(t * r, d))
        return self.reduce_sum(torch.where(owned.unsqueeze(-1), out, 0.0))

    def _logits(self, x: torch.Tensor, table: int) -> torch.Tensor:
        return self.replicated_input(x) @ self.weight[table].t()

    def _per_table(self) -> tuple[torch.Tensor, ...]:
        return self.weight.unbind(0)

    def log_normalizer(self, logits: torch.Tensor) -> torch.Tensor:
        """``logsumexp`` over all rows (max and sum reduced across shards)."""
        peak = self.reduce_max(logits.detach().amax(dim=-1, keepdim=True))
        return peak.squeeze(-1) + self.reduce_sum((logits - peak).exp().sum(dim=-1)).log()

    def pick(self, values: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``values [..., R_local]``, ``rows [...]`` (global) -> ``values[..., rows]``."""
        local, owned = self.local_index(rows)
        picked = values.gather(-1, local.unsqueeze(-1)).squeeze(-1)
        return self.reduce_sum(torch.where(owned, picked, 0.0))

    def _retrieve(self, probs: torch.Tensor, table: int) -> torch.Tensor:
        return self.reduce_sum(probs @ self.weight[table])
