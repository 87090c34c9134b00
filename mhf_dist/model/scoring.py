"""Inference over the real vocabulary: ``log P_inf`` (SPEC §5).

``score(w) = Σ_i log p_i[H_i(w)]`` and
``log P_inf(w) = score(w) - logsumexp_{w' ∈ V} score(w')``, over registered
tokens only (``registered`` is False for the pad token, whose row gets ``-inf``).

The heads' log-probabilities are laid side by side (column ``i·R + b`` is head
``i``'s bucket ``b``; a last zero column stands for coordinates another rank
holds), and :func:`signature_columns` maps every signature coordinate to its
column once per model, head by head, so a head's scores are one contiguous
gather and the sum over heads is H - 1 vector adds (gathering all coordinates at
once and summing the innermost axis of size H is about 3× slower on a CPU). The
vocabulary is processed in chunks, so the extra memory is ``O(N × chunk)``
whatever ``V`` is (a 1M-token vocabulary included). Each rank of a
bucket-sharded model gathers only the coordinates it owns; the sum over heads is
reduced once per chunk.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from mhf_dist.model.tables import BucketTables


def signature_columns(codes: torch.Tensor, tables: BucketTables) -> torch.Tensor:
    """``codes [V, H]`` -> ``[H, V]``: each coordinate's column in :func:`side_by_side`'s layout on this rank."""
    local, owned = tables.local_index(codes.t())
    head_offset = torch.arange(codes.shape[1], device=codes.device).unsqueeze(-1) * tables.local_rows
    return torch.where(owned, local + head_offset, codes.shape[1] * tables.local_rows).contiguous()


def side_by_side(head_log_probs: list[torch.Tensor]) -> torch.Tensor:
    """H tensors ``[N, R_local]`` -> ``[N, H·R_local + 1]``, the last column zero."""
    return torch.cat([*head_log_probs, head_log_probs[0].new_zeros(head_log_probs[0].shape[0], 1)], dim=-1)


def signature_scores(side: torch.Tensor, columns: torch.Tensor, registered: torch.Tensor,
                     tables: BucketTables) -> torch.Tensor:
    """``score [N, V]`` from :func:`side_by_side` log-probs, ``columns [H, V]`` (:func:`signature_columns`) and
    ``registered [V]``."""
    scores = side.index_select(1, columns[0])
    for head_columns in columns[1:]:
        scores += side.index_select(1, head_columns)
    return torch.where(registered, tables.reduce_sum(scores), float("-inf"))


def score_chunks(side: torch.Tensor, columns: torch.Tensor, registered: torch.Tensor, tables: BucketTables,
                 chunk_size: int) -> Iterator[torch.Tensor]:
    """:func:`signature_scores` over consecutive vocabulary chunks, each gathering ``chunk_size`` values per
    token (``chunk_size / H`` tokens)."""
    step = max(1, chunk_size // columns.shape[0])
    for start in range(0, columns.shape[1], step):
        yield signature_scores(side, columns[:, start:start + step], registered[start:start + step], tables)


def log_p_inf(head_log_probs: list[torch.Tensor], columns: torch.Tensor, registered: torch.Tensor,
              tables: BucketTables, chunk_size: int = 65536) -> torch.Tensor:
    """``log P_inf [N, V]``: signature scores renormalised over the registered vocabulary."""
    chunks = score_chunks(side_by_side(head_log_probs), columns, registered, tables, chunk_size)
    return torch.cat(list(chunks), dim=-1).log_softmax(dim=-1)


def target_log_p_inf(head_log_probs: list[torch.Tensor], columns: torch.Tensor, registered: torch.Tensor,
                     tables: BucketTables, targets: torch.Tensor, chunk_size: int = 65536) -> torch.Tensor:
    """``log P_inf(target) [N]`` without materialising ``[N, V]``: a running logsumexp over vocabulary chunks."""
    side = side_by_side(head_log_probs)
    log_z = side.new_full((targets.shape[0],), float("-inf"))
    for scores in score_chunks(side, columns, registered, tables, chunk_size):
        log_z = torch.logaddexp(log_z, torch.logsumexp(scores, dim=-1))
    target_score = tables.reduce_sum(side.gather(1, columns[:, targets].t()).sum(-1))
    return target_score - log_z
