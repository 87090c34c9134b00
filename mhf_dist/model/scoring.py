"""Inference over the real vocabulary: ``log P_inf`` (SPEC §5).

``score(w) = Σ_i log p_i[H_i(w)]`` and
``log P_inf(w) = score(w) - logsumexp_{w' ∈ V} score(w')``, over registered
tokens only (``registered`` is False for the pad token, whose row gets ``-inf``).
The vocabulary is processed in chunks, so the extra memory is
``O(N × chunk)`` whatever ``V`` is (a 1M-token vocabulary included). Each rank
of a bucket-sharded model gathers only the coordinates it owns; the sum over
heads is reduced once per chunk.
"""

from __future__ import annotations

import torch

from mhf_dist.model.tables import BucketTables


def signature_scores(
    head_log_probs: list[torch.Tensor],
    codes: torch.Tensor,
    registered: torch.Tensor,
    tables: BucketTables,
    chunk_size: int = 65536,
) -> torch.Tensor:
    """``score [N, V]`` from H tensors ``[N, R_local]``, ``codes [V, H]`` and ``registered [V]``.

    The heads' log-probabilities are laid side by side (column ``i·R + b`` is head ``i``'s bucket ``b``, and
    a last zero column stands for coordinates another rank holds), so each vocabulary chunk takes one gather
    and one sum over heads, a few kernels whatever H is; a chunk gathers ``chunk_size`` values per token.
    """
    n, v, num_heads = head_log_probs[0].shape[0], codes.shape[0], len(head_log_probs)
    side_by_side = torch.cat([*head_log_probs, head_log_probs[0].new_zeros(n, 1)], dim=-1)
    zero_column = side_by_side.shape[1] - 1
    head_offset = torch.arange(num_heads, device=codes.device) * tables.local_rows
    out = head_log_probs[0].new_empty(n, v)
    step = max(1, chunk_size // num_heads)
    for start in range(0, v, step):
        local, owned = tables.local_index(codes[start : start + step])
        columns = torch.where(owned, local + head_offset, zero_column).flatten()
        scores = tables.reduce_sum(side_by_side[:, columns].view(n, -1, num_heads).sum(-1))
        out[:, start : start + step] = scores.masked_fill(~registered[start : start + step], float("-inf"))
    return out


def log_p_inf(
    head_log_probs: list[torch.Tensor],
    codes: torch.Tensor,
    registered: torch.Tensor,
    tables: BucketTables,
    chunk_size: int = 65536,
) -> torch.Tensor:
    """``log P_inf [N, V]``: signature scores renormalised over the registered vocabulary."""
    scores = signature_scores(head_log_probs, codes, registered, tables, chunk_size)
    return scores - torch.logsumexp(scores, dim=-1, keepdim=True)


def target_log_p_inf(
    head_log_probs: list[torch.Tensor],
    codes: torch.Tensor,
    registered: torch.Tensor,
    tables: BucketTables,
    targets: torch.Tensor,
    chunk_size: int = 65536,
) -> torch.Tensor:
    """``log P_inf(target) [N]`` without materialising ``[N, V]``: a running logsumexp over vocabulary chunks."""
    n, v = targets.shape[0], codes.shape[0]
    log_z = head_log_probs[0].new_full((n,), float("-inf"))
    for start in range(0, v, chunk_size):
        end = min(start + chunk_size, v)
        scores = signature_scores(head_log_probs, codes[start:end], registered[start:end], tables, chunk_size)
        log_z = torch.logaddexp(log_z, torch.logsumexp(scores, dim=-1))
    target_score = sum(tables.pick(logp, codes[targets, i]) for i, logp in enumerate(head_log_probs))
    return target_score - log_z
