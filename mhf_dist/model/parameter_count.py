"""Parameter counts from the config alone (``parameter_count``), without building the model or importing torch
(``submit`` sizes a job's checkpoints from them on a login node). tests/test_memory_plan.py checks them against the
built model.

The backbone's terms and the Engram memory's (docs/spec.md §8: ``engram_table_rows``, ``engram_gate_parameters``)
are here; the vocabulary's (docs/spec.md §2–§4) are each variant's (``Variant.vocab_parameters``, ``variants``).
Every term: docs/design-model.md, "Counts: parameters and FLOPs".
"""

from __future__ import annotations

from dataclasses import dataclass

from mhf_dist.config import ModelConfig
from mhf_dist.model.engram_sizes import table_sizes
from mhf_dist.model.variants import variant


@dataclass(frozen=True)
class ParameterCount:
    """The model's parameters by where they live."""

    vocab_tables: int  # the bucket tables (Standard: the embedding), tied between input and output
    vocab_other: int  # the gate MLP, W_s and the cascade's mixers
    backbone: int  # every layer (Engram gates included) and the final norm
    engram_tables: int  # the Engram memories' tables that DeepSpeed trains
    # the Engram tables kept in host memory outside DeepSpeed (model.engram.offload)
    host_tables: int

    @property
    def trained_by_engine(self) -> int:
        return self.vocab_tables + self.vocab_other + self.backbone + self.engram_tables

    @property
    def total(self) -> int:
        return self.trained_by_engine + self.host_tables


def engram_table_rows(cfg: ModelConfig, layer: int) -> int:
    """The rows ``R`` of each of layer ``layer``'s Engram tables: its largest prime size, padded."""
    e = cfg.engram
    largest = max(max(order) for order in table_sizes(e, cfg.engram_layers)[layer])
    return -(-largest // e.pad_rows_to) * e.pad_rows_to


def engram_gate_parameters(cfg: ModelConfig) -> int:
    e, d = cfg.engram, cfg.d_model
    if e.gate == "softmax":
        return d * d
    width = (e.max_ngram - 1) * e.heads * cfg.engram_head_dim  # T·m
    return 2 * width * d + 3 * d + e.kernel_size * d


def parameter_count(cfg: ModelConfig, vocab_size: int) -> ParameterCount:
    """``cfg``'s parameters for a tokenizer of ``vocab_size`` tokens (which only Standard's tables depend on)."""
    d, hd = cfg.d_model, cfg.resolved_head_dim
    attention = 2 * d * cfg.n_heads * hd + 2 * d * cfg.n_kv_heads * hd + 2 * hd
    layer = attention + 3 * d * cfg.ffn_dim + 2 * d
    engram_tables = 0
    if cfg.engram is not None:
        heads = (cfg.engram.max_ngram - 1) * cfg.engram.heads
        engram_tables = sum(
            heads * engram_table_rows(cfg, i) * cfg.engram_head_dim for i in cfg.engram_layers
        )
    backbone = (
        cfg.n_layers * layer
        + d
        + len(cfg.engram_layers) * (engram_gate_parameters(cfg) if cfg.engram else 0)
    )
    tables, other = variant(cfg).vocab_parameters(cfg, vocab_size)
    offloaded = cfg.engram is not None and cfg.engram.offload
    return ParameterCount(
        vocab_tables=tables,
        vocab_other=other,
        backbone=backbone,
        engram_tables=0 if offloaded else engram_tables,
        host_tables=engram_tables if offloaded else 0,
    )
