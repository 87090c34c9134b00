"""Analytic tensor-parallel communication per training step (forward + backward).

Payload bytes per collective, for ``N`` tokens, element size ``s``, tp > 1
(at tp = 1 nothing is communicated). Each term is one call site of
:mod:`mhf_dist.parallel.comm`:

forward, ``all_reduce_sum``
  - input lookup: ``N·H·d`` (MHF; ``N·d`` for Standard, H = 1)
  - per layer: attention output ``N·d`` + MLP output ``N·d``
  - per Engram memory (docs/spec.md §8): its lookup ``N·(N_max−1)·K·head_dim``
  - decoder, per head: softmax normaliser ``N`` + target log-prob ``N``;
    soft retrieval ``N·d`` for each of the first ``H-1`` heads
forward, ``all_reduce_max``
  - decoder, per head: softmax maximum ``N``
backward, ``all_reduce_sum``
  - per layer: attention input ``N·d`` + MLP input ``N·d``; q/k norm gains ``2·hd``;
    replicated k/v projections ``2·n_kv·hd·d`` when n_kv_heads < tp
  - decoder, per head: the hidden state entering the sharded logits ``N·d``;
    with the plain (unfused) decoder also its log-normaliser ``N``

With the ``log P_inf`` training term (``model.hash.p_inf_loss_weight`` > 0,
over ``V`` tokens) the decoder runs unfused, and the signature scores are
all-reduced ``N·V`` in the forward and again (recomputed) ``N·V`` in the backward.

The profiler reports these next to measured counts (:func:`count_collectives`).
"""

from __future__ import annotations

from collections import Counter

from mhf_dist.config import ModelConfig
from mhf_dist.model.variants import variant


def expected_collective_bytes(cfg: ModelConfig, tokens: int, tp: int, elem_size: int = 4,
                              vocab_size: int | None = None) -> Counter:
    """``{(op, phase): bytes}`` for one forward + backward of the training loss (``vocab_size``: the rows of the
    signature table, needed with the ``log P_inf`` term)."""
    if tp == 1:
        return Counter()
    p_inf = cfg.hash.p_inf_loss_weight > 0  # the config allows it for the variants whose P_inf it trains
    if p_inf and vocab_size is None:
        raise ValueError("the log P_inf training term's traffic depends on the vocabulary: pass vocab_size")
    scores = tokens * vocab_size if p_inf else 0
    fused = cfg.decoder_chunk_tokens and not p_inf
    n, d, hd, layers = tokens, cfg.d_model, cfg.resolved_head_dim, cfg.n_layers
    heads = variant(cfg).heads(cfg)
    replicated_kv = 0 if cfg.kv_heads_split(tp) else 2 * cfg.n_kv_heads * hd * d
    memory = 0
    if cfg.engram is not None:
        memory = len(cfg.engram_layers) * n * (cfg.engram.max_ngram - 1) * cfg.engram.heads * cfg.engram_head_dim
    elements = Counter({
        ("all_reduce_sum", "forward"): n * heads * d + layers * 2 * n * d + heads * 2 * n + (heads - 1) * n * d
        + memory + scores,
        ("all_reduce_max", "forward"): heads * n,
        ("all_reduce_sum", "backward"): layers * (2 * n * d + 2 * hd + replicated_kv) + heads * n * d
        + (0 if fused else heads * n) + scores,
    })
    return Counter({k: v * elem_size for k, v in elements.items()})
