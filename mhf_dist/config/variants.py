"""The model variants' names and what each asks of the model config (``model.variant``).

A variant is one registration, ``mhf_dist.model.variants.register_variant`` of its record, which carries its
``VariantRules``: its name, why a model config is not one of its own and why ``parallel.tp`` cannot split its
tables' rows. ``mhf_dist.config.ModelConfig`` validates against the rules registered here (the config sits
below the model and cannot ask the records). The shipped variants' rules are registered here, so that every process
knows their names, whether or not it imports the model (``status``, ``submit``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mhf_dist.config.model import ModelConfig


@dataclass(frozen=True)
class VariantRules:
    """What the config checks of one ``model.variant``; the callables return the error message, or None."""

    name: str  # model.variant
    # why a model config is not one of this variant's
    config_error: Callable[[ModelConfig], str | None]
    # why parallel.tp cannot split its tables' rows
    tp_rows_error: Callable[[ModelConfig, int], str | None]


RULES: dict[str, VariantRules] = {}


def register_rules(rules: VariantRules) -> VariantRules:
    """Add ``rules`` under its name (again: no change); another variant's rules under a taken name are refused."""
    if RULES.setdefault(rules.name, rules) is not rules:
        raise ValueError(f"model variant {rules.name!r} is registered already")
    return rules


def variant_rules(name: str) -> VariantRules:
    """The rules of variant ``name``; an unknown name is refused, naming the known ones."""
    try:
        return RULES[name]
    except KeyError:
        raise ValueError(
            f"unknown model variant {name!r}: the known variants are {', '.join(sorted(RULES))} "
            "(mhf_dist/model/variants.py)"
        ) from None


def _bucket_rows_error(m: ModelConfig, tp: int) -> str | None:
    if m.hash.num_buckets % tp:
        return (
            f"model.hash.num_buckets={m.hash.num_buckets} is not divisible by parallel.tp={tp}: bucket tables are "
            "split along B; choose B as a multiple of tp"
        )
    return None


def _vocabulary_rows_error(m: ModelConfig, tp: int) -> str | None:
    if m.pad_vocab_to % tp:
        return (
            f"model.pad_vocab_to={m.pad_vocab_to} is not a multiple of parallel.tp={tp}: the vocabulary rows are "
            "split over tp; set pad_vocab_to to a multiple of tp"
        )
    return None


def _standard_config_error(m: ModelConfig) -> str | None:
    if m.hash.p_inf_loss_weight:
        return (
            f"model.hash.p_inf_loss_weight={m.hash.p_inf_loss_weight} with model.variant=standard: a Standard "
            "model's P_inf is its head's softmax, so the term would repeat its training loss; unset it"
        )
    return None


MHF_RULES = register_rules(
    VariantRules("mhf", config_error=lambda m: None, tp_rows_error=_bucket_rows_error)
)
STANDARD_RULES = register_rules(
    VariantRules(
        "standard", config_error=_standard_config_error, tp_rows_error=_vocabulary_rows_error
    )
)
