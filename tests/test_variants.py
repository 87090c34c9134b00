"""The model variants' table (mhf_dist/model/variants.py): one record per configured variant, found by name or
config, and the only place the variant's name is compared."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest
import torch

from mhf_dist.config import ConfigError, ModelConfig, load_config
from mhf_dist.model import build_model
from mhf_dist.model.variants import VARIANTS, variant

PACKAGE = Path(__file__).resolve().parents[1] / "mhf_dist"
CONFIGURED = get_args(ModelConfig.model_fields["variant"].annotation)
PRESETS = {"mhf": "tiny-h4b16k", "standard": "tiny-standard"}


def test_every_configured_variant_has_a_record():
    assert CONFIGURED and sorted(VARIANTS) == sorted(CONFIGURED) == sorted(PRESETS)
    for name in CONFIGURED:
        assert variant(name) is VARIANTS[name] and VARIANTS[name].name == name


def test_lookup_by_config_and_an_unknown_name_refused():
    cfg = load_config("tiny-standard")
    assert variant(cfg) is variant(cfg.model) is VARIANTS["standard"]
    with pytest.raises(ConfigError, match=r"unknown model variant 'mhf2': the known variants are mhf, standard"):
        variant("mhf2")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_heads_and_rows_are_the_built_tables(name):
    cfg = load_config(PRESETS[name], overrides=["model.hash.num_buckets=64"]).model
    vocab = 300
    with torch.device("meta"):
        model = build_model(cfg, vocab, torch.ones(vocab, cfg.hash.num_hashes, dtype=torch.long))
    spec = variant(cfg)
    assert tuple(model.vocab.tables.weight.shape) == (spec.heads(cfg), spec.vocab_rows(cfg, vocab), cfg.d_model)
    assert spec.vocab_parameters(cfg, vocab)[0] == model.vocab.tables.weight.numel()


def test_hf_names_are_the_exported_classes():
    from mhf_dist.hf.exporter import HF_CLASSES

    for spec in VARIANTS.values():
        config_class, model_class = HF_CLASSES[spec.hf.config_class], HF_CLASSES[spec.hf.architecture]
        assert config_class.model_type == spec.hf.model_type and model_class.config_class.model_type == "qwen3"


def test_the_record_module_imports_no_torch_and_no_upper_layer():
    layers = ("torch", "transformers", "mhf_dist.hf", "mhf_dist.train", "mhf_dist.commands", "mhf_dist.parallel")
    code = (f"import sys, mhf_dist.model.variants; print(sorted(m for m in sys.modules if m.startswith({layers!r})))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"


COMPARISONS = [
    re.compile(r"\bvariant\s*(==|!=)"),  # cfg.variant == "mhf"
    re.compile(r"\bvariant\s+(not\s+)?in\b"),  # m.variant in ("mhf", ...)
    re.compile(r"""(==|!=|\bin)\s*[(\[{]?\s*["']mhf["']|["']mhf["']\s*(==|!=|in\b)"""),  # "mhf" == name
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
    assert not found, "compare the variant through its record (mhf_dist/model/variants.py):\n" + "\n".join(found)
