"""The tensor-parallel plan: which module of a LanguageModel becomes which parallel layer (SPEC §7).

:func:`shard_modules` swaps the modules for their parallel forms, built at
this rank's shard size (training applies it to a model whose parameters are
still on the meta device, then materialises only the shards:
:mod:`mhf_dist.parallel.construct`); :func:`apply_tensor_parallel` does the
same to a model built at full size and loads each rank's shard of its weights
(:mod:`state_dict`), which the equivalence tests compare with one process.
Attention heads and the MLP are column/row parallel with one all-reduce after
each in forward; k/v heads are split when ``n_kv_heads`` is a multiple of tp,
else each rank computes the one kv head its query heads share. The Engram
memories' tables (SPEC §8) split along their rows like the bucket tables; their
gates are replicated (each rank computes them on the all-reduced lookup).
"""

from __future__ import annotations

from mhf_dist.model.lm import LanguageModel
from mhf_dist.model.tables import BucketTables
from mhf_dist.parallel.layers import (
    BucketParallelEmbedding,
    ColumnParallelLinear,
    RegionRMSNorm,
    ReplicatedHeadsLinear,
    RowParallelLinear,
    mark_region,
)
from mhf_dist.parallel.state_dict import shard_state_dict, tp_split_dims


def row_sharded(tables: BucketTables, group, rank: int, size: int) -> BucketParallelEmbedding:
    """This rank's rows of ``tables`` (weights not initialised)."""
    return BucketParallelEmbedding(*tables.weight.shape, group, rank, size)


def shard_modules(model: LanguageModel, group, rank: int, size: int) -> LanguageModel:
    """Swap every sharded module for its parallel form at this rank's size, created on the current default device
    (its weights not initialised; the meta device creates none); replicated modules are left as they are."""
    if size == 1:
        return model
    cfg = model.cfg
    model.vocab.tables = row_sharded(model.vocab.tables, group, rank, size)
    d, hd = cfg.d_model, cfg.resolved_head_dim
    kv_split = cfg.n_kv_heads % size == 0
    # With fewer kv heads than ranks, this rank's query heads all share kv head `kv`.
    kv = rank * (cfg.n_heads // size) // (cfg.n_heads // cfg.n_kv_heads)
    for block in model.backbone.layers:
        if block.engram is not None:
            block.engram.tables = row_sharded(block.engram.tables, group, rank, size)
        attn, mlp = block.self_attn, block.mlp
        mark_region(attn, group)
        attn.q_proj = ColumnParallelLinear(d, cfg.n_heads * hd, size)
        for name in ("k_proj", "v_proj"):
            layer = (ColumnParallelLinear(d, cfg.n_kv_heads * hd, size) if kv_split
                     else ReplicatedHeadsLinear(d, cfg.n_kv_heads * hd, slice(kv * hd, (kv + 1) * hd), group))
            setattr(attn, name, layer)
        attn.o_proj = RowParallelLinear(cfg.n_heads * hd, d, group, size)
        attn.q_norm = RegionRMSNorm(hd, cfg.norm_eps, group)
        attn.k_norm = RegionRMSNorm(hd, cfg.norm_eps, group)
        mark_region(mlp, group)
        mlp.gate_proj = ColumnParallelLinear(d, cfg.ffn_dim, size)
        mlp.up_proj = ColumnParallelLinear(d, cfg.ffn_dim, size)
        mlp.down_proj = RowParallelLinear(cfg.ffn_dim, d, group, size)
    return model


def apply_tensor_parallel(model: LanguageModel, group, rank: int, size: int) -> LanguageModel:
    """:func:`shard_modules` on a model built at full size, then this rank's shard of its weights."""
    if size == 1:
        return model
    full = model.state_dict()
    shard_modules(model, group, rank, size)
    model.load_state_dict(shard_state_dict(full, tp_split_dims(model.cfg, size), rank, size))
    return model
