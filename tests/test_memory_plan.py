"""`mhf-dist plan`: parameters, ZeRO model states and activations per rank, on the meta device."""

from __future__ import annotations

import pytest

from mhf_dist.backend.deepspeed.memory import ZERO_DEFAULTS, zero_setting
from mhf_dist.cli import main
from mhf_dist.cluster.job_estimates import save_estimate, step_estimate, step_seconds
from mhf_dist.cluster.profile import load_profile
from mhf_dist.commands.plan import (
    CPU_RUNTIME_BYTES,
    GB,
    construction_bytes,
    format_plan,
    memory_plan,
    meta_model,
)
from mhf_dist.config import ConfigError, load_config, preset_names
from mhf_dist.model.flops import forward_flops
from mhf_dist.model.host_tables import HostTables
from mhf_dist.model.parameter_count import parameter_count
from mhf_dist.parallel.stages import layer_costs

# Llama-2-70B's backbone shape over the 3b preset: 69.1B parameters
LARGE = [
    "model.n_layers=80",
    "model.d_model=8192",
    "model.n_heads=64",
    "model.n_kv_heads=8",
    "model.ffn_dim=28672",
]


def test_3b_zero3_model_states_follow_deepspeed_estimator():
    cfg, profile = load_config("3b-h4b16k"), load_profile("a100-80g")
    (plan,) = memory_plan(cfg, profile, nodes=1)
    tables = 4 * 16384 * 2048  # the largest parameter, gathered whole under ZeRO-3
    assert plan.params_per_rank == pytest.approx(2.914e9, rel=0.01)
    # DeepSpeed's ZeRO-3 estimate: 18 bytes/param over 8 data-parallel ranks + 4 bytes x largest layer, and 2 more
    # per partitioned parameter for the gradient partition accumulated in fp32 (the bf16 config's grad_accum_dtype)
    assert plan.model_states_gb == pytest.approx(
        (20 * plan.params_per_rank / 8 + 4 * tables) / GB, rel=1e-6
    )
    assert plan.activations_checkpointed_gb < plan.activations_gb and plan.fits
    # DeepSpeed's own estimate again
    bf16_sums = load_config("3b-h4b16k", overrides=[ZERO_ACCUM + "=bf16"])
    (estimate,) = memory_plan(bf16_sums, profile, nodes=1)
    assert estimate.model_states_gb == pytest.approx(
        (18 * plan.params_per_rank / 8 + 4 * tables) / GB, rel=1e-6
    )


def test_pipeline_stages_split_the_parameters():
    cfg = load_config("3b-h4b16k", overrides=["parallel.tp=2", "parallel.pp=2"])
    plans = memory_plan(cfg, load_profile("mi300x"), nodes=2)
    assert [p.stage for p in plans] == [0, 1] and sum(p.blocks for p in plans) == 36
    # the last stage carries the decoder's (2H-1)·B·d work, so it gets fewer blocks
    assert plans[1].blocks < plans[0].blocks
    # the decoder's buffers live on the last stage
    assert plans[0].decoder_gb == 0 and plans[1].decoder_gb > 0


def test_plan_counts_the_fused_decoder_and_engram_activations():
    profile = load_profile("a100-80g")

    def plan(preset: str, *overrides: str):
        (p,) = memory_plan(load_config(preset, overrides=list(overrides)), profile, nodes=1)
        return p

    fused, plain = plan("1b-h4b16k"), plan("1b-h4b16k", "model.decoder_chunk_tokens=0")
    tokens, heads, rows, d = (
        4 * 2048,
        4,
        16384,
        2048,
    )  # micro-batch 4 x 2048, bf16 (2 bytes) + fp32 (4)
    # ... and one head's table gradient summed over the chunks in fp32, with a chunk's part in bf16
    fused_decoder = (
        tokens * heads * (2 * 2 * d + 8) + 2 * 8192 * rows * (2 + 4) + rows * d * (4 + 2)
    )
    assert (plain.activations_gb - fused.activations_gb) * GB == pytest.approx(
        tokens * heads * rows * (2 + 4) - fused_decoder
    )
    assert fused.decoder_gb * GB == pytest.approx(fused_decoder)
    assert plain.decoder_gb * GB == pytest.approx(tokens * heads * rows * (2 + 4))
    # two memories: (N-1)·K·head_dim = d for the sigmoid gate's default head_dim, plus 8d, in bf16
    engram = plan("1b-h4b16k+engram")
    assert (engram.activations_gb - fused.activations_gb) * GB == pytest.approx(
        2 * tokens * 2 * (d + 8 * d)
    )


ZERO = "parallel.deepspeed.zero_optimization."
ZERO_ACCUM = "parallel.deepspeed.data_types.grad_accum_dtype"


def test_zero3_buffers_follow_the_deepspeed_config():
    """ZeRO-3 (bf16, 2 bytes): the reduce bucket (in fp32, the bf16 config's communication_data_type), the
    prefetched parameters (capped by max_live_parameters), the largest parameter gathered once more and its whole
    gradient, with the sizes the engine's config gives."""
    profile = load_profile("a100-80g")

    def plan(*overrides: str):
        (p,) = memory_plan(load_config("1b-h4b16k", overrides=list(overrides)), profile, nodes=1)
        return p

    tables = 4 * 16384 * 2048  # the largest parameter
    base = plan()  # zero3_bf16_actckpt: reduce and prefetch buckets of 5e7 elements
    assert base.buffers_gb * GB == 4 * 5e7 + 2 * (5e7 + tables) + 2 * tables
    assert (
        plan(ZERO + "reduce_bucket_size=200000000").buffers_gb - base.buffers_gb
    ) * GB == 4 * 1.5e8
    assert (
        base.buffers_gb - plan("parallel.deepspeed.communication_data_type=bf16").buffers_gb
    ) * GB == 2 * 5e7
    assert (
        plan(ZERO + "stage3_prefetch_bucket_size=80000000").buffers_gb - base.buffers_gb
    ) * GB == 2 * 3e7
    assert (
        base.buffers_gb - plan(ZERO + "stage3_max_live_parameters=10000000").buffers_gb
    ) * GB == 2 * 4e7
    assert (base.buffers_gb - plan(ZERO + "contiguous_gradients=false").buffers_gb) * GB == 4 * 5e7
    # a section without the sizes gets DeepSpeed's defaults: reduce bucket 5e8, prefetch 5e7
    default = plan("parallel.deepspeed_config=cpu_fp32", "train.dtype=bf16")
    assert default.buffers_gb * GB == 4 * 5e8 + 2 * (5e7 + tables) + 2 * tables
    assert base.step_peak_gb == pytest.approx(
        base.model_states_gb + base.activations_checkpointed_gb + base.buffers_gb
    )  # no runtime on a GPU
    assert base.runtime_gb == 0


def test_zero_defaults_are_deepspeeds():
    """The defaults the plan assumes for keys a config leaves out are those the engine's DeepSpeed fills in."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    resolved = DeepSpeedZeroConfig().model_dump(by_alias=True)
    assert {key: resolved[key] for key in ZERO_DEFAULTS} == ZERO_DEFAULTS
    for stage in (1, 2, 3):
        assert (
            zero_setting({"zero_optimization": {"stage": stage}}, "overlap_comm")
            == DeepSpeedZeroConfig(stage=stage).overlap_comm
        )


def test_zero1_buckets_double_with_overlap_comm():
    """ZeRO-1's optimizer accumulates in fp32 gradient buckets of reduce_bucket_size elements, two with overlap_comm;
    in bf16 with fp32 accumulation (the bf16 config) DeepSpeed runs its bf16 optimizer instead, without buckets, and
    keeps whole fp32 gradients."""
    profile = load_profile("a100-80g")

    def stage(*overrides: str):
        cfg = load_config("1b-h4b16k", overrides=["parallel.pp=2", *overrides])
        return memory_plan(cfg, profile, nodes=1)[0]

    tables = 4 * 16384 * 2048
    zero_optimizer = [ZERO_ACCUM + "=bf16", "parallel.deepspeed.communication_data_type=bf16"]
    # zero1_pp_bf16: overlap_comm, buckets of 5e7; the tables' gradient in bf16
    assert stage(*zero_optimizer).buffers_gb * GB == 2 * 4 * 5e7 + 2 * tables
    assert (
        stage(*zero_optimizer, ZERO + "overlap_comm=false").buffers_gb * GB == 4 * 5e7 + 2 * tables
    )
    bf16_optimizer, old = stage(), stage(*zero_optimizer)
    assert bf16_optimizer.buffers_gb * GB == 2 * tables  # all-reduced in place, in fp32
    assert (
        stage("parallel.deepspeed.communication_data_type=bf16").buffers_gb * GB
        == 2 * bf16_optimizer.params_per_rank + 2 * tables
    )  # through a bf16 copy
    p, dp = bf16_optimizer.params_per_rank, 8 // 2
    assert bf16_optimizer.model_states_gb * GB == pytest.approx(6 * p + 12 * p / dp)
    assert old.model_states_gb * GB == pytest.approx(2 * p + 18 * p / dp + 2 * p * (1 - 1 / dp))


def test_cpu_plan_counts_resident_buffers_and_the_runtime():
    """In host memory a buffer is resident only where written, at most the rank's parameters; the runtime counts."""
    # cpu_fp32: DeepSpeed's 5e8 bucket
    cfg = load_config("tiny-h4b16k", overrides=["data.path=embedded"])
    profile = load_profile("cpu-local").model_copy(update={"gpus_per_node": 1})
    (p,) = memory_plan(cfg, profile, nodes=1)
    params = sum(q.numel() for q in meta_model(cfg.model, 32768).parameters())
    tables = 4 * 16384 * 64
    assert p.params_per_rank == params
    assert p.buffers_gb * GB == 4 * params + 4 * (params + tables) + 4 * tables
    assert p.runtime_gb * GB == CPU_RUNTIME_BYTES
    assert p.step_peak_gb == pytest.approx(
        p.model_states_gb + p.activations_gb + p.buffers_gb + p.runtime_gb
    )
    grown = load_config(
        "tiny-h4b16k", overrides=["data.path=embedded", ZERO + "reduce_bucket_size=1000"]
    )
    assert (p.buffers_gb - memory_plan(grown, profile, nodes=1)[0].buffers_gb) * GB == 4 * (
        params - 1000
    )


def test_plan_cli_prints_fit(capsys):
    assert main(["plan", "--preset", "3b-h4b16k", "--cluster", "a100-80g", "--nodes", "2"]) == 0
    out = capsys.readouterr().out
    assert "ZeRO-3" in out and "16 ranks" in out and "fits" in out
    assert (
        "(preset 3b-h4b16k)" in out
        and "decoder" in out
        and "host/rank" in out
        and "MFU 0.40" in out
    )
    assert "buffers" in out and "step peak" in out
    assert main(["plan", "--preset", "3b-h4b16k", "--cluster", "a100-80g", "--mfu", "0.5"]) == 0
    assert "MFU 0.50" in capsys.readouterr().out
    assert main(["plan", "--preset", "3b-h4b16k", "--cluster", "a100-80g", "--mfu", "0"]) == 2
    assert "--mfu 0 is not a fraction" in capsys.readouterr().err


@pytest.mark.parametrize(
    "size, shape, low, high",
    [
        (
            "7b",
            dict(d_model=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn_dim=12288),
            6.9e9,
            7.0e9,
        ),
        (
            "13b",
            dict(d_model=5120, n_layers=40, n_heads=40, n_kv_heads=8, ffn_dim=17408),
            13.1e9,
            13.3e9,
        ),
    ],
)
def test_7b_and_13b_presets(size, shape, low, high):
    """Qwen3-8B's and Qwen3-14B's backbones (head_dim 128), the training recipe of the other real sizes."""
    names = [n for n in preset_names() if n.startswith(f"{size}-")]
    assert {f"{size}-standard", f"{size}-h4b16k", f"{size}-h3b10k+engram"} <= set(names)
    for name in names:
        load_config(name)
    cfg = load_config(f"{size}-h4b16k")
    assert {k: getattr(cfg.model, k) for k in shape} == shape and cfg.model.resolved_head_dim == 128
    assert cfg.train.dtype == "bf16" and cfg.train.max_steps == 100_000_000_000 // (256 * 2048)
    model = meta_model(cfg.model, 32768)
    backbone = sum(p.numel() for p in model.backbone.parameters())
    assert low < backbone < high
    # the vocabulary side adds the H·B·d bucket tables, W_s (d²) and a little more (gate MLP, mixers)
    d = cfg.model.d_model
    vocab = sum(p.numel() for p in model.parameters()) - backbone
    assert 4 * 16384 * d + d * d < vocab < 1.02 * (4 * 16384 * d + d * d)


def test_header_describes_the_overridden_model_and_host_memory():
    cfg, profile = load_config("3b-h4b16k", overrides=LARGE), load_profile("a100-80g")
    plans = memory_plan(cfg, profile, nodes=1)
    out = format_plan(cfg, profile, 1, plans)
    assert out.splitlines()[0] == (
        "model: 80 layers, d=8192, 64/8 heads, ffn 28672, H4×B16384, "
        f"{plans[0].model_params / 1e9:.1f}B parameters (preset 3b-h4b16k with overrides)"
    )
    assert plans[0].model_params == pytest.approx(69e9, rel=0.01)
    # each of 8 ranks keeps 1/8 of the fp32 weights plus the largest parameter: the node's memory suffices,
    # its devices do not
    assert (
        "host memory: fits" in out
        and (
            "device memory: the run does not fit (step peak: model states + "
            "checkpointed activations + DeepSpeed's buffers"
        )
        in out
    )
    tight = profile.model_copy(update={"memory_gb_per_node": 256})
    assert "host memory: does not fit" in format_plan(
        cfg, tight, 1, memory_plan(cfg, tight, nodes=1)
    )


def test_construction_keeps_a_share_plus_the_largest_parameter():
    model = meta_model(load_config("1b-h4b16k").model, 32768)
    full = {n: p.numel() for n, p in model.named_parameters()}
    tables = full["vocab.tables.weight"]
    assert tables == max(full.values())
    profile = load_profile("a100-80g")
    (zero3,) = memory_plan(load_config("1b-h4b16k"), profile, nodes=1)  # pp = 1, ZeRO-3 over dp = 8
    assert (
        zero3.construction_gb * GB
        == construction_bytes(sum(full.values()) / 8, tables)
        == 4 * sum(full.values()) / 8 + 4 * tables
    )
    # ZeRO-1
    stages = memory_plan(load_config("1b-h4b16k", overrides=["parallel.pp=2"]), profile, nodes=1)
    for stage in stages:  # each stage builds its own layers; both hold the tied tables
        assert stage.construction_gb * GB == 4 * stage.params_per_rank + 4 * tables
    assert "host memory: fits" in format_plan(load_config("1b-h4b16k"), profile, 1, [zero3])


def test_time_per_step_follows_the_formula():
    """Standard, no recompute: seconds = T · F / (MFU · n · peak) with F = 3 · forward =
    6 · (block matrices) + 12 · L · n_heads · head_dim · S + 6 · R · d (the tied head)."""
    cfg = load_config("1b-standard", overrides=["parallel.activation_checkpoint_interval=0"])
    m, profile = cfg.model, load_profile("a100-80g")
    est = step_estimate(cfg, profile, nodes=2, mfu=0.5)
    matrices = sum(
        p.numel()
        for n, p in meta_model(m, 32768).named_parameters()
        if n.startswith("backbone.layers.") and p.dim() == 2
    )
    flops = (
        6 * matrices
        + 12 * m.n_layers * m.n_heads * m.resolved_head_dim * 2048
        + 6 * 32768 * m.d_model
    )
    tokens = 256 * 2048
    assert est.flops_per_token == flops and est.recompute_per_token == 0 and est.hfu == 0.5
    assert est.seconds == pytest.approx(tokens * flops / (0.5 * 16 * 312e12))
    assert est.tokens_per_s == pytest.approx(tokens / est.seconds)
    assert step_seconds(100, 6.0, 0.5, 1200.0) == 1.0
    # activation checkpointing (every block): one more forward of the blocks, in the hardware FLOPs only
    ckpt = step_estimate(load_config("1b-standard"), profile, nodes=2, mfu=0.5)
    block = forward_flops(m, 2048, 32768).block
    assert ckpt.seconds == est.seconds and ckpt.recompute_per_token == m.n_layers * block
    assert ckpt.hfu == pytest.approx(0.5 * (flops + m.n_layers * block) / flops)
    assert step_estimate(cfg, load_profile("cpu-local"), nodes=1) is None  # no nominal peak


def test_unknown_or_invalid_profile_is_named(tmp_path):
    with pytest.raises(ConfigError, match="cluster profile 'h100' not found.*a100-80g"):
        load_profile("h100")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ngpus_per_node: 0\ndevice_memory_gb: 1\nbackend: nccl\n")
    with pytest.raises(ConfigError, match="gpus_per_node"):
        load_profile(str(bad))


@pytest.mark.parametrize("seed", range(20))
def test_stage_cut_minimises_the_slowest_stage(seed):
    """Against every possible cut of a small random pipeline: no cut has a cheaper most expensive stage."""
    import itertools
    import random

    from mhf_dist.parallel.stages import stage_bounds

    rng = random.Random(seed)
    costs = [rng.randint(1, 100) for _ in range(rng.randint(2, 9))]
    stages = rng.randint(1, len(costs))
    bounds = stage_bounds(costs, stages)
    assert bounds[0] == 0 and bounds[-1] == len(costs) and len(bounds) == stages + 1
    assert all(a < b for a, b in zip(bounds, bounds[1:]))  # every stage holds a layer

    def slowest(b):
        return max(sum(costs[x:y]) for x, y in zip(b, b[1:]))

    best = min(
        slowest([0, *cut, len(costs)])
        for cut in itertools.combinations(range(1, len(costs)), stages - 1)
    )
    assert slowest(bounds) == best


@pytest.mark.parametrize("seed", range(10))
def test_pipeline_cut_keeps_the_final_norm_on_the_last_stage(seed):
    """The pipeline's cut (layers: vocabulary in, blocks, final norm, vocabulary out) leaves the last stage the final
    norm beside the vocabulary (whose weights DeepSpeed counts on the first stage only), and no such cut has a cheaper
    most expensive stage."""
    import itertools
    import random

    from mhf_dist.parallel.stages import pipeline_bounds, stage_bounds

    rng = random.Random(seed)
    costs = [rng.randint(1, 100) for _ in range(rng.randint(2, 7))] + [1, rng.randint(100, 400)]
    n, stages = len(costs), rng.randint(2, len(costs) - 1)
    bounds = pipeline_bounds(costs, stages)
    assert bounds[0] == 0 and bounds[-1] == n and len(bounds) == stages + 1
    assert all(a < b for a, b in zip(bounds, bounds[1:])) and bounds[-2] <= n - 2

    def slowest(b):
        return max(sum(costs[x:y]) for x, y in zip(b, b[1:]))

    assert slowest(bounds) == min(
        slowest([0, *cut, n]) for cut in itertools.combinations(range(1, n - 1), stages - 1)
    )
    tiny = load_config("tiny-h4b16k", overrides=["model.hash.num_buckets=256"]).model
    # the free cut gives the vocabulary out a stage of its own
    tiny_costs = layer_costs(tiny, 64, 256)
    assert (
        stage_bounds(tiny_costs, 2)[-2] == len(tiny_costs) - 1
        and pipeline_bounds(tiny_costs, 2)[-2] == 3
    )


@pytest.mark.parametrize(
    "name, overrides",
    [
        ("tiny-h4b16k", []),
        ("tiny-standard", []),
        ("tiny-h1b16k", ["model.head_dim=32"]),
        ("100m-h3b10k", []),
        ("tiny-h4b16k+engram", []),
        ("tiny-h4b16k+engram", ["model.engram.gate=softmax"]),
        ("tiny-h4b16k+engram", ["model.engram.offload=true"]),
        ("1b-standard+2l", []),
    ],
)
def test_parameter_count_from_the_config_is_the_built_models(name, overrides):
    cfg = load_config(name, overrides=overrides).model
    count = parameter_count(cfg, 30000)
    model = meta_model(cfg, 30000)
    assert count.trained_by_engine == sum(p.numel() for p in model.parameters())
    assert count.vocab_tables == model.vocab.tables.weight.numel()
    host = [m.weight.numel() for m in model.modules() if isinstance(m, HostTables)]
    assert count.host_tables == sum(host) and (count.host_tables > 0) == bool(
        cfg.engram and cfg.engram.offload
    )


def test_plan_prints_the_checkpoint_size_and_the_grace_submit_asks_for(capsys):
    cfg, profile = load_config("13b-h4b16k"), load_profile("a100-80g")
    assert main(["plan", "--preset", "13b-h4b16k", "--cluster", "a100-80g", "--nodes", "16"]) == 0
    out = capsys.readouterr().out
    params = sum(p.numel() for p in meta_model(cfg.model, 32768).parameters())
    est = save_estimate(cfg, profile, 16)
    assert est.bytes == 12 * params  # ZeRO-3 saves the fp32 master weights and two moments
    assert (
        f"checkpoints: {12 * params / 1e9:.3g} GB each" in out
        and "the default storage_gb_per_s" in out
    )
    assert f"submit asks for the signal {est.grace} s before the time limit" in out
    # the layer files' bf16 weights, the tied tables
    piped = load_config("13b-h4b16k", overrides=["parallel.pp=4"])
    tables = meta_model(cfg.model, 32768).vocab.tables.weight.numel()
    assert save_estimate(piped, profile, 16).bytes == 14 * (params + tables)
