"""The model's config: ``ModelConfig`` (the backbone's shape, the variant, their options) with its hash
section (``HashConfig``) and its optional Engram memory (``EngramConfig``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from mhf_dist.config.strict import Strict
from mhf_dist.config.variants import variant_rules
from mhf_dist.errors import ConfigError


class HashConfig(Strict):
    """Signatures and the hash encoder/decoder (docs/spec.md §1, §2, §4)."""

    num_hashes: int = Field(4, ge=1, description="H: hash coordinates per token")
    num_buckets: int = Field(
        16384, ge=2, description="B: rows per bucket table; bucket 0 is padding"
    )
    single_id: bool = Field(
        False, description="H1 ablation: one hash copied into all H coordinates (non-unique)"
    )
    gate_dim: int = Field(64, ge=1, description="d_z of the encoder's gate MLP (docs/spec.md §2)")
    mixer_dim: int = Field(
        64, ge=1, description="r of the decoder's cascade mixers (docs/spec.md §4)"
    )
    p_inf_loss_weight: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="λ: adds λ × mean(−log P_inf(target)) to the training loss, the NLL of the distribution "
        "inference uses (exact renormalisation over the registered vocabulary, in chunks; MultiHashFormer only). "
        "λ > 0 runs the decoder unfused (decoder_chunk_tokens unused): the term needs every head's scores, so "
        "activation memory grows from O(chunk × B) to O(N × H × B / tp) for N tokens per micro-batch; 0: off",
    )


class EngramConfig(Strict):
    """Engram N-gram memory (docs/spec.md §8), added to the residual stream before the attention of ``layers``.

    Choices where docs/spec.md §8 is silent: each head's table has the smallest unused prime ``>= table_size`` rows
    (distinct over heads, orders and layers, assigned in that nesting: layer, order, head); the ``engram``
    hash and ``sigmoid`` gate (DeepSeek's public demo) are the defaults; ``head_dim`` makes the concatenated
    head vectors ``d_model`` wide for the sigmoid gate (DeepSeek's proportions), and must be ``d_model`` for
    the softmax gate, whose scores are ``h · E_k[idx_k]``.
    """

    layers: list[int] | None = Field(
        None, description="backbone layers (0-based) with a memory; None: 1 and L/2"
    )
    max_ngram: int = Field(3, ge=2, description="N: N-grams of orders 2..N")
    heads: int = Field(4, ge=1, description="K: hash heads (tables) per order")
    table_size: int = Field(
        65536, ge=2, description="rows per head table: the next unused prime >= this"
    )
    head_dim: int | None = Field(
        None,
        ge=1,
        description="width of a table row; None: d_model for the softmax gate, "
        "d_model / ((N-1)·K) for the sigmoid gate",
    )
    hash: Literal["engram", "keyed"] = Field(
        "engram",
        description="engram: XOR of per-token odd multipliers (DeepSeek); keyed: the packed N-gram "
        "times a per-head key, XOR the key (docs/spec.md §8); 'seed' is read as keyed",
    )
    gate: Literal["sigmoid", "softmax"] = Field(
        "sigmoid",
        description="sigmoid: scalar gate on a projected value + short causal conv (DeepSeek); "
        "softmax: weights over the heads from h · E_k (docs/spec.md §8)",
    )
    threshold: float | None = Field(
        None, description="softmax gate: heads scoring below this are masked (None: no mask)"
    )
    kernel_size: int = Field(
        4, ge=1, description="sigmoid gate: taps of the causal depthwise convolution"
    )
    seed: int = Field(
        0, description="RNG seed of the hash multipliers/keys (per layer: seed + 10007·layer)"
    )
    pad_rows_to: int = Field(
        128,
        ge=1,
        description="tables are padded to a multiple of this many rows (a multiple of parallel.tp)",
    )
    offload: bool | Literal["sharded"] = Field(
        False,
        description="keep the tables in (pinned) host memory outside DeepSpeed: each micro-batch's rows "
        "are gathered to the device ahead of use, their gradients added back on the host, and the tables step "
        "with a host AdamW of the same hyperparameters (pp = tp = 1, ZeRO 1-3); true: every rank holds the whole "
        "tables; sharded: each rank holds a slice of their rows (offload_shards), asking the owners for the "
        "rows a micro-batch reads",
    )
    offload_shards: Literal["all", "node"] = Field(
        "all",
        description="offload=sharded: all: the rows split over every rank (one copy in the job, the least "
        "memory); node: over the ranks of each node (one copy per node: lookups stay inside the node, each "
        "step's gradients are summed over the nodes)",
    )
    table_dtype: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="with offload: the dtype of the tables' weights in host memory (bf16: half the bytes; the "
        "update is computed in fp32 and rounded once per step)",
    )
    moment_dtype: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="with offload: the dtype of the host AdamW's two moments (bf16: half their bytes)",
    )
    host_budget_gb: float | None = Field(
        None,
        gt=0,
        description="with offload: the host memory (GB) a rank may give its host tables (their weights, Adam "
        "moments, gradients and exchange buffers); a layout past it is refused at the start, naming one that "
        "fits (None: not checked; plan checks against the cluster profile's memory)",
    )
    offload_update: Literal["dense", "lazy"] = Field(
        "dense",
        description="the host AdamW with offload: dense: every row each step, equal to the tables on the "
        "device; lazy: only the rows read in the step (by any micro-batch on any data-parallel rank): their "
        "moments, weight decay and update, bias-corrected by the global step count; the other rows and their "
        "moments stay as they are (LazyAdam, SparseAdam)",
    )

    @field_validator("hash", mode="before")
    @classmethod
    def _keyed_alias(cls, value):
        return "keyed" if value == "seed" else value  # the mode's former name

    @model_validator(mode="after")
    def _gate(self):
        if self.threshold is not None and self.gate != "softmax":
            raise ValueError(
                f"model.engram.threshold applies to gate=softmax only (gate is {self.gate!r}); "
                "unset the threshold or set model.engram.gate=softmax"
            )
        if self.offload_shards != "all" and self.offload != "sharded":
            raise ValueError(
                f"model.engram.offload_shards={self.offload_shards} applies to sharded host tables only; "
                "set model.engram.offload=sharded or unset model.engram.offload_shards"
            )
        # the settings of host-memory tables, at their defaults otherwise
        for name, default in (
            ("table_dtype", "fp32"),
            ("moment_dtype", "fp32"),
            ("host_budget_gb", None),
            ("offload_update", "dense"),
        ):
            if getattr(self, name) != default and not self.offload:
                raise ValueError(
                    f"model.engram.{name}={getattr(self, name)} applies to host-memory tables only; "
                    f"set model.engram.offload=true or unset model.engram.{name}"
                )
        return self


class ModelConfig(Strict):
    """Backbone shape (docs/spec.md §3) and which input/output the model uses."""

    variant: str = Field(  # a registered variant (mhf_dist/config/variants.py)
        "mhf", description="MultiHashFormer or the tied-embedding baseline"
    )
    d_model: int = Field(ge=1)
    n_layers: int = Field(ge=1)
    n_heads: int = Field(ge=1)
    n_kv_heads: int = Field(ge=1)
    head_dim: int | None = Field(None, description="defaults to d_model / n_heads")
    ffn_dim: int = Field(ge=1)
    rope_theta: float = 1_000_000.0
    norm_eps: float = 1e-6
    init_std: float = 0.02
    pad_vocab_to: int = Field(
        128, ge=1, description="Standard: embedding rows rounded up to this multiple"
    )
    decoder_chunk_tokens: int = Field(
        8192,
        ge=0,
        description="training loss: decoder fused over chunks of this many tokens (activation memory "
        "O(chunk × B): a chunk's logits live only inside one head's forward or backward); 0: the plain path, which "
        "keeps every head's logits (reference)",
    )
    hash: HashConfig = HashConfig()
    engram: EngramConfig | None = Field(
        None, description="Engram N-gram memory (docs/spec.md §8); None: no memory"
    )

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    def padded_vocab_rows(self, vocab_size: int) -> int:
        """Standard: table rows for ``vocab_size`` tokens, rounded up to ``pad_vocab_to``."""
        return -(-vocab_size // self.pad_vocab_to) * self.pad_vocab_to

    def kv_heads_split(self, tp: int) -> bool:
        """How tp ranks share the kv heads: True, split over the ranks (``n_kv_heads`` a multiple of tp); False,
        each rank computes the one replicated kv head its query heads share (``n_kv_heads`` divides tp)."""
        if self.n_kv_heads % tp == 0:
            return True
        if tp % self.n_kv_heads == 0:
            return False
        raise ConfigError(
            f"model.n_kv_heads={self.n_kv_heads} neither divides nor is a multiple of parallel.tp={tp}: kv heads "
            "are split over tp or replicated per rank; choose tp as a divisor or multiple of n_kv_heads"
        )

    @property
    def engram_layers(self) -> list[int]:
        """Layers holding a memory, ascending (none without ``engram``); docs/spec.md §8's example: 1 and L/2."""
        if self.engram is None:
            return []
        if self.engram.layers is None:
            return sorted({min(1, self.n_layers - 1), self.n_layers // 2})
        return sorted(self.engram.layers)

    @property
    def engram_head_dim(self) -> int:
        e = self.engram
        if e.head_dim is not None:
            return e.head_dim
        return (
            self.d_model if e.gate == "softmax" else self.d_model // ((e.max_ngram - 1) * e.heads)
        )

    @field_validator("variant")
    @classmethod
    def _registered(cls, name: str) -> str:
        variant_rules(name)  # an unknown name is refused, naming the known ones
        return name

    @model_validator(mode="after")
    def _shapes(self):
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(
                f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}; "
                "change one of them or set model.head_dim"
            )
        if self.engram is not None:
            self._check_engram()
        if error := variant_rules(self.variant).config_error(self):
            raise ValueError(error)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads={self.n_kv_heads} (GQA groups); "
                "pick n_kv_heads dividing n_heads"
            )
        return self

    def _check_engram(self) -> None:
        e, layers = self.engram, self.engram_layers
        if e.layers is not None and len(set(e.layers)) != len(e.layers):
            raise ValueError(
                f"model.engram.layers={e.layers} names a layer twice; list each layer once"
            )
        outside = [i for i in layers if not 0 <= i < self.n_layers]
        if outside:
            raise ValueError(
                f"model.engram.layers={layers}: layer {outside[0]} is out of range for model.n_layers="
                f"{self.n_layers}; use 0..{self.n_layers - 1}"
            )
        if e.gate == "softmax" and self.engram_head_dim != self.d_model:
            raise ValueError(
                f"model.engram.head_dim={e.head_dim} with gate=softmax: its scores h · E_k[idx] need rows of "
                f"model.d_model={self.d_model}; unset model.engram.head_dim"
            )
        if (
            e.head_dim is None
            and e.gate == "sigmoid"
            and self.d_model % ((e.max_ngram - 1) * e.heads)
        ):
            raise ValueError(
                f"model.d_model={self.d_model} is not divisible by (max_ngram-1)·heads = "
                f"{(e.max_ngram - 1) * e.heads}; set model.engram.head_dim"
            )

    def tp_rows_error(self, tp: int) -> str | None:
        """Why ``parallel.tp`` cannot split this model's vocabulary tables along their rows, or None."""
        return variant_rules(self.variant).tp_rows_error(self, tp)
