"""optimizer.groups: learning-rate scales and weight decay per parameter family, on one process and under ZeRO-3
and the pipeline engine."""

from __future__ import annotations

import pytest
import torch

from helpers.runs import run_cli, train_args
from mhf_dist.backend import consolidate
from mhf_dist.config import ConfigError, OptimizerConfig, ParamGroupRule, load_config
from mhf_dist.model import build_model
from mhf_dist.model.families import FAMILIES, families
from mhf_dist.train.optim import build_optimizer, check_resumed_groups, describe_groups
from mhf_dist.vocab.engram_compression import CompressionTable

V = 500


def tiny_model(preset: str):
    cfg = load_config(preset).model
    codes = (
        torch.randint(1, cfg.hash.num_buckets, (V, cfg.hash.num_hashes))
        if cfg.variant == "mhf"
        else None
    )
    return build_model(cfg, V, codes, CompressionTable.identity(V))


@pytest.mark.parametrize("preset", ["tiny-h4b16k", "tiny-standard", "tiny-h4b16k+engram"])
def test_every_parameter_has_one_family_and_the_default_groups_are_the_two_by_dimension(preset):
    model = tiny_model(preset)
    for name, _ in model.named_parameters():
        assert len(families(name) - {"norms"}) == 1, name
    optimizer, _ = build_optimizer(model.named_parameters(), OptimizerConfig(), max_steps=10)
    matrices, rest = optimizer.param_groups
    params = list(model.parameters())
    assert [id(p) for p in matrices["params"]] == [id(p) for p in params if p.dim() >= 2]
    assert [id(p) for p in rest["params"]] == [id(p) for p in params if p.dim() < 2]
    assert (matrices["weight_decay"], rest["weight_decay"]) == (0.1, 0.0) and matrices[
        "lr"
    ] == rest["lr"]


def test_rules_apply_in_order_to_their_families():
    model = tiny_model("tiny-h4b16k+engram")
    cfg = OptimizerConfig(
        lr=1e-3,
        groups=[
            ParamGroupRule(match="tables", lr_scale=0.0),
            ParamGroupRule(match="engram", lr_scale=0.5, weight_decay=0.0),
            ParamGroupRule(match="norms", weight_decay=0.01),
        ],
    )
    optimizer, scheduler = build_optimizer(model.named_parameters(), cfg, max_steps=10)
    by_param = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    want = {
        "vocab.tables.weight": (0.0, 0.1),
        "backbone.layers.1.engram.tables.weight": (5e-4, 0.0),
        "backbone.layers.1.engram.gate.key_norm.weight": (5e-4, 0.01),  # engram, then norms
        "backbone.layers.0.input_layernorm.weight": (1e-3, 0.01),
        "backbone.layers.0.mlp.up_proj.weight": (1e-3, 0.1),
        "vocab.decoder.cascade_mixer.0.0.bias": (1e-3, 0.0),
    }
    named = dict(model.named_parameters())
    for name, (lr, decay) in want.items():
        group = by_param[id(named[name])]
        assert (group["lr"], group["weight_decay"]) == pytest.approx(
            (lr * scheduler.lr_lambdas[0](0), decay)
        ), name
    line = describe_groups(model.named_parameters(), cfg)
    assert (
        line.startswith("optimizer groups: matrices and tables ")
        and "; tables (matrices) 4.19M (lr x0" in line
    )


def test_a_family_without_parameters_and_changed_rules_on_resume_are_refused():
    cfg = OptimizerConfig(groups=[ParamGroupRule(match="engram", lr_scale=0.5)])
    with pytest.raises(
        ConfigError,
        match=r"optimizer.groups\[0\].match=engram matches no trainable parameter of "
        r"this model; its families: tables, gate, decoder, backbone, norms",
    ):
        describe_groups(tiny_model("tiny-h4b16k").named_parameters(), cfg)
    saved = OptimizerConfig(groups=[ParamGroupRule(match="engram", lr_scale=1.0)]).model_dump(
        mode="json"
    )
    check_resumed_groups(saved, cfg)  # the same rules, another value: allowed
    with pytest.raises(ConfigError, match=r"matches \[\] in the checkpoint and \[engram\] now"):
        check_resumed_groups(OptimizerConfig().model_dump(mode="json"), cfg)
    assert set(FAMILIES) == {"tables", "engram", "gate", "decoder", "backbone", "norms"}


@pytest.mark.multirank
@pytest.mark.parametrize(
    "overrides, pipeline",
    [([], False), (["parallel.pp=2", "parallel.zero_stage=1"], True)],
    ids=["zero3-dp2", "pp2"],
)
def test_a_zero_lr_scale_leaves_the_tables_unchanged_while_the_backbone_trains(
    tmp_path, data, overrides, pipeline
):
    run = tmp_path / "run"
    rule = 'optimizer.groups=[{"match": "tables", "lr_scale": 0}]'
    out = run_cli(
        train_args(run, data, 2, *overrides, rule, "train.checkpoint_interval=2", steps=4)
    )
    assert "optimizer groups: matrices and tables" in out and "tables (matrices)" in out, out
    before, after = (
        consolidate(run / "checkpoints" / f"step-0000000{s}", pipeline) for s in (2, 4)
    )
    assert torch.equal(before["vocab.tables.weight"], after["vocab.tables.weight"])
    for name in ("backbone.layers.0.mlp.up_proj.weight", "vocab.decoder.cascade_mixer.0.0.weight"):
        assert not torch.equal(before[name], after[name]), name
    if pipeline:
        return
    # a resume may change the rules' values (said once), not the rules
    resumed = run_cli(
        train_args(
            run,
            data,
            2,
            *overrides,
            'optimizer.groups=[{"match": "tables", "lr_scale": 1}]',
            "train.checkpoint_interval=2",
            steps=6,
        )
    )
    assert "changed on resume, from step 5: optimizer.groups:" in resumed
    grown = consolidate(run / "checkpoints" / "step-00000006", pipeline)
    assert not torch.equal(after["vocab.tables.weight"], grown["vocab.tables.weight"])
    refused = run_cli(
        train_args(
            run,
            data,
            2,
            *overrides,
            'optimizer.groups=[{"match": "norms", "lr_scale": 1}]',
            steps=8,
        ),
        expect_rc=2,
    )
    assert "optimizer.groups matches [tables] in the checkpoint and [norms] now" in refused
