"""Analytic tensor-parallel communication per training step (forward + backward).

``expected_collective_bytes``: the payload bytes of each collective for ``N`` tokens at tp > 1, one term per call
site of ``mhf_dist.parallel.comm`` (the input lookup, each layer's attention and MLP, each Engram memory, each
decoder head, the ``log P_inf`` training term), which the profiler reports next to the measured counts
(``count_collectives``). Every term: docs/design-model.md, "Tensor and pipeline parallelism".
"""

from __future__ import annotations

from collections import Counter

from mhf_dist.config import ModelConfig
from mhf_dist.model.variants import variant


def expected_collective_bytes(
    cfg: ModelConfig, tokens: int, tp: int, elem_size: int = 4, vocab_size: int | None = None
) -> Counter:
    """``{(op, phase): bytes}`` for one forward + backward of the training loss (``vocab_size``: the rows of the
    signature table, needed with the ``log P_inf`` term)."""
    if tp == 1:
        return Counter()
    # the config allows it for the variants whose P_inf it trains
    p_inf = cfg.hash.p_inf_loss_weight > 0
    if p_inf and vocab_size is None:
        raise ValueError(
            "the log P_inf training term's traffic depends on the vocabulary: pass vocab_size"
        )
    scores = tokens * vocab_size if p_inf else 0
    fused = cfg.decoder_chunk_tokens and not p_inf
    n, d, hd, layers = tokens, cfg.d_model, cfg.resolved_head_dim, cfg.n_layers
    heads = variant(cfg).heads(cfg)
    replicated_kv = 0 if cfg.kv_heads_split(tp) else 2 * cfg.n_kv_heads * hd * d
    memory = 0
    if cfg.engram is not None:
        memory = (
            len(cfg.engram_layers)
            * n
            * (cfg.engram.max_ngram - 1)
            * cfg.engram.heads
            * cfg.engram_head_dim
        )
    elements = Counter(
        {
            ("all_reduce_sum", "forward"): n * heads * d
            + layers * 2 * n * d
            + heads * 2 * n
            + (heads - 1) * n * d
            + memory
            + scores,
            ("all_reduce_max", "forward"): heads * n,
            ("all_reduce_sum", "backward"): layers * (2 * n * d + 2 * hd + replicated_kv)
            + heads * n * d
            + (0 if fused else heads * n)
            + scores,
        }
    )
    return Counter({k: v * elem_size for k, v in elements.items()})
