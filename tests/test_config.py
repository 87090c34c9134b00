"""Configs: presets (docs/spec.md §6 parameter counts on the meta device), overrides, named errors."""

from __future__ import annotations

import pytest
import torch

from mhf_dist.config import ConfigError, load_config, preset, preset_names
from mhf_dist.model import build_model
from mhf_dist.vocab.engram_compression import CompressionTable

MISTRAL_V = 32768


def counts(name: str) -> dict[str, int]:
    cfg = load_config(name).model
    compression = CompressionTable.identity(MISTRAL_V)  # +engram presets
    with torch.device("meta"):
        codes = torch.ones(MISTRAL_V, cfg.hash.num_hashes, dtype=torch.long)
        return build_model(cfg, MISTRAL_V, codes, compression).parameter_counts()


def within(value: float, target: float, rel: float = 0.05) -> bool:
    return abs(value - target) <= rel * target


def test_every_preset_builds_on_meta():
    for name in preset_names() + [
        "tiny-h4b8k",
        "100m-standard+4l",
        "tiny-standard+1l",
        "tiny-h4b8k+engram",
    ]:
        assert counts(name)["total"] > 0


@pytest.mark.parametrize("size", ["1b", "3b"])
def test_embedding_parameter_counts_match_spec(size):
    # docs/spec.md §6: H4B16K embedding ≈ 138M at d=2048, Standard ≈ 65M (65–67M).
    assert within(counts(f"{size}-h4b16k")["embedding"], 138e6)
    assert within(counts(f"{size}-standard")["embedding"], 66e6)


def test_backbone_parameter_counts_match_spec():
    # docs/spec.md §6 table. 1B (d=2048, 20 layers, 16/8 heads, FFN 6144) counts 1.007B non-embedding
    # parameters by hand: 20 x (2048·(2048+1024+1024+2048) + 3·2048·6144) plus norms.
    assert within(counts("1b-h4b16k")["backbone"], 1.0e9)
    assert within(counts("3b-h4b16k")["backbone"], 2.8e9)
    assert within(counts("100m-standard")["backbone"], 87e6)
    # Standard+kL adds k backbone layers
    per_layer = (counts("100m-standard+4l")["backbone"] - counts("100m-standard")["backbone"]) / 4
    assert per_layer == 768 * (768 + 128 + 128 + 768) + 3 * 768 * 2560 + 2 * 768 + 2 * 64


def test_preset_variants_parse():
    assert preset("3b-h3b10k")["model"]["hash"] == {"num_hashes": 3, "num_buckets": 10624}
    assert preset("tiny-h4b8k")["model"]["hash"] == {"num_hashes": 4, "num_buckets": 8192}
    assert preset("1b-h1b16k")["model"]["hash"] == {
        "num_hashes": 4,
        "num_buckets": 16384,
        "single_id": True,
    }
    assert preset("100m-standard+4l")["model"]["n_layers"] == 16
    assert load_config("100m-h4b16k").train.global_batch_size == 256
    # real runs save every half hour besides their step interval; tiny runs only by steps
    assert load_config("1b-h4b16k").train.checkpoint_minutes == 30
    assert load_config("tiny-h4b16k").train.checkpoint_minutes is None
    with pytest.raises(ConfigError, match="unknown preset 'huge-h4b16k'"):
        load_config("huge-h4b16k")


def test_overrides_reach_every_field(tmp_path):
    cfg = load_config(
        "tiny-h4b16k",
        overrides=[
            "model.hash.num_buckets=4096",
            "parallel.tp=2",
            "optimizer.betas=[0.9, 0.99]",
            "data.path=/x/y",
        ],
    )
    assert cfg.model.hash.num_buckets == 4096 and cfg.parallel.tp == 2
    assert cfg.optimizer.betas == (0.9, 0.99) and cfg.data.path == "/x/y"
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("preset: tiny-standard\ntrain:\n  max_steps: 7\n")
    cfg = load_config(path=yaml_file, overrides=["train.max_steps=9"])
    assert cfg.model.variant == "standard" and cfg.train.max_steps == 9


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["model.hash.num_buckets=1000", "parallel.tp=3"],
            r"model.hash.num_buckets=1000 is not divisible by parallel.tp=3",
        ),
        (
            ["model.d_model=66"],
            r"model.d_model=66 is not divisible by model.n_heads=4.*model.head_dim",
        ),
        (["model.n_kv_heads=3"], r"n_heads=4 is not divisible by model.n_kv_heads=3"),
        (
            ["model.n_heads=12", "model.head_dim=16", "model.n_kv_heads=3", "parallel.tp=2"],
            r"n_kv_heads=3 neither divides nor is a multiple",
        ),
        (
            ["model.ffn_dim=190", "parallel.tp=4"],
            r"model.ffn_dim=190 is not divisible by parallel.tp=4",
        ),
        (
            ["parallel.pp=2", "parallel.zero_stage=3"],
            r"pipeline engine refuses ZeRO-2/3; use parallel.zero_stage=1",
        ),
        (["parallel.pp=3"], r"parallel.pp=3 is more stages than model.n_layers=2"),
        (
            ["train.global_batch_size=12", "train.micro_batch_size=8"],
            r"not a multiple of train.micro_batch_size",
        ),
        (["model.hash.num_bucket=5"], r"model.hash.num_bucket: unknown field"),
        (["optimizer.lr=-1"], r"optimizer.lr: Input should be greater than 0"),
        (["train.max_steps"], r"expected key=value"),
        (["train.trainable_blocks=2"], r"train.trainable_blocks .* set train.init_from too"),
    ],
)
def test_invalid_configs_name_field_and_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny-h4b16k", overrides=overrides)


def test_engram_hash_mode_former_name_reads_as_keyed():
    cfg = load_config("tiny-h4b16k+engram", overrides=["model.engram.hash=seed"])
    assert cfg.model.engram.hash == "keyed"
    # a checkpoint marker written under the former name compares equal to today's config
    from mhf_dist.train.checkpoint import _as_written_now

    marker_model = cfg.model.model_dump(mode="json")
    marker_model["engram"]["hash"] = "seed"
    assert _as_written_now(marker_model) == cfg.model.model_dump(mode="json")
    # no longer valid: compared as stored
    assert _as_written_now({"n_layers": "many"}) == {"n_layers": "many"}


def _printed(tmp_path, capsys, *args: str):
    """``mhf-dist config ARGS > run.yaml``: the file's path and text."""
    from mhf_dist.cli import main

    assert main(["config", *args]) == 0
    path = tmp_path / "run.yaml"
    path.write_text(capsys.readouterr().out)
    return path, path.read_text()


def _at_dp(cfg, dp: int):
    """What a run of ``cfg`` on dp data-parallel ranks trains with: its layout, micro-batch and every field after the
    layout fitted the micro-batch; or the error that refuses it."""
    from mhf_dist.parallel.layout import resolve_layout

    try:
        layout = resolve_layout(cfg, dp)
    except ConfigError as e:
        return str(e)
    return layout, cfg.train.micro_batch_from_preset, cfg.model_dump(mode="json")


@pytest.mark.parametrize(
    "name, overrides, dps",
    [
        ("tiny-h4b16k", [], (1, 2, 4, 8)),  # the preset's micro-batch 8 is lowered to 4, 2, 1
        (
            "tiny-standard+engram",
            ["train.global_batch_size=16"],
            (1, 3, 4, 8),
        ),  # dp 3: refused by both
        ("1b-h4b16k", ["data.path=/shards"], (1, 2, 4, 128)),  # 4 fits up to dp 64; 2 at dp 128
        (
            "100m-h1b16k",
            ["model.hash.num_buckets=4096"],
            (2, 3, 64),
        ),  # dp 3: 256 is no multiple of 3
        (
            "tiny-h4b16k",
            ["train.micro_batch_size=2"],
            (1, 2, 4, 8),
        ),  # set by the user: kept, and refused at dp 8
    ],
)
def test_a_printed_config_trains_as_its_preset_at_every_dp(tmp_path, capsys, name, overrides, dps):
    path, text = _printed(tmp_path, capsys, "--preset", name, *(f"--set={o}" for o in overrides))
    set_by_user = any(o.startswith("train.micro_batch_size=") for o in overrides)
    assert ("  # micro_batch_size: " in text) != set_by_user
    assert f"preset: {name}\n" in text
    for dp in dps:
        direct, printed = load_config(name, overrides=overrides), load_config(path=path)
        assert (
            printed.train.micro_batch_from_preset
            == direct.train.micro_batch_from_preset
            == (not set_by_user)
        )
        assert _at_dp(printed, dp) == _at_dp(direct, dp), dp


def test_a_printed_config_names_the_preset_it_holds(tmp_path, capsys):
    (tmp_path / "other.yaml").write_text("preset: 1b-h4b16k\ntrain:\n  max_steps: 5\n")
    path, _ = _printed(
        tmp_path, capsys, "--preset", "tiny-h4b16k", "--config", str(tmp_path / "other.yaml")
    )
    direct = load_config("tiny-h4b16k", tmp_path / "other.yaml")
    # --preset is the one applied
    assert direct.preset == "tiny-h4b16k" and direct.model.d_model == 64
    assert _at_dp(load_config(path=path), 2) == _at_dp(direct, 2)


def test_a_printed_config_trains_on_two_ranks(tmp_path, capsys, data):
    """``config --preset tiny-h4b16k > run.yaml``, then ``train --config run.yaml`` on 2 ranks: the preset's
    micro-batch of 8 is lowered to 4, as for ``train --preset tiny-h4b16k``."""
    import yaml

    from helpers.runs import metrics, run_cli

    settings = [
        f"tokenizer.path={data['tokenizer']}",
        f"data.path={data['shards']}",
        "data.seq_len=64",
        "model.hash.num_buckets=256",
        "train.max_steps=2",
        "train.eval_sequences=8",
    ]
    path, _ = _printed(
        tmp_path, capsys, "--preset", "tiny-h4b16k", *(f"--set={s}" for s in settings)
    )
    run = tmp_path / "run"
    run_cli(["train", "--config", str(path), "--nproc-per-node", "2", "--run-dir", str(run)])
    assert [m["step"] for m in metrics(run) if "loss" in m][-1] == 2
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["micro_batch_size"] == 4
