"""Tensor-parallel sharding as data: which dimension of each parameter is split.

One table, :func:`tp_split_dims`, drives both the parallel plan (each rank
loads its shard of the full weights) and checkpoint conversion between a full
(tp = 1) state dict and tp-sharded ones, in both directions. Parameters it does
not name are replicated.
"""

from __future__ import annotations

import re

import torch

from mhf_dist.config import ModelConfig

_LAYER = r"backbone\.layers\.\d+\."


def tp_split_dims(cfg: ModelConfig, tp: int) -> list[tuple[re.Pattern, int]]:
    """(parameter-name pattern, split dim); k/v projections are replicated when n_kv_heads < tp."""
    kv_split = cfg.n_kv_heads % tp == 0
    dims = [
        (r"vocab\.tables\.weight", 1),  # bucket / vocabulary rows
        (_LAYER + r"engram\.tables\.weight", 1),  # Engram memory rows (SPEC §8)
        (_LAYER + r"self_attn\.q_proj\.weight", 0),
        (_LAYER + r"self_attn\.o_proj\.weight", 1),
        (_LAYER + r"mlp\.(gate|up)_proj\.weight", 0),
        (_LAYER + r"mlp\.down_proj\.weight", 1),
    ]
    if kv_split:
        dims.append((_LAYER + r"self_attn\.[kv]_proj\.weight", 0))
    return [(re.compile(p), d) for p, d in dims]


def split_dim(name: str, dims: list[tuple[re.Pattern, int]]) -> int | None:
    return next((d for pattern, d in dims if pattern.fullmatch(name)), None)


def shard_state_dict(full: dict[str, torch.Tensor], dims, rank: int, tp: int) -> dict[str, torch.Tensor]:
    """This rank's shard of a full state dict."""
    out = {}
    for name, tensor in full.items():
        d = split_dim(name, dims)
        out[name] = tensor if d is None else tensor.chunk(tp, dim=d)[rank].clone()
    return out


def merge_state_dicts(shards: list[dict[str, torch.Tensor]], dims) -> dict[str, torch.Tensor]:
    """The full state dict from every tp rank's shard (replicated entries must agree)."""
    out = {}
    for name in shards[0]:
        d = split_dim(name, dims)
        if d is None:
            if not all(torch.equal(s[name], shards[0][name]) for s in shards[1:]):
                raise ValueError(f"replicated parameter {name} differs between tensor-parallel ranks")
            out[name] = shards[0][name]
        else:
            out[name] = torch.cat([s[name] for s in shards], dim=d)
    return out
