"""Inference over the real vocabulary: ``log P_inf`` (SPEC §5).

``score(w) = Σ_i log p_i[H_i(w)]`` and
``log P_inf(w) = score(w) - logsumexp_{w' ∈ V} score(w')``, over registered
tokens only (``registered`` is False for the pad token, whose row gets ``-inf``).

The heads' log-probabilities are laid side by side (column ``i·R + b`` is head
``i``'s bucket ``b``; a last zero column stands for coordinates another rank
holds), and :func:`signature_columns` maps every signature coordinate to its
column once per model, so scoring a chunk of the vocabulary is one gather and
one sum over heads, a few kernels whatever H is. The vocabulary is processed in
chunks, so the extra memory is ``O(N × chunk)`` whatever ``V`` is (a 1M-token
vocabulary included). Each rank of a bucket-sharded model gathers only the
coordinates it owns; the sum over heads is reduced once per chunk.
"""

from __future__ import annotations

import torch

from mhf_dist.model.tables import BucketTables


def signature_columns(codes: torch.Tensor, tables: BucketTables) -> torch.Tensor:
    """``codes [V, H]`` -> ``[V, H]``: each coordinate's column in :func:`side_by_side`'s layout on this rank."""
    local, owned = tables.local_index(codes)
    head_offset = torch.arange(codes.shape[1], device=codes.device) * tables.local_rows
    return torch.where(owned, local + head_offset, codes.shape[1] * tables.local_rows)


def side_by_side(head_log_probs: list[torch.Tensor]) -> torch.Tensor:
    """H tensors ``[N, R_local]`` -> ``[N, H·R_local + 1]``, the last column zero."""
    return torch.cat([*head_log_probs, head_log_probs[0].new_zeros(head_log_probs[0].shape[0], 1)], dim=-1)


def signature_scores(side: torch.Tensor, columns: torch.Tensor, registered: torch.Tensor, tables: BucketTables,
                     chunk_size: int = 65536) -> torch.Tensor:
    """``score [N, V]`` from :func:`side_by_side` log-probs, ``columns [V, H]`` (:func:`signature_columns`) and
    ``registered [V]``; a chunk gathers ``chunk_size`` values per token."""
    (n, _), (v, num_heads) = side.shape, columns.shape
    out = side.new_empty(n, v)
    step = max(1, chunk_size // num_heads)
    for start in range(0, v, step):
        cols = columns[start : start + step]
        scores = tables.reduce_sum(side[:, cols.flatten()].view(n, -1, num_heads).sum(-1))
        out[:, start : start + step] = scores.masked_fill(~registered[start : start + step], float("-inf"))
    return out


def log_p_inf(head_log_probs: list[torch.Tensor], columns: torch.Tensor, registered: torch.Tensor,
              tables: BucketTables, chunk_size: int = 65536) -> torch.Tensor:
    """``log P_inf [N, V]``: signature scores renormalised over the registered vocabulary."""
    scores = signature_scores(side_by_side(head_log_probs), columns, registered, tables, chunk_size)
    return scores - torch.logsumexp(scores, dim=-1, keepdim=True)


def target_log_p_inf(head_log_probs: list[torch.Tensor], columns: torch.Tensor, registered: torch.Tensor,
                     tables: BucketTables, targets: torch.Tensor, chunk_size: int = 65536) -> torch.Tensor:
    """``log P_inf(target) [N]`` without materialising ``[N, V]``: a running logsumexp over vocabulary chunks."""
    side = side_by_side(head_log_probs)
    log_z = side.new_full((targets.shape[0],), float("-inf"))
    for start in range(0, columns.shape[0], chunk_size):
        end = start + chunk_size
        scores = signature_scores(side, columns[start:end], registered[start:end], tables, chunk_size)
        log_z = torch.logaddexp(log_z, torch.logsumexp(scores, dim=-1))
    target_score = tables.reduce_sum(side.gather(1, columns[targets]).sum(-1))
    return target_score - log_z
