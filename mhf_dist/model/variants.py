"""One record per model variant (``model.variant``): everything that differs between MultiHashFormer and Standard.

A :class:`Variant` holds its builder (the language model with its vocabulary side, docs/spec.md §2–§5), how
many output heads and table rows it has, whether it needs a signature table (docs/spec.md §1), its vocabulary's
FLOP and parameter terms (which :mod:`~mhf_dist.model.flops` and :mod:`~mhf_dist.model.parameter_count` add to
the backbone's), its one-word description in ``plan`` and its Hugging Face names
(:class:`HFNames`, docs/spec.md §9). :data:`VARIANTS` maps each name to its record and :func:`variant` looks one
up, so the rest of the package asks the record instead of comparing the name (as torchtitan's train-spec
registry does). Ablations and options that are not variants (``model.hash.single_id``, ``model.engram``) stay
fields of the config, and so do the config's own checks of a variant (``mhf_dist/config/schema.py``: the config sits
below the model and cannot ask this table).

Adding a variant: its name in ``ModelConfig.variant``'s ``Literal`` (``mhf_dist/config/schema.py``) and a
record in :data:`VARIANTS`; tests/test_variants.py checks that the two agree.

This module imports neither torch nor the config at load time (``submit`` and ``plan`` count on a login node);
the builders import the model classes when they are called.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mhf_dist.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from mhf_dist.config import ModelConfig
    from mhf_dist.model.lm import LanguageModel
    from mhf_dist.vocab.engram_compression import CompressionTable


@dataclass(frozen=True)
class HFNames:
    """How a variant exports to Hugging Face (``mhf_dist/hf/exporter.py``; plain strings: this module imports
    neither transformers nor :mod:`mhf_dist.hf`)."""

    model_type: str  # config.json's model_type
    architecture: str  # the model class: config.json's architectures
    config_class: str  # the config class the exporter writes
    remote_code: bool  # exported with our modeling code (auto_map; trust_remote_code), which applies τ


@dataclass(frozen=True)
class Variant:
    """What one ``model.variant`` is; the callables take the :class:`~mhf_dist.config.ModelConfig`."""

    name: str  # model.variant
    title: str  # its name in messages
    builder: Callable[[ModelConfig, int, torch.Tensor | None, CompressionTable | None], LanguageModel]
    needs_signatures: bool  # tokens map to bucket codes of a signature table (docs/spec.md §1)
    heads: Callable[[ModelConfig], int]  # output heads = tables: H, or 1
    vocab_rows: Callable[[ModelConfig, int], int]  # rows per table for a vocabulary of that many tokens
    vocab_flops: Callable[[ModelConfig, int | None], tuple[int, int]]  # forward FLOPs per token: (input, output)
    vocab_parameters: Callable[[ModelConfig, int], tuple[int, int]]  # (tables, encoder + decoder)
    describe: Callable[[ModelConfig], str]  # the vocabulary side in one word (plan)
    hf: HFNames


# MultiHashFormer (docs/spec.md §1–§4): H bucket tables of B rows, the gated encoder and the cascaded decoder.

def _build_mhf(cfg: ModelConfig, vocab_size: int, codes: torch.Tensor | None,
               compression: CompressionTable | None) -> LanguageModel:
    from mhf_dist.model.lm import MultiHashFormer

    return MultiHashFormer(cfg, codes, compression)


def _mhf_vocab_flops(cfg: ModelConfig, vocab_rows: int | None) -> tuple[int, int]:
    """The gate MLP on each of H bucket vectors and ``W_s``; the H bucket-logit matmuls, H−1 soft retrievals and
    H−1 mixers (:mod:`~mhf_dist.model.flops`)."""
    d, hc = cfg.d_model, cfg.hash
    H, B, dz, r = hc.num_hashes, hc.num_buckets, hc.gate_dim, hc.mixer_dim
    vocab_in = H * 2 * (d * dz + dz) + 2 * d * d
    vocab_out = 2 * H * B * d + 2 * (H - 1) * B * d + (H - 1) * 2 * (2 * d * r + r * d)
    return vocab_in, vocab_out


def _mhf_vocab_parameters(cfg: ModelConfig, vocab_size: int) -> tuple[int, int]:
    """H tables of ``B × d``; the gate MLP, ``W_s`` and H−1 mixers (:mod:`~mhf_dist.model.parameter_count`)."""
    d, h = cfg.d_model, cfg.hash
    tables = h.num_hashes * h.num_buckets * d
    other = (d * h.gate_dim + 2 * h.gate_dim + 1) + (d * d + d) + (h.num_hashes - 1) * (
        2 * d * h.mixer_dim + h.mixer_dim + h.mixer_dim * d + d)
    return tables, other


def _mhf_describe(cfg: ModelConfig) -> str:
    return f"H{cfg.hash.num_hashes}×B{cfg.hash.num_buckets}" + (" single-ID" if cfg.hash.single_id else "")


MHF = Variant(
    name="mhf", title="MultiHashFormer", builder=_build_mhf, needs_signatures=True,
    heads=lambda cfg: cfg.hash.num_hashes, vocab_rows=lambda cfg, vocab_size: cfg.hash.num_buckets,
    vocab_flops=_mhf_vocab_flops, vocab_parameters=_mhf_vocab_parameters, describe=_mhf_describe,
    hf=HFNames(model_type="qwen3", architecture="MultiHashFormerForCausalLM", config_class="MultiHashFormerConfig",
               remote_code=True),
)


# Standard (the baseline): one table of the vocabulary's rows, padded to pad_vocab_to, tied to a plain LM head.

def _build_standard(cfg: ModelConfig, vocab_size: int, codes: torch.Tensor | None,
                    compression: CompressionTable | None) -> LanguageModel:
    from mhf_dist.model.lm import StandardLM

    return StandardLM(cfg, vocab_size, compression)


def _standard_vocab_flops(cfg: ModelConfig, vocab_rows: int | None) -> tuple[int, int]:
    """The tied LM head ``2 · R · d`` over the padded rows R; the input lookup is free."""
    if vocab_rows is None:
        raise ValueError("Standard FLOPs need the padded vocabulary rows")
    return 0, 2 * vocab_rows * cfg.d_model


STANDARD = Variant(
    name="standard", title="Standard", builder=_build_standard, needs_signatures=False,
    heads=lambda cfg: 1, vocab_rows=lambda cfg, vocab_size: cfg.padded_vocab_rows(vocab_size),
    vocab_flops=_standard_vocab_flops,
    vocab_parameters=lambda cfg, vocab_size: (cfg.padded_vocab_rows(vocab_size) * cfg.d_model, 0),
    describe=lambda cfg: "standard",
    hf=HFNames(model_type="qwen3", architecture="Qwen3ForCausalLM", config_class="Qwen3Config", remote_code=False),
)


VARIANTS: dict[str, Variant] = {v.name: v for v in (MHF, STANDARD)}


def variant(cfg_or_name: Any) -> Variant:
    """The record of a variant name, a :class:`~mhf_dist.config.ModelConfig` or a
    :class:`~mhf_dist.config.RunConfig`; an unknown name is refused, naming the known ones."""
    if isinstance(cfg_or_name, str):
        name = cfg_or_name
    elif hasattr(cfg_or_name, "variant"):
        name = cfg_or_name.variant
    else:
        name = cfg_or_name.model.variant
    try:
        return VARIANTS[name]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown model variant {name!r}: the known variants are {', '.join(sorted(VARIANTS))} "
                          "(mhf_dist/model/variants.py)") from None
