"""``CascadedDecoder``: predict the H signature coordinates in turn (docs/spec.md §4, §5).

``c_1 = h``; for each head ``o_i = E_i c_i`` (the input tables, tied), ``p_i = softmax(o_i)``, ``ē_i = E_iᵀ p_i``,
and for ``i < H`` ``c_{i+1} = c_i + W_up,iᵀ σ(W_dn,iᵀ [c_i ; ē_i] + b_dn) + b_up``: the next head sees the previous
head's soft distribution, never a sampled bucket. With ``H = 1`` and no mixers this is exactly a tied LM head, which
is how the Standard baseline uses it; ``num_valid_rows`` then masks its padding rows. All table arithmetic goes
through ``BucketTables``, so the same code runs on bucket-sharded tables; ``chunk_tokens > 0`` runs each head fused
over token chunks (``fused_head``). ``head_entropies``: each head's entropy, for the health metrics. ``HeadTerms``:
what the training loss takes of the heads, each head's normaliser ``log Z_i`` (the z-loss's) included when asked.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import nn

from mhf_dist.model.fused_head import KernelPolicy
from mhf_dist.model.tables import BucketTables


class HeadTerms(NamedTuple):
    """Per token and head ``[N, H]``: ``-log p_i[target_i]``; each head's entropy over the rows held here (detached,
    ``entropy=True`` only); its normaliser ``log Z_i = logsumexp_b o_i,b`` over all rows, fp32 (or wider) and
    differentiable (``log_z=True`` only)."""

    nll: torch.Tensor
    entropy: torch.Tensor | None = None
    log_z: torch.Tensor | None = None


class CascadedDecoder(nn.Module):
    """``chunk_tokens > 0``: the training loss runs each head fused over token chunks (``FusedHead``,
    activation memory ``O(chunk × B)``, its elementwise passes run as ``kernels`` says: ``KernelPolicy``); 0
    keeps the plain path, which materialises every head's logits."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mixer_dim: int,
        num_valid_rows: int | None = None,
        chunk_tokens: int = 0,
        kernels: str = "auto",
    ):
        super().__init__()
        self.num_heads, self.num_valid_rows, self.chunk_tokens = (
            num_heads,
            num_valid_rows,
            chunk_tokens,
        )
        self.kernels = KernelPolicy(kernels)
        # Names match the authors' `hash_head.cascade_mixer.{k}.{0,2}` (docs/spec.md §9).
        self.cascade_mixer = nn.ModuleList(
            nn.Sequential(nn.Linear(2 * dim, mixer_dim), nn.SiLU(), nn.Linear(mixer_dim, dim))
            for _ in range(num_heads - 1)
        )

    def _heads(
        self,
        h: torch.Tensor,
        tables: BucketTables,
        normalised: bool,
        normalisers: list[torch.Tensor] | None = None,
    ) -> Iterator[torch.Tensor]:
        """Yield each head's ``log p_i [..., R_local]`` down the cascade, or (``normalised=False``) its logits
        ``o_i = log p_i + log Z_i``, which need no normaliser of their own; ``normalisers`` (normalised only): a
        list each head's ``log Z_i [...]`` is appended to."""
        c = h
        for i in range(self.num_heads):
            logits = tables.logits(c, i)
            if self.num_valid_rows is not None:
                rows = torch.arange(tables.local_rows, device=logits.device) + tables.row_offset
                logits = logits.masked_fill(rows >= self.num_valid_rows, float("-inf"))
            if normalisers is not None:
                scores, log_z = tables.log_softmax_and_normaliser(logits)
                normalisers.append(log_z)
            else:
                scores = tables.log_softmax(logits) if normalised else logits
            yield scores
            if i < self.num_heads - 1:
                soft = tables.retrieve(scores.exp() if normalised else tables.softmax(logits), i)
                c = c + self.cascade_mixer[i](torch.cat([c, soft], dim=-1))

    def nll(self, h: torch.Tensor, tables: BucketTables, targets: torch.Tensor) -> torch.Tensor:
        """``-log p_i[target_i]`` per head: ``h [N, d]``, ``targets [N, H]`` -> ``[N, H]``."""
        return self.head_terms(h, tables, targets).nll

    def head_terms(
        self,
        h: torch.Tensor,
        tables: BucketTables,
        targets: torch.Tensor,
        *,
        entropy: bool = False,
        log_z: bool = False,
    ) -> HeadTerms:
        """``nll``, with (``entropy``) each head's entropy ``-Σ_b p_i,b log p_i,b`` over the rows held here
        (detached; summed over the bucket shards it is the head's entropy), for the health metrics, and (``log_z``)
        each head's normaliser ``log Z_i``, where each path has it: the fused head's output, the plain path's
        ``log_softmax``; on bucket shards already reduced over them, so it costs no collective."""
        if self.chunk_tokens:
            return self._fused_terms(h, tables, targets, entropy, log_z)
        nll, log_probs, normalisers = self.nll_and_log_probs(h, tables, targets, log_z)
        return HeadTerms(nll, head_entropies(log_probs) if entropy else None, normalisers)

    def nll_and_log_probs(
        self, h: torch.Tensor, tables: BucketTables, targets: torch.Tensor, log_z: bool = False
    ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor | None]:
        """The plain path's ``-log p_i[target_i]`` ``[N, H]``, every head's ``log p_i [N, R_local]`` and (``log_z``)
        their normalisers ``log Z_i`` ``[N, H]``, else None, from one pass down the cascade; the
        log-probabilities are also ``scores`` for ``log P_inf`` (each head's normaliser cancels there), which is
        how the training loss's ``log P_inf`` term gets them."""
        normalisers = [] if log_z else None
        log_probs = list(self._heads(h, tables, normalised=True, normalisers=normalisers))
        nll = torch.stack(
            [-tables.pick(log_p, targets[..., i]) for i, log_p in enumerate(log_probs)], dim=-1
        )
        return nll, log_probs, torch.stack(normalisers, dim=-1) if log_z else None

    def _fused_terms(
        self,
        h: torch.Tensor,
        tables: BucketTables,
        targets: torch.Tensor,
        entropy: bool,
        log_z: bool,
    ) -> HeadTerms:
        c, nll, entropies, normalisers, split = h, [], [], [], tables.per_table()
        for i in range(self.num_heads):
            more = i < self.num_heads - 1
            normaliser, target, soft, ent = tables.fused_head(
                c,
                split,
                i,
                targets=targets[:, i],
                retrieve=more,
                chunk=self.chunk_tokens,
                kernels=self.kernels,
                num_valid_rows=self.num_valid_rows,
                entropy=entropy,
            )
            nll.append(normaliser - target)
            entropies.append(ent)
            normalisers.append(normaliser)
            if more:
                c = c + self.cascade_mixer[i](torch.cat([c, soft], dim=-1))
        return HeadTerms(
            torch.stack(nll, dim=-1),
            torch.stack(entropies, dim=-1) if entropy else None,
            torch.stack(normalisers, dim=-1) if log_z else None,
        )

    def scores(self, h: torch.Tensor, tables: BucketTables) -> list[torch.Tensor]:
        """Each head's bucket scores for ``scoring`` over the rows held here: H tensors
        ``[..., R_local]``, its logits ``o_i``. ``log P_inf`` renormalises ``Σ_i log p_i[H_i(w)]`` over the
        vocabulary, where each head's ``log Z_i`` is one more constant and cancels (docs/spec.md §5); so inference
        takes one softmax per retrieving head and no normaliser at all for the last."""
        return list(self._heads(h, tables, normalised=False))


def head_entropies(log_probs: list[torch.Tensor]) -> torch.Tensor:
    """``[N, H]``: each head's ``-Σ_b p_b log p_b`` over the rows of its ``log p [N, R_local]`` (detached; a masked
    row's ``log p = -inf`` counts as 0)."""

    def entropy(log_p: torch.Tensor) -> torch.Tensor:
        log_p = log_p.detach()
        return -torch.einsum("nb,nb->n", log_p.exp(), log_p.clamp_min(torch.finfo(log_p.dtype).min))

    return torch.stack([entropy(log_p) for log_p in log_probs], dim=-1)
