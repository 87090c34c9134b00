"""The tensor-parallel plan: which module of a LanguageModel becomes which parallel layer.

``tp_plan`` is the one table, module-name pattern → ``Style`` (which parallel layer replaces the module and which
dimension of its weight is split; None: replicated), as a parallelize plan is. ``shard_modules`` swaps the modules
for their parallel forms at this rank's shard size (on the meta device in training: ``mhf_dist.parallel.construct``);
``tp_split_dims``, every parameter's split dimension, is how ``mhf_dist.parallel.state_dict`` shards and merges state
dicts and checkpoints; ``apply_tensor_parallel`` swaps a full-size model's modules and loads this rank's shard (the
equivalence tests). Attention and the MLP are column/row parallel, k/v heads split when ``n_kv_heads`` is a multiple
of tp, else replicated (``ModelConfig.kv_heads_split``); the Engram tables split along their rows like the bucket
tables, their gates replicated. Why: docs/design-model.md, "Tensor and pipeline parallelism".
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from mhf_dist.config import ModelConfig
from mhf_dist.model.lm import LanguageModel
from mhf_dist.parallel.layers import (
    BucketParallelEmbedding,
    ColumnParallelLinear,
    RegionRMSNorm,
    ReplicatedHeadsLinear,
    RowParallelLinear,
    mark_region,
)
from mhf_dist.parallel.state_dict import shard_state_dict


@dataclass(frozen=True)
class Shard:
    """Where a module is sharded: the model's config and this rank of a tensor-parallel group of ``size``."""

    cfg: ModelConfig
    group: object
    rank: int
    size: int


@dataclass(frozen=True)
class Style:
    """How one module is parallelised: ``build`` makes its parallel form from the full-size module (weights not
    initialised); ``dim`` is the split dimension of its weight, None when the weight is replicated."""

    dim: int | None
    build: Callable[[nn.Module, Shard], nn.Module]


def _region(module: nn.Module, shard: Shard) -> nn.Module:
    mark_region(module, shard.group)
    return module


def _replicated_heads(linear: nn.Linear, shard: Shard) -> ReplicatedHeadsLinear:
    cfg = shard.cfg
    hd = cfg.resolved_head_dim
    # With fewer kv heads than ranks, this rank's query heads all share kv head `kv`.
    kv = shard.rank * (cfg.n_heads // shard.size) // (cfg.n_heads // cfg.n_kv_heads)
    return ReplicatedHeadsLinear(
        linear.in_features, linear.out_features, slice(kv * hd, (kv + 1) * hd), shard.group
    )


BUCKET_ROWS = Style(
    1, lambda t, s: BucketParallelEmbedding(*t.weight.shape, s.group, s.rank, s.size)
)
COLUMN = Style(0, lambda m, s: ColumnParallelLinear(m.in_features, m.out_features, s.size))
ROW = Style(1, lambda m, s: RowParallelLinear(m.in_features, m.out_features, s.group, s.size))
REPLICATED_HEADS = Style(None, _replicated_heads)
REGION = Style(None, _region)  # its input is copied into the group once; no parameters of its own
REGION_NORM = Style(None, lambda m, s: RegionRMSNorm(m.normalized_shape[0], m.eps, s.group))

_LAYER = r"backbone\.layers\.\d+\."


def tp_plan(cfg: ModelConfig, tp: int) -> dict[str, Style]:
    """``{module-name pattern: style}``; modules no pattern names stay as they are (replicated)."""
    kv = COLUMN if cfg.kv_heads_split(tp) else REPLICATED_HEADS
    # Engram memory rows (docs/spec.md §8); host tables split over the ranks by themselves, not over tp
    memory = (
        {}
        if cfg.engram is not None and cfg.engram.offload
        else {_LAYER + r"engram\.tables": BUCKET_ROWS}
    )
    return {
        r"vocab\.tables": BUCKET_ROWS,  # bucket / vocabulary rows
        **memory,
        _LAYER + r"self_attn": REGION,
        _LAYER + r"self_attn\.q_proj": COLUMN,
        _LAYER + r"self_attn\.[kv]_proj": kv,
        _LAYER + r"self_attn\.o_proj": ROW,
        _LAYER + r"self_attn\.[qk]_norm": REGION_NORM,
        _LAYER + r"mlp": REGION,
        _LAYER + r"mlp\.(gate|up)_proj": COLUMN,
        _LAYER + r"mlp\.down_proj": ROW,
    }


def tp_split_dims(cfg: ModelConfig, tp: int) -> list[tuple[re.Pattern, int]]:
    """(parameter-name pattern, split dim) of every split weight in ``tp_plan``; other parameters are
    replicated."""
    return [
        (re.compile(pattern + r"\.weight"), style.dim)
        for pattern, style in tp_plan(cfg, tp).items()
        if style.dim is not None
    ]


def shard_modules(model: LanguageModel, group, rank: int, size: int) -> LanguageModel:
    """Swap every module ``tp_plan`` names for its parallel form at this rank's size, created on the current
    default device (its weights not initialised; the meta device creates none)."""
    if size == 1:
        return model
    shard = Shard(model.cfg, group, rank, size)
    plan = [(re.compile(pattern), style) for pattern, style in tp_plan(model.cfg, size).items()]
    for name, module in list(model.named_modules()):
        style = next((style for pattern, style in plan if pattern.fullmatch(name)), None)
        if style is not None:
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, style.build(module, shard))
    return model


def apply_tensor_parallel(model: LanguageModel, group, rank: int, size: int) -> LanguageModel:
    """``shard_modules`` on a model built at full size, then this rank's shard of its weights."""
    if size == 1:
        return model
    full = model.state_dict()
    shard_modules(model, group, rank, size)
    model.load_state_dict(shard_state_dict(full, tp_split_dims(model.cfg, size), rank, size))
    return model
