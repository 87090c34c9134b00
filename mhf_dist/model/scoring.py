"""Inference over the real vocabulary: ``log P_inf`` (SPEC §5).

``score(w) = Σ_i log p_i[H_i(w)]`` and
``log P_inf(w) = score(w) - logsumexp_{w' ∈ V} score(w')``, over registered
tokens only (``registered`` is False for the pad token, whose row gets ``-inf``).
A constant added to one head's ``log p_i`` adds to every ``score(w)`` and
cancels, so each head may give its logits ``o_i = log p_i + log Z_i`` instead
(:meth:`CascadedDecoder.scores`): no per-head normaliser is needed.

The heads' scores are laid side by side (column ``i·R + b`` is head
``i``'s bucket ``b``; a last zero column stands for coordinates another rank
holds), and :func:`signature_columns` maps every signature coordinate to its
column once per model, head by head, so a head's scores are one contiguous
gather and the sum over heads is H - 1 vector adds (gathering all coordinates at
once and summing the innermost axis of size H is about 3× slower on a CPU). The
vocabulary is processed in chunks. :func:`target_log_p_inf` never holds
``[N, V]``, so its small chunks bound its memory to ``O(N × chunk)`` whatever
``V`` is (a 1M-token vocabulary included). :func:`log_p_inf` returns ``[N, V]``,
which bounds its memory anyway, so its chunks are large: one chunk up to
``V = 2^18`` at ``H = 4``, as every chunk costs some ``2H`` more small ops (when
generating, a 131K vocabulary in 8 chunks took 0.8 ms, 4%, more). Each rank of a
bucket-sharded model gathers only the coordinates it owns; the sum over heads is
reduced once per chunk.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from mhf_dist.model.tables import BucketTables

LOG_P_INF_CHUNK = 2**20  # values gathered per position in one chunk of log_p_inf
TARGET_CHUNK = 2**16  # ... and of target_log_p_inf


def signature_columns(codes: torch.Tensor, tables: BucketTables) -> torch.Tensor:
    """``codes [V, H]`` -> ``[H, V]``: each coordinate's column in :func:`side_by_side`'s layout on this rank."""
    local, owned = tables.local_index(codes.t())
    head_offset = torch.arange(codes.shape[1], device=codes.device).unsqueeze(-1) * tables.local_rows
    return torch.where(owned, local + head_offset, codes.shape[1] * tables.local_rows).contiguous()


def side_by_side(head_scores: list[torch.Tensor]) -> torch.Tensor:
    """H tensors ``[N, R_local]`` -> ``[N, H·R_local + 1]``, the last column zero."""
    return torch.cat([*head_scores, head_scores[0].new_zeros(head_scores[0].shape[0], 1)], dim=-1)


def signature_scores(side: torch.Tensor, columns: torch.Tensor, registered: torch.Tensor,
                     tables: BucketTables) -> torch.Tensor:
    """``score [N, V]`` from :func:`side_by_side` head scores, ``columns [H, V]`` (:func:`signature_columns`) and
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


def log_p_inf(head_scores: list[torch.Tensor], columns: torch.Tensor, registered: torch.Tensor,
              tables: BucketTables, chunk_size: int = LOG_P_INF_CHUNK) -> torch.Tensor:
    """``log P_inf [N, V]``: signature scores renormalised over the registered vocabulary."""
    chunks = list(score_chunks(side_by_side(head_scores), columns, registered, tables, chunk_size))
    return (chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=-1)).log_softmax(dim=-1)


def target_log_p_inf(head_scores: list[torch.Tensor], columns: torch.Tensor, registered: torch.Tensor,
                     tables: BucketTables, targets: torch.Tensor, chunk_size: int = TARGET_CHUNK) -> torch.Tensor:
    """``log P_inf(target) [N]`` without materialising ``[N, V]``: a running logsumexp over vocabulary chunks."""
    side = side_by_side(head_scores)
    log_z = side.new_full((targets.shape[0],), float("-inf"))
    for scores in score_chunks(side, columns, registered, tables, chunk_size):
        log_z = torch.logaddexp(log_z, torch.logsumexp(scores, dim=-1))
    target_score = tables.reduce_sum(side.gather(1, columns[:, targets].t()).sum(-1))
    return target_score - log_z
