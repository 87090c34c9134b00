"""``mhf-dist plan``: will a run fit, and how long is a step? Memory per rank and per node, time per step.

The model is built on the meta device (no memory), sharded on paper with the tensor-parallel table
(``tp_split_dims``) and cut into pipeline stages by the engine's own cut (``mhf_dist.parallel.stages``). Here: the
memory of each stage (``memory_plan``, from ``model_state_bytes``, ``decoder_bytes``, ``construction_bytes`` and
``host_bytes_per_node``) and the printed plan (``format_plan``); the time per step and the checkpoints are
``mhf_dist.cluster.job_estimates``'s. Every formula: docs/configuration.md, "How ``plan`` counts".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mhf_dist.backend import (
    checkpoint_interval,
    engine_buffer_bytes,
    engine_config,
    fp32_accumulation,
    zero_stage,
)
from mhf_dist.cluster.job_estimates import (
    DEFAULT_MFU,
    PLANNING_VOCAB_SIZE,
    SaveEstimate,
    StepEstimate,
    device_of,
    save_estimate,
    step_estimate,
)
from mhf_dist.cluster.profile import ClusterProfile
from mhf_dist.config import ModelConfig, RunConfig, preset
from mhf_dist.model import LanguageModel, build_model
from mhf_dist.model.host_memory import run_host_table_memory, sharing_ranks
from mhf_dist.model.variants import variant
from mhf_dist.parallel.layout import resolve_layout
from mhf_dist.parallel.stages import layer_costs, pipeline_bounds, stage_blocks
from mhf_dist.parallel.state_dict import split_dim
from mhf_dist.parallel.tensor_parallel import tp_split_dims
from mhf_dist.vocab.engram_compression import CompressionTable

GB = 2**30
MiB = 2**20
HEADROOM = 0.9  # the share of device or host memory a plan may fill
# What a CPU rank holds that does not grow with its model: Python, torch, DeepSpeed and mhf_dist, the gloo process
# group, the ZeRO-3 engine's bookkeeping for every module and parameter, autograd and the kernels' workspaces. The
# whole process's peak through construction, engine and first step of the tiny preset's structure with tensors of
# no size (32k parameters, 128 KiB), measured 2026-12-01 on a 2-core CPU VM (24 GiB, 4 gloo ranks; largest rank):
#     python tools/bench_construction_memory.py --runtime --ranks 4 --seq-len 128    # -> 423 MiB
CPU_RUNTIME_BYTES = 423 * MiB


@dataclass
class StagePlan:
    stage: int
    blocks: int
    params_per_rank: int
    model_states_gb: float
    activations_gb: float
    activations_checkpointed_gb: float
    fits: bool  # the training peak within HEADROOM of device memory
    decoder_gb: float = (
        0.0  # the decoder's buffers (last stage), included in both activation columns
    )
    buffers_gb: float = 0.0  # DeepSpeed's buffers and the largest parameter's whole gradient
    runtime_gb: float = 0.0  # Python, torch and DeepSpeed (CPU ranks; CPU_RUNTIME_BYTES)
    step_peak_gb: float = (
        0.0  # model states + activations (checkpointed if the run does) + buffers + runtime
    )
    construction_gb: float = 0.0  # host memory of one rank while it builds the model
    model_params: int = 0  # every parameter of the whole model
    first_block: int = 0  # the stage's blocks are first_block, first_block + 1, ...

    @property
    def block_range(self) -> range:
        return range(self.first_block, self.first_block + self.blocks)


def meta_model(cfg: ModelConfig, vocab_size: int) -> LanguageModel:
    """The model for ``vocab_size`` tokens on the meta device: every shape, no memory, no tokenizer."""
    compression = CompressionTable.identity(vocab_size)
    with torch.device("meta"):
        return build_model(
            cfg,
            vocab_size,
            torch.ones(vocab_size, cfg.hash.num_hashes, dtype=torch.long),
            compression,
        )


def model_state_bytes(
    zero: int,
    params: int,
    largest: int,
    dp: int,
    dtype: str = "bf16",
    fp32_accumulation: bool = False,
) -> float:
    """Weights, gradients and Adam states per rank under ZeRO stage ``zero`` in ``dtype``, bf16 gradients
    accumulated in fp32 or not (docs/configuration.md, "How ``plan`` counts")."""
    weights, grads, partitioned = (2, 2, 18) if dtype == "bf16" else (4, 4, 20)
    if dtype == "bf16" and fp32_accumulation and zero == 3:
        partitioned += 2  # the gradient partition in fp32
    if dtype == "bf16" and fp32_accumulation and zero == 1:  # DeepSpeed's bf16 optimizer
        return (2 + 4) * params + 12 * params / dp
    if zero == 3:
        return (
            4 * largest + (partitioned if dtype == "bf16" else weights + partitioned) * params / dp
        )
    return (
        weights * params
        + partitioned * params / dp
        + (grads * params * (1 - 1 / dp) if zero <= 1 else 0)
    )


def decoder_bytes(m: ModelConfig, e: int, tokens: int, rows: int, tp: int) -> float:
    """The decoder's buffers for one micro-batch of ``tokens`` on the last stage, ``rows`` per table over ``tp``
    ranks: fused ``tokens·H·(2·e·d + 8) + 2·min(chunk, tokens)·(rows/tp)·(e + 4)``, and below fp32 (``e < 4``)
    also one head's fp32 table gradient and a chunk's share of it in the run's dtype, ``(rows/tp)·d·(4 + e)``;
    plain ``tokens·H·(rows/tp)·(e + 4)`` (``H = 1`` for Standard), plain with the ``log P_inf`` term
    ``tokens·H·(rows/tp)·(e + 12)``."""
    heads, local = variant(m).heads(m), rows / tp
    if m.hash.p_inf_loss_weight:
        return tokens * heads * local * (e + 12)
    if m.decoder_chunk_tokens:
        accumulator = local * m.d_model * (4 + e) if e < 4 else 0
        return (
            tokens * heads * (2 * e * m.d_model + 8)
            + 2 * min(m.decoder_chunk_tokens, tokens) * local * (e + 4)
            + accumulator
        )
    return tokens * heads * local * (e + 4)


def construction_bytes(kept: float, largest: int) -> float:
    """Host memory of one rank while it builds its part of the model: ``kept`` parameters in fp32 plus the
    ``largest`` one drawn whole (docs/configuration.md, "How ``plan`` counts")."""
    return 4 * kept + 4 * largest


def host_bytes_per_node(per_rank: float, ranks_per_node: int) -> float:
    """``ranks_per_node · per_rank``: the ranks of a node build their models at the same time."""
    return ranks_per_node * per_rank


def host_fits(profile: ClusterProfile, per_rank: float) -> bool | None:
    """Whether a node's ranks build their models within ``HEADROOM`` of ``memory_gb_per_node``; None when the
    profile does not give the node's memory."""
    if profile.memory_gb_per_node is None:
        return None
    return (
        host_bytes_per_node(per_rank, profile.gpus_per_node) / GB
        <= HEADROOM * profile.memory_gb_per_node
    )


def memory_plan(
    cfg: RunConfig, profile: ClusterProfile, nodes: int, vocab_size: int = 32768
) -> list[StagePlan]:
    """One ``StagePlan`` per pipeline stage of ``cfg`` on ``nodes`` nodes of ``profile``."""
    world = nodes * profile.gpus_per_node
    layout = resolve_layout(cfg, world)
    device = device_of(profile)
    ds_config = engine_config(cfg, layout, device)
    zero, checkpointed = zero_stage(ds_config), checkpoint_interval(cfg, ds_config)
    runtime = CPU_RUNTIME_BYTES if device == "cpu" else 0
    m, tp, pp, dp = cfg.model, layout.tp, layout.pp, layout.dp
    model = meta_model(m, vocab_size)
    model_params = sum(p.numel() for p in model.parameters())
    dims = tp_split_dims(m, tp)
    full = {n: p.numel() for n, p in model.named_parameters()}
    per_rank = {n: v // (tp if split_dim(n, dims) is not None else 1) for n, v in full.items()}

    costs = layer_costs(m, cfg.data.seq_len, model.vocab.tables.num_rows)
    parts = pipeline_bounds(costs, pp)

    e = 2 if cfg.train.dtype == "bf16" else 4
    d, hd = m.d_model, m.resolved_head_dim
    act_layer = e * (4 * d + (2 * m.n_heads * hd + 2 * m.n_kv_heads * hd) / tp + 4 * m.ffn_dim / tp)
    act_engram = (
        e * ((m.engram.max_ngram - 1) * m.engram.heads * m.engram_head_dim + 8 * d)
        if m.engram
        else 0
    )
    tokens = cfg.train.micro_batch_size * cfg.data.seq_len
    decoder = decoder_bytes(m, e, tokens, model.vocab.tables.num_rows, tp)

    plans = []
    for s in range(pp):
        layers = range(parts[s], parts[s + 1])
        block_range = stage_blocks(parts, m.n_layers)[s]
        blocks = len(block_range)
        names = [
            n for n in per_rank if n.startswith(stage_prefixes(layers, m.n_layers, len(costs) - 1))
        ]
        total = sum(per_rank[n] for n in names)
        largest = max(per_rank[n] for n in names)
        states = model_state_bytes(
            zero, total, max(per_rank.values()), dp, cfg.train.dtype, fp32_accumulation(ds_config)
        )
        buffers = engine_buffer_bytes(ds_config, total, largest, e, device)
        host = construction_bytes(total / dp if zero == 3 else total, max(full[n] for n in names))
        in_flight = min(pp - s, layout.accum)
        memories = sum(1 for i in layers if i - 1 in m.engram_layers)
        last = decoder if len(costs) - 1 in layers else 0
        kept = in_flight * tokens * (act_layer * blocks + act_engram * memories) + last
        # one block's full set, memory included
        recompute = act_layer + (act_engram if memories else 0)
        ckpt = in_flight * tokens * e * d * blocks + tokens * recompute * min(blocks, 1) + last
        peak = states + (ckpt if checkpointed else kept) + buffers + runtime
        plans.append(
            StagePlan(
                stage=s,
                blocks=blocks,
                params_per_rank=int(total),
                model_states_gb=states / GB,
                activations_gb=kept / GB,
                activations_checkpointed_gb=ckpt / GB,
                fits=peak / GB <= HEADROOM * profile.device_memory_gb,
                decoder_gb=last / GB,
                buffers_gb=buffers / GB,
                runtime_gb=runtime / GB,
                step_peak_gb=peak / GB,
                construction_gb=host / GB,
                model_params=model_params,
                first_block=block_range.start,
            )
        )
    return plans


def running_plan(
    cfg: RunConfig, *, world: int, device: str, vocab_size: int, stage: int
) -> StagePlan:
    """The plan of pipeline stage ``stage`` of a running job of ``world`` ranks on ``device`` (cuda or cpu) with
    ``vocab_size`` tokens: what a step out of memory is set against (``mhf_dist.train.oom``)."""
    profile = ClusterProfile(
        name="running job",
        gpus_per_node=world,
        cores_per_node=world,
        device_memory_gb=1.0,  # only a plan's "fits" reads it
        backend="gloo" if device == "cpu" else "nccl",
    )
    return memory_plan(cfg.model_copy(deep=True), profile, 1, vocab_size)[stage]


def stage_prefixes(layers: range, n_layers: int, last: int) -> tuple[str, ...]:
    """Name prefixes of the parameters that pipeline layers ``layers`` hold (0: vocabulary in — tables and
    encoder, 1..L: blocks, L+1: final norm, ``last``: vocabulary out — tables and decoder)."""
    prefixes = [f"backbone.layers.{i - 1}." for i in layers if 1 <= i <= n_layers]
    prefixes += ["backbone.norm."] if n_layers + 1 in layers else []
    prefixes += ["vocab.tables.", "vocab.encoder."] if 0 in layers else []
    prefixes += ["vocab.tables.", "vocab.decoder."] if last in layers else []
    return tuple(prefixes)


def count(n: float) -> str:
    """``n`` with a B (billions) or M (millions) suffix."""
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,.0f}"


def describe_model(cfg: RunConfig, params: int) -> str:
    """The resolved model in one line: layers, width, heads, FFN, vocabulary side, parameters and its origin."""
    m = cfg.model
    vocab = variant(m).describe(m)
    head_dim = f" of {m.head_dim}" if m.head_dim else ""
    engram = f", Engram memory on layers {m.engram_layers}" if m.engram else ""
    return (
        f"model: {m.n_layers} layers, d={m.d_model}, {m.n_heads}/{m.n_kv_heads} heads{head_dim}, "
        f"ffn {m.ffn_dim}, {vocab}{engram}, {count(params)} parameters ({origin(cfg)})"
    )


def origin(cfg: RunConfig) -> str:
    """``preset NAME``, with ``with overrides`` when the model differs from the preset's."""
    if not cfg.preset:
        return "no preset"
    same = ModelConfig.model_validate(preset(cfg.preset)["model"]) == cfg.model
    return f"preset {cfg.preset}" + ("" if same else " with overrides")


def format_time(seconds: float) -> str:
    """Seconds, hours or days, whichever reads best."""
    if seconds < 3600:
        return f"{seconds:.3g} s"
    return f"{seconds / 3600:.1f} hours" if seconds < 2 * 86400 else f"{seconds / 86400:.1f} days"


def format_estimate(
    cfg: RunConfig, profile: ClusterProfile, world: int, est: StepEstimate | None
) -> list[str]:
    """The time-per-step lines (or why there is none)."""
    if est is None:
        return [
            f"time per step: not estimated (profile {profile.name} gives no nominal peak_bf16_tflops)"
        ]
    steps = cfg.train.max_steps
    recompute = (
        f"; activation checkpointing recomputes {est.recompute_per_token / (est.flops_per_token / 3):.2f}× "
        f"forward more (HFU ≈ {est.hfu:.2f})"
        if est.recompute_per_token
        else ""
    )
    return [
        f"time per step: {est.seconds:.3g} s, {est.tokens_per_s:,.0f} tokens/s for the job; "
        f"train.max_steps={steps:,}: {format_time(steps * est.seconds)}",
        f"  assuming MFU {est.mfu:.2f} (--mfu) of {world} × {profile.peak_bf16_tflops:g} TFLOP/s (bf16 peak); "
        f"{est.tokens_per_step:,} tokens × {est.flops_per_token:.3g} FLOPs (3 × forward) per step{recompute}",
    ]


def format_save(profile: ClusterProfile, est: SaveEstimate) -> list[str]:
    """The checkpoint lines: size, time to write, and the grace period ``submit`` asks SLURM for."""
    defaults = [
        key
        for key in ("storage_gb_per_s", "upload_gb_per_s")
        if key not in profile.model_fields_set
        and (key == "storage_gb_per_s" or est.upload_gb_per_s is not None)
    ]
    default = (
        f"; {' and '.join(f'the default {key}' for key in defaults)}: set your storage's in a site profile"
        if defaults
        else ""
    )
    step = "" if est.step_seconds is None else f"a step of {format_time(est.step_seconds)} and "
    return [
        f"checkpoints: {est.bytes / 1e9:.3g} GB each, saved in about {format_time(est.seconds)}, written at "
        f"{est.rates}{default}; a save on SLURM's warning signal needs {step}the save: "
        f"submit asks for the signal {est.grace} s before the time limit (--grace)"
    ]


def format_plan(
    cfg: RunConfig,
    profile: ClusterProfile,
    nodes: int,
    plans: list[StagePlan],
    mfu: float = DEFAULT_MFU,
    vocab_size: int = PLANNING_VOCAB_SIZE,
) -> str:
    """The printed plan: model, layout, one row per stage, host memory, time per step and the verdicts."""
    world = nodes * profile.gpus_per_node
    layout = resolve_layout(cfg, world)
    ds_config = engine_config(cfg, layout, device_of(profile))
    zero = zero_stage(ds_config)
    host_rank, host_advice = max(p.construction_gb for p in plans), ""
    host_node = host_bytes_per_node(host_rank, profile.gpus_per_node)
    node_memory = f"{profile.memory_gb_per_node:g} GB" if profile.memory_gb_per_node else "unknown"
    lines = [
        describe_model(cfg, plans[0].model_params),
        f"on {nodes} × {profile.name} ({world} ranks, {profile.device_memory_gb:g} GB each, {node_memory} host "
        f"memory per node): tp={layout.tp} pp={layout.pp} dp={layout.dp}, ZeRO-{zero}, {cfg.train.dtype}, "
        f"micro-batch {cfg.train.micro_batch_size} × {cfg.data.seq_len} tokens, {layout.accum} micro-batches per step",
        f"{'stage':>5} {'blocks':>6} {'params/rank':>12} {'model states':>13} {'activations':>12} "
        f"{'act. ckpt':>10} {'decoder':>8} {'buffers':>8} {'step peak':>10} {'host/rank':>10} {'fits':>5}",
    ]
    for p in plans:
        decoder = f"{p.decoder_gb:>6.1f}GB" if p.decoder_gb else f"{'-':>8}"
        lines.append(
            f"{p.stage:>5} {p.blocks:>6} {p.params_per_rank / 1e6:>11.1f}M {p.model_states_gb:>11.1f}GB "
            f"{p.activations_gb:>10.1f}GB {p.activations_checkpointed_gb:>8.1f}GB {decoder} "
            f"{p.buffers_gb:>6.1f}GB {p.step_peak_gb:>8.1f}GB {p.construction_gb:>8.1f}GB "
            f"{'yes' if p.fits else 'NO':>5}"
        )
    lines.append(
        f"host memory at construction: up to {host_rank:.1f} GB per rank (its share in fp32 plus the "
        f"largest parameter drawn whole; the whole model would be {4 * plans[0].model_params / GB:.1f} GB); "
        f"{profile.gpus_per_node} ranks per node need {host_node:.1f} GB of {node_memory}"
    )
    engram = cfg.model.engram
    if engram is not None and engram.offload:
        stages = [p.block_range for p in plans]
        tables = run_host_table_memory(
            cfg,
            sharing_ranks(cfg.model, world, profile.gpus_per_node, layout.pp),
            layout.accum,
            stages,
        )
        held = (
            "whole on every rank" if tables.ranks == 1 else f"rows split over {tables.ranks} ranks"
        )
        if layout.pp > 1:
            held += " of each stage; the stage holding the most"
        lines.append(
            f"host tables (model.engram.offload={str(engram.offload).lower()}, {held}): "
            f"{tables.total / GB:.2f} GB per rank "
            f"({tables.tables / GB:.2f} GB of weights, Adam moments and gradients, {tables.buffers / GB:.2f} "
            f"GB of exchange buffers); {profile.gpus_per_node} ranks per node need "
            f"{host_bytes_per_node(tables.total, profile.gpus_per_node) / GB:.1f} GB"
        )
        host_rank += tables.total / GB
        if tables.ranks < world // layout.pp:
            sharded = run_host_table_memory(cfg, world // layout.pp, layout.accum, stages)
            host_advice = f"; with model.engram.offload=sharded the tables take {sharded.total / GB:.2f} GB per rank"
    lines += format_estimate(
        cfg, profile, world, step_estimate(cfg, profile, nodes, mfu, vocab_size)
    )
    lines += format_save(profile, save_estimate(cfg, profile, nodes, vocab_size))
    device = "fits" if all(p.fits for p in plans) else "does not fit"
    advice = "" if device == "fits" else ": raise tp/pp, lower the micro-batch, or add nodes"
    checkpointed = "checkpointed " if checkpoint_interval(cfg, ds_config) else ""
    runtime = " + runtime" if plans[0].runtime_gb else ""
    lines.append(
        f"device memory: the run {device} (step peak: model states + {checkpointed}activations + DeepSpeed's "
        f"buffers{runtime}; limit: {HEADROOM:.0%} of device memory){advice}"
    )
    host = host_fits(profile, host_rank * GB)
    lines.append(
        "host memory: "
        + (
            "unknown (the profile does not set memory_gb_per_node)"
            if host is None
            else f"fits (limit: {HEADROOM:.0%} of node memory)"
            if host
            else f"does not fit (limit: {HEADROOM:.0%} of node memory) while the ranks build the "
            "model and hold the host tables; use nodes with more memory, fewer ranks per node, or more ranks to "
            "share it (dp under ZeRO-3, tp, pp)" + host_advice
        )
    )
    return "\n".join(lines)
