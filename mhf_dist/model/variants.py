"""One record per model variant (``model.variant``): everything that differs between MultiHashFormer and Standard.

A ``Variant`` holds its config rules (``VariantRules``: its name and what it asks of the model config), its builder
(docs/spec.md §2–§5), its output heads and table rows, whether it needs a signature table (docs/spec.md §1), its
vocabulary's FLOP and parameter terms (added to the backbone's by ``flops`` and ``parameter_count``), its word in
``plan`` and its Hugging Face names and ``import-hf`` reading (``HFNames``, docs/spec.md §9). ``register_variant``
adds a record to ``VARIANTS`` and its rules to the config's; ``variant`` looks one up. This module imports neither
torch nor the model classes at load time (``submit`` and ``plan`` count on a login node); the builders import them
when called. Why: docs/design-model.md, "Vocabulary".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mhf_dist.config.variants import MHF_RULES, STANDARD_RULES, VariantRules, register_rules
from mhf_dist.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from mhf_dist.config import ModelConfig
    from mhf_dist.model.lm import LanguageModel
    from mhf_dist.model.modes import ModelModes
    from mhf_dist.vocab.engram_compression import CompressionTable


@dataclass(frozen=True)
class HFNames:
    """How a variant exports to Hugging Face (``mhf_dist/hf/exporter.py``) and is read back (``import-hf``); plain
    strings and dicts: this module imports neither transformers nor ``mhf_dist.hf``."""

    model_type: str  # config.json's model_type
    architecture: str  # the model class: config.json's architectures
    config_class: str  # the config class the exporter writes
    # exported with our modeling code (auto_map; trust_remote_code), which applies τ
    remote_code: bool
    # import-hf: the variant's own keys of the model section from a config.json (the backbone's are common), None
    # when the config.json is another variant's; ValueError for one of its own that cannot be imported
    model_section: Callable[[dict], dict | None]


@dataclass(frozen=True)
class Variant:
    """What one ``model.variant`` is; the callables take the ``ModelConfig``."""

    rules: VariantRules  # its name and what the config checks of it
    title: str  # its name in messages
    builder: Callable[
        [ModelConfig, int, torch.Tensor | None, CompressionTable | None, ModelModes], LanguageModel
    ]
    needs_signatures: bool  # tokens map to bucket codes of a signature table (docs/spec.md §1)
    heads: Callable[[ModelConfig], int]  # output heads = tables: H, or 1
    # rows per table for a vocabulary of that many tokens
    vocab_rows: Callable[[ModelConfig, int], int]
    # forward FLOPs per token: (input, output)
    vocab_flops: Callable[[ModelConfig, int | None], tuple[int, int]]
    vocab_parameters: Callable[[ModelConfig, int], tuple[int, int]]  # (tables, encoder + decoder)
    describe: Callable[[ModelConfig], str]  # the vocabulary side in one word (plan)
    hf: HFNames

    @property
    def name(self) -> str:
        """``model.variant``."""
        return self.rules.name


VARIANTS: dict[str, Variant] = {}


def register_variant(record: Variant) -> Variant:
    """Add ``record`` to ``VARIANTS`` and its rules to the config's (again: no change); another record under a
    taken name is refused."""
    if VARIANTS.get(record.name, record) is not record:
        raise ValueError(f"model variant {record.name!r} is registered already")
    register_rules(record.rules)
    VARIANTS[record.name] = record
    return record


# MultiHashFormer (docs/spec.md §1–§4): H bucket tables of B rows, the gated encoder and the cascaded decoder.


def _build_mhf(
    cfg: ModelConfig,
    vocab_size: int,
    codes: torch.Tensor | None,
    compression: CompressionTable | None,
    modes: ModelModes,
) -> LanguageModel:
    from mhf_dist.model.lm import MultiHashFormer

    return MultiHashFormer(cfg, codes, compression, modes)


def _mhf_vocab_flops(cfg: ModelConfig, vocab_rows: int | None) -> tuple[int, int]:
    """The gate MLP on each of H bucket vectors and ``W_s``; the H bucket-logit matmuls, H−1 soft retrievals and
    H−1 mixers (``flops``)."""
    d, hc = cfg.d_model, cfg.hash
    H, B, dz, r = hc.num_hashes, hc.num_buckets, hc.gate_dim, hc.mixer_dim
    vocab_in = H * 2 * (d * dz + dz) + 2 * d * d
    vocab_out = 2 * H * B * d + 2 * (H - 1) * B * d + (H - 1) * 2 * (2 * d * r + r * d)
    return vocab_in, vocab_out


def _mhf_vocab_parameters(cfg: ModelConfig, vocab_size: int) -> tuple[int, int]:
    """H tables of ``B × d``; the gate MLP, ``W_s`` and H−1 mixers (``parameter_count``)."""
    d, h = cfg.d_model, cfg.hash
    tables = h.num_hashes * h.num_buckets * d
    other = (
        (d * h.gate_dim + 2 * h.gate_dim + 1)
        + (d * d + d)
        + (h.num_hashes - 1) * (2 * d * h.mixer_dim + h.mixer_dim + h.mixer_dim * d + d)
    )
    return tables, other


def _mhf_describe(cfg: ModelConfig) -> str:
    return f"H{cfg.hash.num_hashes}×B{cfg.hash.num_buckets}" + (
        " single-ID" if cfg.hash.single_id else ""
    )


def _mhf_model_section(config: dict) -> dict | None:
    """The hash section of one of the authors' ``qwen3_hashformer`` configs (or our export's); a config.json
    without ``num_hashes`` is not one."""
    if "num_hashes" not in config:
        return None
    if config.get("num_lsh", 0) or config.get("lsh_only_embed"):
        raise ValueError(
            f"num_lsh={config.get('num_lsh')}: LSH coordinates are not supported; only checkpoints "
            "whose coordinates are all random hashes (num_lsh = 0, docs/spec.md §9) import"
        )
    gate = config.get("bottle_neck_dim", 64)
    seeds = (config.get("signature_rule") or {}).get("seeds", [])
    return {
        "hash": dict(
            num_hashes=config["num_hashes"],
            num_buckets=config["num_buckets"],
            gate_dim=gate,
            mixer_dim=config.get("mixer_dim") or gate,
            single_id=len(seeds) > 1 and not any(seeds),
        )
    }


MHF = register_variant(
    Variant(
        rules=MHF_RULES,
        title="MultiHashFormer",
        builder=_build_mhf,
        needs_signatures=True,
        heads=lambda cfg: cfg.hash.num_hashes,
        vocab_rows=lambda cfg, vocab_size: cfg.hash.num_buckets,
        vocab_flops=_mhf_vocab_flops,
        vocab_parameters=_mhf_vocab_parameters,
        describe=_mhf_describe,
        hf=HFNames(
            model_type="qwen3",
            architecture="MultiHashFormerForCausalLM",
            config_class="MultiHashFormerConfig",
            remote_code=True,
            model_section=_mhf_model_section,
        ),
    )
)


# Standard (the baseline): one table of the vocabulary's rows, padded to pad_vocab_to, tied to a plain LM head.


def _build_standard(
    cfg: ModelConfig,
    vocab_size: int,
    codes: torch.Tensor | None,
    compression: CompressionTable | None,
    modes: ModelModes,
) -> LanguageModel:
    from mhf_dist.model.lm import StandardLM

    return StandardLM(cfg, vocab_size, compression, modes)


def _standard_vocab_flops(cfg: ModelConfig, vocab_rows: int | None) -> tuple[int, int]:
    """The tied LM head ``2 · R · d`` over the padded rows R; the input lookup is free."""
    if vocab_rows is None:
        raise ValueError("Standard FLOPs need the padded vocabulary rows")
    return 0, 2 * vocab_rows * cfg.d_model


STANDARD = register_variant(
    Variant(
        rules=STANDARD_RULES,
        title="Standard",
        builder=_build_standard,
        needs_signatures=False,
        heads=lambda cfg: 1,
        vocab_rows=lambda cfg, vocab_size: cfg.padded_vocab_rows(vocab_size),
        vocab_flops=_standard_vocab_flops,
        vocab_parameters=lambda cfg, vocab_size: (
            cfg.padded_vocab_rows(vocab_size) * cfg.d_model,
            0,
        ),
        describe=lambda cfg: "standard",
        hf=HFNames(
            model_type="qwen3",
            architecture="Qwen3ForCausalLM",
            config_class="Qwen3Config",
            remote_code=False,
            model_section=lambda config: None if "num_hashes" in config else {},
        ),  # a plain Qwen3 config
    )
)


def variant(cfg_or_name: Any) -> Variant:
    """The record of a variant name, a ``ModelConfig`` or a
    ``RunConfig``; an unknown name is refused, naming the known ones."""
    if isinstance(cfg_or_name, str):
        name = cfg_or_name
    elif hasattr(cfg_or_name, "variant"):
        name = cfg_or_name.variant
    else:
        name = cfg_or_name.model.variant
    try:
        return VARIANTS[name]
    except (KeyError, TypeError):
        raise ConfigError(
            f"unknown model variant {name!r}: the known variants are {', '.join(sorted(VARIANTS))} "
            "(mhf_dist/model/variants.py)"
        ) from None
