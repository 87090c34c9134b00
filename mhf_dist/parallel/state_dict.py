"""Tensor-parallel sharding of state dicts: each rank's shard of a full one, and the full one from the shards.

The split dimension of every parameter comes from the tensor-parallel plan
(``mhf_dist.parallel.tensor_parallel.tp_split_dims``); parameters it does
not name are replicated. The same table serves checkpoint conversion between a
full (tp = 1) state dict and tp-sharded ones, in both directions.
"""

from __future__ import annotations

import re

import torch


def split_dim(name: str, dims: list[tuple[re.Pattern, int]]) -> int | None:
    return next((d for pattern, d in dims if pattern.fullmatch(name)), None)


def shard_state_dict(
    full: dict[str, torch.Tensor], dims, rank: int, tp: int
) -> dict[str, torch.Tensor]:
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
                raise ValueError(
                    f"replicated parameter {name} differs between tensor-parallel ranks"
                )
            out[name] = shards[0][name]
        else:
            out[name] = torch.cat([s[name] for s in shards], dim=d)
    return out
