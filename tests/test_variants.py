"""The model variants' table (mhf_dist/model/variants.py): one record per configured variant, found by name or
config, and the only place the variant's name is compared; a variant from outside the package (tests/helpers/
toy_variant.py) is one registration, which the config, the builder and a training step follow."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path
from unittest.mock import patch

import pytest
import torch

from helpers.ranks import run_ranks
from helpers.toy_variant import TOY, ToyLM
from mhf_dist.config import ConfigError, load_config
from mhf_dist.config.variants import RULES
from mhf_dist.model import build_model
from mhf_dist.model.variants import VARIANTS, register_variant, variant

PACKAGE = Path(__file__).resolve().parents[1] / "mhf_dist"
PRESETS = {"mhf": "tiny-h4b16k", "standard": "tiny-standard"}


def test_every_configured_variant_has_a_record():
    assert sorted(VARIANTS) == sorted(RULES) == sorted(PRESETS)
    for name, rules in RULES.items():
        assert (
            variant(name) is VARIANTS[name]
            and VARIANTS[name].name == name
            and VARIANTS[name].rules is rules
        )


def test_lookup_by_config_and_an_unknown_name_refused():
    cfg = load_config("tiny-standard")
    assert variant(cfg) is variant(cfg.model) is VARIANTS["standard"]
    with pytest.raises(
        ConfigError, match=r"unknown model variant 'mhf2': the known variants are mhf, standard"
    ):
        variant("mhf2")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_heads_and_rows_are_the_built_tables(name):
    cfg = load_config(PRESETS[name], overrides=["model.hash.num_buckets=64"]).model
    vocab = 300
    with torch.device("meta"):
        model = build_model(cfg, vocab, torch.ones(vocab, cfg.hash.num_hashes, dtype=torch.long))
    spec = variant(cfg)
    assert tuple(model.vocab.tables.weight.shape) == (
        spec.heads(cfg),
        spec.vocab_rows(cfg, vocab),
        cfg.d_model,
    )
    assert spec.vocab_parameters(cfg, vocab)[0] == model.vocab.tables.weight.numel()


def test_hf_names_are_the_exported_classes():
    from mhf_dist.hf.exporter import HF_CLASSES

    for spec in VARIANTS.values():
        config_class, model_class = (
            HF_CLASSES[spec.hf.config_class],
            HF_CLASSES[spec.hf.architecture],
        )
        assert (
            config_class.model_type == spec.hf.model_type
            and model_class.config_class.model_type == "qwen3"
        )


def test_the_record_module_imports_no_torch_and_no_upper_layer():
    layers = (
        "torch",
        "transformers",
        "mhf_dist.hf",
        "mhf_dist.train",
        "mhf_dist.commands",
        "mhf_dist.parallel",
    )
    code = f"import sys, mhf_dist.model.variants; print(sorted(m for m in sys.modules if m.startswith({layers!r})))"
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert loaded.strip() == "[]"


COMPARISONS = [
    re.compile(r"\bvariant\s*(==|!=)"),  # cfg.variant == "mhf"
    re.compile(r"\bvariant\s+(not\s+)?in\b"),  # m.variant in ("mhf", ...)
    # "mhf" == name
    re.compile(r"""(==|!=|\bin)\s*[(\[{]?\s*["']mhf["']|["']mhf["']\s*(==|!=|in\b)"""),
    re.compile(r"\bmatch\s+[\w.]*variant\b"),  # match cfg.variant:
    re.compile(r"\bis_(mhf|standard)\b"),
]


def test_only_the_variants_module_compares_the_variant():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "model" / "variants.py":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if any(p.search(line) for p in COMPARISONS):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{i}: {line.strip()}")
    assert not found, (
        "compare the variant through its record (mhf_dist/model/variants.py):\n" + "\n".join(found)
    )


@pytest.fixture
def toy():
    """The toy variant, registered for one test (the registries as they were afterwards)."""
    with patch.dict(VARIANTS), patch.dict(RULES):
        yield register_variant(TOY)


TOY_CONFIG = ["model.variant=toy"]


def test_a_variant_is_one_registration_the_config_follows(toy):
    cfg = load_config("tiny-standard", overrides=TOY_CONFIG)
    assert variant(cfg) is toy and cfg.model.tp_rows_error(1) is None
    with pytest.raises(
        ConfigError, match="model.variant=toy keeps its table whole: parallel.tp=2 cannot split it"
    ):
        load_config("tiny-standard", overrides=[*TOY_CONFIG, "parallel.tp=2"])
    with pytest.raises(ConfigError, match="model.variant=toy has no log P_inf term"):
        load_config("tiny-standard", overrides=[*TOY_CONFIG, "model.hash.p_inf_loss_weight=0.5"])
    assert register_variant(TOY) is TOY  # again: no change
    with pytest.raises(ValueError, match="'toy' is registered already"):
        register_variant(dataclasses.replace(TOY, title="Another toy"))


def test_import_hf_reads_a_config_json_as_the_one_variant_whose_record_claims_it(toy):
    from mhf_dist.hf.importer import model_config_from_hf
    from mhf_dist.hf.names import HFImportError

    qwen3 = {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 128,
    }
    assert model_config_from_hf(qwen3)[
        "variant"
    ] == "standard" and "hash" not in model_config_from_hf(qwen3)
    hashed = model_config_from_hf(
        qwen3
        | {
            "num_hashes": 4,
            "num_buckets": 256,
            "bottle_neck_dim": 32,
            "signature_rule": {"seeds": [0, 0, 0, 0]},
        }
    )
    assert hashed["variant"] == "mhf"
    assert hashed["hash"] == dict(
        num_hashes=4, num_buckets=256, gate_dim=32, mixer_dim=32, single_id=True
    )
    with pytest.raises(HFImportError, match="num_lsh=2: LSH coordinates are not supported"):
        model_config_from_hf(qwen3 | {"num_hashes": 4, "num_buckets": 256, "num_lsh": 2})
    greedy = dataclasses.replace(
        TOY,
        rules=dataclasses.replace(TOY.rules, name="greedy"),
        hf=dataclasses.replace(TOY.hf, model_section=lambda config: {}),
    )
    register_variant(greedy)  # claims every config.json, as Standard does
    with pytest.raises(
        HFImportError, match=r"read as 2 model variants \(standard, greedy\), not one"
    ):
        model_config_from_hf(qwen3)


def test_an_unregistered_variant_is_refused_by_the_config():
    with pytest.raises(
        ConfigError, match=r"unknown model variant 'toy': the known variants are mhf, standard"
    ):
        load_config("tiny-standard", overrides=TOY_CONFIG)


def test_the_toy_variant_builds_and_trains_a_step(toy):
    cfg = load_config("tiny-standard", overrides=TOY_CONFIG).model
    vocab = 300
    model = build_model(cfg, vocab)
    assert isinstance(model, ToyLM)
    assert tuple(model.vocab.tables.weight.shape) == (
        toy.heads(cfg),
        toy.vocab_rows(cfg, vocab),
        cfg.d_model,
    )
    assert (
        toy.vocab_parameters(cfg, vocab)[0]
        == model.vocab.tables.weight.numel()
        == vocab * cfg.d_model
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = torch.randint(0, vocab, (2, 17), generator=torch.Generator().manual_seed(0))
    before = model(batch[:, :-1], batch[:, 1:]).loss
    before.backward()
    optimizer.step()
    with torch.no_grad():
        after = model(batch[:, :-1], batch[:, 1:]).loss
    assert torch.isfinite(before) and after < before


class OneBatch:
    """A batch source that hands out the same micro-batch every time."""

    def __init__(self, batch: torch.Tensor):
        self.batch = batch

    def next_batch(self, micro_batch: int, pin: bool = False) -> torch.Tensor:
        return self.batch


def _toy_engine_step(rank, world, run_dir, data):
    """One DeepSpeed training step of the toy variant on a fixed batch, and its loss in plain torch."""
    from mhf_dist.train.loop import TrainingLoop
    from mhf_dist.train.preemption import StopSignal

    cfg = load_config(
        "tiny-standard",
        overrides=[
            *TOY_CONFIG,
            f"tokenizer.path={data['tokenizer']}",
            f"data.path={data['shards']}",
            "data.seq_len=64",
            "train.max_steps=2",
            "train.global_batch_size=2",
            "train.micro_batch_size=2",
        ],
    )
    loop = TrainingLoop(cfg, StopSignal())
    assert loop.setup(run_dir, "none")
    batch = torch.randint(
        0, len(loop.assets.tokenizer), (2, 65), generator=torch.Generator().manual_seed(0)
    )
    stats = loop.trainer.train_step(OneBatch(batch))
    model = build_model(cfg.model, len(loop.assets.tokenizer), seed=cfg.train.seed)
    return stats, model(batch[:, :-1], batch[:, 1:]).loss.item()


@pytest.mark.multirank
def test_the_toy_variant_trains_a_step_on_the_engine(toy, tmp_path, data):
    stats, plain = run_ranks(_toy_engine_step, 1, tmp_path / "run", data)[0]
    assert not stats.skipped and stats.grad_norm > 0 and len(stats.head_losses) == 1
    # the engine's model is the one the variant builds
    assert stats.loss == pytest.approx(plain, rel=1e-5)
