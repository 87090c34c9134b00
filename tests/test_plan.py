"""`mhf-dist plan`: parameters, ZeRO model states and activations per rank, on the meta device."""

from __future__ import annotations

import pytest

from mhf_dist.cli import main
from mhf_dist.cluster import load_profile
from mhf_dist.config import ConfigError, load_config
from mhf_dist.plan import GB, memory_plan


def test_3b_zero3_model_states_follow_deepspeed_estimator():
    cfg, profile = load_config("3b-h4b16k"), load_profile("a100-80g")
    (plan,) = memory_plan(cfg, profile, nodes=1)
    tables = 4 * 16384 * 2048  # the largest parameter, gathered whole under ZeRO-3
    assert plan.params_per_rank == pytest.approx(2.914e9, rel=0.01)
    # DeepSpeed's ZeRO-3 estimate: 18 bytes/param over 8 data-parallel ranks + 4 bytes x largest layer
    assert plan.model_states_gb == pytest.approx((18 * plan.params_per_rank / 8 + 4 * tables) / GB, rel=1e-6)
    assert plan.activations_checkpointed_gb < plan.activations_gb and plan.fits


def test_pipeline_stages_split_the_parameters():
    cfg = load_config("3b-h4b16k", overrides=["parallel.tp=2", "parallel.pp=2"])
    plans = memory_plan(cfg, load_profile("mi300x"), nodes=2)
    assert [p.stage for p in plans] == [0, 1] and sum(p.blocks for p in plans) == 36
    # the last stage carries the decoder's (2H-1)·B·d work, so it gets fewer blocks
    assert plans[1].blocks < plans[0].blocks


def test_plan_counts_the_fused_decoder_and_engram_activations():
    profile = load_profile("a100-80g")

    def plan(preset: str, *overrides: str):
        (p,) = memory_plan(load_config(preset, overrides=list(overrides)), profile, nodes=1)
        return p

    fused, plain = plan("1b-h4b16k"), plan("1b-h4b16k", "model.decoder_chunk_tokens=0")
    tokens, heads, rows, d = 4 * 2048, 4, 16384, 2048  # micro-batch 4 x 2048, bf16 (2 bytes) + fp32 (4)
    fused_decoder = tokens * heads * (2 * 2 * d + 8) + 2 * 8192 * rows * (2 + 4)
    assert (plain.activations_gb - fused.activations_gb) * GB == pytest.approx(
        tokens * heads * rows * (2 + 4) - fused_decoder)
    # two memories: (N-1)·K·head_dim = d for the sigmoid gate's default head_dim, plus 8d, in bf16
    engram = plan("1b-h4b16k+engram")
    assert (engram.activations_gb - fused.activations_gb) * GB == pytest.approx(2 * tokens * 2 * (d + 8 * d))


def test_plan_cli_prints_fit(capsys):
    assert main(["plan", "--preset", "3b-h4b16k", "--cluster", "a100-80g", "--nodes", "2"]) == 0
    out = capsys.readouterr().out
    assert "ZeRO-3" in out and "16 ranks" in out and "fits" in out


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

    best = min(slowest([0, *cut, len(costs)]) for cut in itertools.combinations(range(1, len(costs)), stages - 1))
    assert slowest(bounds) == best
