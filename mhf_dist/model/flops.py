"""Analytic FLOPs per token (``forward_flops``, ``engram_flops``): the one count that MFU, the profiler and pipeline
balancing use.

Matmul FLOPs are ``2·m·n·k`` and a training step is 3× the forward (forward, backward for inputs, backward for
weights), as in PaLM's MFU, attention scores and values counted at the full ``S``. The backbone's and the Engram
memory's (docs/spec.md §8) terms are here; the vocabulary's are each variant's (``Variant.vocab_flops``,
``variants``). Lookups, hashing, norms, softmax and biases are not counted. Every term, and Standard's
``6·N_params + 12·L·n_heads·head_dim·S`` per token: docs/design-model.md, "Counts: parameters and FLOPs".
"""

from __future__ import annotations

from dataclasses import dataclass

from mhf_dist.config import ModelConfig
from mhf_dist.model.variants import variant


@dataclass(frozen=True)
class ForwardFlops:
    """Forward FLOPs per token by part; ``block`` is one backbone layer, ``engram`` one memory, held by the
    layers ``engram_layers``."""

    vocab_in: int
    block: int
    layers: int
    vocab_out: int
    engram: int = 0
    engram_layers: tuple[int, ...] = ()

    def layer(self, i: int) -> int:
        """Backbone layer ``i`` with its memory, if it has one."""
        return self.block + (self.engram if i in self.engram_layers else 0)

    @property
    def forward(self) -> int:
        return self.vocab_in + sum(self.layer(i) for i in range(self.layers)) + self.vocab_out

    @property
    def train(self) -> int:
        return 3 * self.forward


def forward_flops(cfg: ModelConfig, seq_len: int, vocab_rows: int | None = None) -> ForwardFlops:
    """Per-token forward FLOPs of ``cfg`` at sequence length ``seq_len`` (``vocab_rows``: Standard's padded rows)."""
    d, hd, h = cfg.d_model, cfg.resolved_head_dim, cfg.n_heads
    block_params = d * (h * hd) * 2 + d * (cfg.n_kv_heads * hd) * 2 + 3 * d * cfg.ffn_dim
    block = 2 * block_params + 4 * h * hd * seq_len
    layers = dict(
        block=block,
        layers=cfg.n_layers,
        engram=engram_flops(cfg),
        engram_layers=tuple(cfg.engram_layers),
    )
    vocab_in, vocab_out = variant(cfg).vocab_flops(cfg, vocab_rows)
    return ForwardFlops(vocab_in=vocab_in, vocab_out=vocab_out, **layers)


def engram_flops(cfg: ModelConfig) -> int:
    """Forward FLOPs per token of one Engram memory (0 without ``cfg.engram``)."""
    e, d = cfg.engram, cfg.d_model
    if e is None:
        return 0
    width = (e.max_ngram - 1) * e.heads * cfg.engram_head_dim  # T·m
    if e.gate == "softmax":
        return 2 * 2 * width + 2 * d * d
    return 2 * 2 * width * d + 2 * d + 2 * e.kernel_size * d
