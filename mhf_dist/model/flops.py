"""Analytic FLOPs per token: the one count that MFU, the profiler and pipeline balancing use.

Matmul FLOPs are ``2·m·n·k``; a training step is 3× the forward (forward,
backward for inputs, backward for weights), as in PaLM's MFU. Forward per token:

- backbone, per layer: ``2 ·`` (its linear parameters) + attention scores and
  values ``4 · n_heads · head_dim · S`` (full ``S``, PaLM's convention);
- Standard vocabulary: the tied LM head, ``2 · R · d`` (R = padded rows; the
  input lookup is free);
- MultiHashFormer vocabulary: the gate MLP on each of H bucket vectors
  ``H · 2·(d·d_z + d_z)``, ``W_s`` ``2·d²``; the decoder's H bucket-logit matmuls
  ``2·H·B·d``, its H−1 soft retrievals ``2·(H−1)·B·d`` and H−1 mixers
  ``2·(2d·r + r·d)`` each. Lookups, norms, softmax and biases are not counted.

So Standard's training FLOPs per token are ``6·N_params + 12·L·n_heads·head_dim·S``.
"""

from __future__ import annotations

from dataclasses import dataclass

from mhf_dist.config import ModelConfig


@dataclass(frozen=True)
class ForwardFlops:
    """Forward FLOPs per token by part; ``block`` is one backbone layer."""

    vocab_in: int
    block: int
    layers: int
    vocab_out: int

    @property
    def forward(self) -> int:
        return self.vocab_in + self.layers * self.block + self.vocab_out

    @property
    def train(self) -> int:
        return 3 * self.forward


def forward_flops(cfg: ModelConfig, seq_len: int, vocab_rows: int | None = None) -> ForwardFlops:
    """Per-token forward FLOPs of ``cfg`` at sequence length ``seq_len`` (``vocab_rows``: Standard's padded rows)."""
    d, hd, h = cfg.d_model, cfg.resolved_head_dim, cfg.n_heads
    block_params = d * (h * hd) * 2 + d * (cfg.n_kv_heads * hd) * 2 + 3 * d * cfg.ffn_dim
    block = 2 * block_params + 4 * h * hd * seq_len
    if cfg.variant == "standard":
        if vocab_rows is None:
            raise ValueError("Standard FLOPs need the padded vocabulary rows")
        return ForwardFlops(vocab_in=0, block=block, layers=cfg.n_layers, vocab_out=2 * vocab_rows * d)
    hc = cfg.hash
    H, B, dz, r = hc.num_hashes, hc.num_buckets, hc.gate_dim, hc.mixer_dim
    vocab_in = H * 2 * (d * dz + dz) + 2 * d * d
    vocab_out = 2 * H * B * d + 2 * (H - 1) * B * d + (H - 1) * 2 * (2 * d * r + r * d)
    return ForwardFlops(vocab_in=vocab_in, block=block, layers=cfg.n_layers, vocab_out=vocab_out)

