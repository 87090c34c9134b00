"""Next-token choice from ``log P_inf`` (SPEC §5): greedy, temperature, top-k, top-p.

``log P_inf`` is ``-inf`` for every unregistered row, and the warpers only ever
lower scores, so every chosen id is a registered token. The warpers are
Hugging Face's, the same ones ``generate()`` applies to the exported model.
"""

from __future__ import annotations

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)


def choose_next_token(
    log_probs: torch.Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``log_probs [N, V]`` -> token ids ``[N]``; ``temperature == 0`` is greedy."""
    if temperature == 0.0:
        return log_probs.argmax(dim=-1)
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p is not None and top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    scores = warpers(None, log_probs.float())
    return torch.multinomial(scores.softmax(dim=-1), 1, generator=generator).squeeze(-1)
