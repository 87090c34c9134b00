"""Pipeline stages: the cost of each pipeline layer and the cut into stages.

The pipeline's layers are the vocabulary input side (tables + gate), the backbone blocks, the final norm and the
vocabulary output side (tables + cascaded decoder), each costing its analytic forward FLOPs per sequence
(``layer_costs``, from ``mhf_dist.model.flops``; the norm counts 1). ``stage_bounds`` minimises the most expensive
stage, keeping the later stages lighter among equally good cuts (the last one also computes the loss), and
``pipeline_bounds`` keeps the final norm on the last stage. ``plan`` and the pipeline engine both use it, so the
plan shows the stages a run will have.
"""

from __future__ import annotations

from mhf_dist.config import ModelConfig
from mhf_dist.model.flops import forward_flops


def layer_costs(cfg: ModelConfig, seq_len: int, vocab_rows: int | None) -> list[int]:
    """One cost per pipeline layer: vocabulary in, each block, final norm, vocabulary out (``vocab_rows`` None: a
    ValueError where the variant's vocabulary costs need them)."""
    flops = forward_flops(cfg, seq_len, vocab_rows=vocab_rows)
    return (
        [flops.vocab_in + 1]
        + [flops.layer(i) for i in range(cfg.n_layers)]
        + [1, flops.vocab_out + 1]
    )


def stage_bounds(costs: list[int], stages: int) -> list[int]:
    """``stages + 1`` boundaries into ``costs`` (stage ``s`` holds layers ``bounds[s]:bounds[s+1]``, at least one
    each) minimising the largest stage cost."""
    n = len(costs)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot cut {n} pipeline layers into {stages} stages")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[s][i]: the smallest possible largest-stage cost of layers[:i] cut into s stages; cut[s][i]: its last start
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            for start in range(s - 1, i):
                worst = max(best[s - 1][start], prefix[i] - prefix[start])
                if worst <= best[s][i]:  # ties: the later start, a lighter last stage
                    best[s][i], cut[s][i] = worst, start
    bounds = [n]
    for s in range(stages, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    return bounds[::-1]


def pipeline_bounds(costs: list[int], stages: int) -> list[int]:
    """``stage_bounds`` of the pipeline's layers (``layer_costs``) with the final norm kept on the last stage,
    beside the vocabulary out. That stage then holds a parameter of its own: DeepSpeed counts the tied vocabulary's
    gradients on the first stage only, and its bf16 optimizer fails on a stage with none to count. (The norm costs 1,
    so the balance is the same.)"""
    merged = stage_bounds([*costs[:-2], costs[-2] + costs[-1]], stages)
    return [*merged[:-1], len(costs)]


def stage_blocks(bounds: list[int], n_layers: int) -> list[range]:
    """The backbone blocks of each stage cut at ``bounds`` (``pipeline_bounds``): pipeline layer ``j`` of
    ``1..n_layers`` is block ``j - 1``."""
    return [range(max(a - 1, 0), min(b - 1, n_layers)) for a, b in zip(bounds, bounds[1:])]
