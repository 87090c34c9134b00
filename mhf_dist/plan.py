"""``mhf-dist plan``: will a run fit? Parameters, ZeRO model states and activations per rank.

The model is built on the meta device (no memory), sharded on paper with the
tensor-parallel table (:func:`tp_split_dims`) and cut into pipeline stages by
the same FLOP-balanced cut the engine uses (:mod:`mhf_dist.parallel.stages`).
Model states per rank, for ``P`` parameters on a stage and ``dp`` data-parallel
ranks (mixed-precision Adam: 18 bytes per parameter for the 16-bit gradients
and the fp32 gradients, weights, momentum and variance, plus 2 for the 16-bit
weights; the byte counts of DeepSpeed's own estimators): ZeRO-3 partitions all
of it and gathers the largest layer in fp32 (``4·largest + 18·P/dp``); ZeRO-2
keeps the 16-bit weights whole (``2·P + 18·P/dp``); ZeRO-1 also keeps whole
16-bit gradients (``+ 2·P·(1 − 1/dp)``). Activations per token and layer, in the run's dtype (SDPA
keeps no ``S×S`` scores)::

    bytes = e · (4d + (2·n_heads·hd + 2·n_kv·hd) / tp + 4·ffn / tp)

(norm inputs/outputs, q k v and attention output, gate/up/activation/product);
with activation checkpointing a block keeps only its input (``e·d``) plus one
block's full set during recompute. A block with an Engram memory (SPEC §8)
adds its looked-up rows and gate tensors, about ``e·((N−1)·K·head_dim + 8d)``
per token. The last stage adds the decoder: with the fused decoder (the
default) each head keeps ``c`` and ``ē`` (``2·e·d``) and two fp32 statistics
per token, plus one chunk's logits in flight, ``2·min(chunk, tokens)·(B/tp)·(e + 4)``
bytes (the stacked backward products in the run's dtype and fp32); the plain
path keeps every head's logits and fp32 probabilities, ``H·(B/tp)·(e + 4)`` per
token. Pipeline stage ``s`` holds up to ``pp - s`` micro-batches in flight (1F1B).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mhf_dist.cluster import ClusterProfile
from mhf_dist.config import RunConfig
from mhf_dist.engram_compression import CompressionTable
from mhf_dist.model import build_model
from mhf_dist.parallel.layout import deepspeed_config, resolve_layout
from mhf_dist.parallel.stages import layer_costs, stage_bounds
from mhf_dist.parallel.state_dict import split_dim, tp_split_dims

GB = 2**30


@dataclass
class StagePlan:
    stage: int
    blocks: int
    params_per_rank: int
    model_states_gb: float
    activations_gb: float
    activations_checkpointed_gb: float
    fits: bool


def model_state_bytes(zero: int, params: int, largest: int, dp: int) -> float:
    """Weights, gradients and Adam states per rank under ZeRO stage ``zero`` (see the module docstring)."""
    if zero == 3:
        return 4 * largest + 18 * params / dp
    return 2 * params + 18 * params / dp + (2 * params * (1 - 1 / dp) if zero <= 1 else 0)


def memory_plan(cfg: RunConfig, profile: ClusterProfile, nodes: int, vocab_size: int = 32768) -> list[StagePlan]:
    world = nodes * profile.gpus_per_node
    layout = resolve_layout(cfg, world)
    zero = deepspeed_config(cfg, layout, "cuda")["zero_optimization"]["stage"]
    m, tp, pp, dp = cfg.model, layout.tp, layout.pp, layout.dp
    compression = CompressionTable.identity(vocab_size)  # sizes only: no tokenizer needed
    with torch.device("meta"):
        model = build_model(m, vocab_size, torch.ones(vocab_size, m.hash.num_hashes, dtype=torch.long), compression)
    dims = tp_split_dims(m, tp)
    per_rank = {n: p.numel() // (tp if split_dim(n, dims) is not None else 1) for n, p in model.named_parameters()}

    def params(prefix: str) -> int:
        return sum(v for n, v in per_rank.items() if n.startswith(prefix))

    vocab_in = params("vocab.tables.") + params("vocab.encoder.")
    vocab_out = params("vocab.tables.") + params("vocab.decoder.")
    costs = layer_costs(m, cfg.data.seq_len, model.vocab.tables.num_rows)
    parts = stage_bounds(costs, pp)

    e = 2 if cfg.train.dtype == "bf16" else 4
    d, hd = m.d_model, m.resolved_head_dim
    act_layer = e * (4 * d + (2 * m.n_heads * hd + 2 * m.n_kv_heads * hd) / tp + 4 * m.ffn_dim / tp)
    act_engram = e * ((m.engram.max_ngram - 1) * m.engram.heads * m.engram_head_dim + 8 * d) if m.engram else 0
    tokens = cfg.train.micro_batch_size * cfg.data.seq_len
    heads, rows = (m.hash.num_hashes if m.variant == "mhf" else 1), model.vocab.tables.num_rows / tp
    if m.decoder_chunk_tokens:
        decoder = tokens * heads * (2 * e * d + 8) + 2 * min(m.decoder_chunk_tokens, tokens) * rows * (e + 4)
    else:
        decoder = tokens * heads * rows * (e + 4)

    plans = []
    for s in range(pp):
        layers = range(parts[s], parts[s + 1])
        blocks = sum(1 for i in layers if 1 <= i <= m.n_layers)
        total = sum(params(f"backbone.layers.{i - 1}.") for i in layers if 1 <= i <= m.n_layers)
        total += (vocab_in if 0 in layers else 0) + (vocab_out if len(costs) - 1 in layers else 0)
        total += params("backbone.norm.") if m.n_layers + 1 in layers else 0
        if pp == 1:
            total = sum(per_rank.values())
        states = model_state_bytes(zero, total, max(per_rank.values()), dp)
        in_flight = min(pp - s, layout.accum)
        memories = sum(1 for i in layers if i - 1 in m.engram_layers)
        last = decoder if len(costs) - 1 in layers else 0
        full = in_flight * tokens * (act_layer * blocks + act_engram * memories) + last
        recompute = act_layer + (act_engram if memories else 0)  # one block's full set, memory included
        ckpt = in_flight * tokens * e * d * blocks + tokens * recompute * min(blocks, 1) + last
        plans.append(StagePlan(
            stage=s, blocks=blocks, params_per_rank=int(total), model_states_gb=states / GB,
            activations_gb=full / GB, activations_checkpointed_gb=ckpt / GB,
            fits=(states + ckpt) / GB <= 0.9 * profile.device_memory_gb,
        ))
    return plans


def format_plan(cfg: RunConfig, profile: ClusterProfile, nodes: int, plans: list[StagePlan]) -> str:
    world = nodes * profile.gpus_per_node
    layout = resolve_layout(cfg, world)
    zero = deepspeed_config(cfg, layout, "cuda")["zero_optimization"]["stage"]
    lines = [
        f"{cfg.preset or 'config'} on {nodes} × {profile.name} ({world} ranks, {profile.device_memory_gb:g} GB each): "
        f"tp={layout.tp} pp={layout.pp} dp={layout.dp}, ZeRO-{zero}, {cfg.train.dtype}, micro-batch "
        f"{cfg.train.micro_batch_size} × {cfg.data.seq_len} tokens, {layout.accum} micro-batches per step",
        f"{'stage':>5} {'blocks':>6} {'params/rank':>12} {'model states':>13} {'activations':>12} "
        f"{'act. ckpt':>10} {'fits (ckpt)':>11}",
    ]
    for p in plans:
        lines.append(f"{p.stage:>5} {p.blocks:>6} {p.params_per_rank / 1e6:>11.1f}M {p.model_states_gb:>11.1f}GB "
                     f"{p.activations_gb:>10.1f}GB {p.activations_checkpointed_gb:>8.1f}GB "
                     f"{'yes' if p.fits else 'NO':>11}")
    verdict = "fits" if all(p.fits for p in plans) else "does not fit: raise tp/pp, lower the micro-batch, or add nodes"
    lines.append(f"with activation checkpointing the run {verdict} (limit: 90% of device memory)")
    return "\n".join(lines)
