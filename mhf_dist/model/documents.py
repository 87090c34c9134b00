"""Documents packed in one row (``data.document_masking``): where each starts, and what each token may see.

Shards hold documents back to back, an EOS after each. A document starts at position 0 and right after each EOS of
the input row (the EOS ends its document, so it belongs to the one before it). ``document_positions`` gives every
token its position in its document, from which the rest follows: RoPE restarts at each document start, a query sees
the keys of its own document only (``document_mask``: block-diagonal causal), and the Engram memory's N-grams and
short convolution read the pad id or zeros before a document start, as they do before the row's start. Computed from
the token ids once per forward (once per stage under the pipeline) and handed to the blocks as ``BlockInputs``. Why an
additive mask for ``scaled_dot_product_attention``: docs/design-model.md, "Document masking". The loss leaves out an
EOS's prediction of the next document's first token (``targets_of``, where the trainers split a micro-batch).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class BlockInputs(NamedTuple):
    """What every block of one forward reads beside its hidden states: the RoPE tables, and with document masking
    the tokens' positions in their documents and the attention mask (None without)."""

    cos: torch.Tensor  # [S, head_dim], with document masking [B, 1, S, head_dim]
    sin: torch.Tensor
    positions: torch.Tensor | None = None  # [B, S]
    # [B, 1, S, S]: document_mask as the additive bias of the attention scores (attention_bias)
    mask: torch.Tensor | None = None


def document_positions(input_ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Each token's position in its document, ``[B, S]`` (int64): 0 at the row's start and right after every EOS."""
    index = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    starts = torch.zeros_like(input_ids, dtype=torch.bool)
    starts[:, 1:] = input_ids[:, :-1] == eos_id
    # the latest start at or before each position (0 for the row's first document)
    start = torch.where(starts, index, 0).cummax(dim=1).values
    return index - start


def document_mask(positions: torch.Tensor) -> torch.Tensor:
    """``[B, 1, S, S]`` bool: query ``t`` sees key ``u`` iff ``t - positions[t] <= u <= t`` (its document's start
    to itself). Every query sees itself, so no row of the mask is empty."""
    index = torch.arange(positions.shape[1], device=positions.device)
    keys = index[None, None, :]
    first = (index - positions)[:, :, None]  # each query's document start
    return ((keys <= index[None, :, None]) & (keys >= first)).unsqueeze(1)


def attention_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``mask`` as the additive bias ``scaled_dot_product_attention`` adds to the scores: 0 where a key is seen,
    ``-inf`` elsewhere, in ``dtype`` (the queries'). Made once per forward: given a boolean mask, every attention
    call would convert it again."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        ~mask, float("-inf")
    )


def targets_of(batch: torch.Tensor, eos_id: int | None) -> torch.Tensor:
    """The targets of the rows ``batch [B, S + 1]``, whose inputs are ``batch[:, :-1]``: each input's next token,
    ``batch[:, 1:]`` itself without document masking (``eos_id`` None). With it, -1 (ignored: the loss and the
    health metrics' counts take targets ``>= 0``) where the input is ``eos_id``: its next token starts another
    document, which that position does not see, so it is not counted (Megatron's ``eod_mask_loss``)."""
    targets = batch[:, 1:]
    if eos_id is None:
        return targets
    return targets.masked_fill(batch[:, :-1] == eos_id, -1)
