"""HashEncoder: fuse a token's H bucket vectors into its input vector (docs/spec.md §2).

``a_i = σ(u_i W1 + b1) W2 + b2``, ``α = softmax_i(a_i)``,
``e(w) = (Σ_i α_i u_i) W_s + b_s``. The gate sees only the token's own bucket
vectors. Submodule names (``scorer.{0,2}``, ``output_proj.0``) are the
authors' ``combiner`` layout (docs/spec.md §9).
"""

from __future__ import annotations

import torch
from torch import nn


class HashEncoder(nn.Module):
    def __init__(self, dim: int, gate_dim: int):
        super().__init__()
        self.scorer = nn.Sequential(nn.Linear(dim, gate_dim), nn.SiLU(), nn.Linear(gate_dim, 1))
        self.output_proj = nn.Sequential(nn.Linear(dim, dim))

    def forward(self, bucket_vectors: torch.Tensor) -> torch.Tensor:
        """``u [..., H, d]`` -> ``e [..., d]``."""
        alpha = torch.softmax(self.scorer(bucket_vectors), dim=-2)
        return self.output_proj((alpha * bucket_vectors).sum(dim=-2))
