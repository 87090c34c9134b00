"""``NgramHash``: multi-head N-gram hashing for the Engram memory (docs/spec.md §8).

At position ``t`` the N-gram of order ``n`` is the compressed ids ``(x_{t-n+1}, ..., x_t)``; positions before the
start read the compressed pad id, so position ``t`` sees only tokens ``<= t`` (given the tokens' ``positions`` in their
documents, ``data.document_masking``, so do positions before a document's start). Each order has K heads, head ``k`` a
table of prime size ``M_k`` (``table_sizes``). ``engram`` (DeepSeek's demo) XORs the tokens' products with odd
multipliers, ``keyed`` packs the N-gram by Horner's rule and XORs its product with a per-head key, both then
``mod M_k``: int64 arithmetic that wraps around, with the floor modulo. The constants come from
``numpy.random.default_rng(seed + LAYER_SEED_STRIDE·layer)``. Everything is vectorised over batch and sequence: the
only Python loops run over orders and shifts. Formulas: docs/spec.md §8; choices: docs/design-model.md.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from mhf_dist.config import EngramConfig

INT64_MAX = 2**63 - 1
LAYER_SEED_STRIDE = 10007


class NgramHash(nn.Module):
    """Token ids ``[B, S]`` -> table rows ``[B, S, (N-1)·K]`` of one layer (order-major, then head).

    ``old_to_new`` is the tokenizer compression (``mhf_dist.vocab.engram_compression``), ``num_ids`` its V',
    ``pad_id`` the compressed id read before the sequence start.
    """

    def __init__(
        self,
        cfg: EngramConfig,
        layer: int,
        sizes: list[list[int]],
        old_to_new: torch.Tensor,
        num_ids: int,
        pad_id: int,
    ):
        super().__init__()
        self.mode, self.max_ngram, self.num_ids, self.pad_id = (
            cfg.hash,
            cfg.max_ngram,
            num_ids,
            pad_id,
        )
        rng = np.random.default_rng(cfg.seed + LAYER_SEED_STRIDE * layer)
        self.register_buffer("old_to_new", old_to_new.long(), persistent=False)
        # [N-1, K]; data, like the other buffers: real on a meta skeleton too
        self.register_buffer(
            "moduli", torch.tensor(sizes, dtype=torch.long, device="cpu"), persistent=False
        )
        if self.mode == "engram":
            half_bound = max(1, INT64_MAX // num_ids // 2)
            multipliers = rng.integers(0, half_bound, size=cfg.max_ngram, dtype=np.int64) * 2 + 1
            # [N]
            self.register_buffer("multipliers", torch.from_numpy(multipliers), persistent=False)
        else:
            keys = rng.integers(1, 2**31, size=(cfg.max_ngram - 1, cfg.heads), dtype=np.int64)
            self.register_buffer("keys", torch.from_numpy(keys), persistent=False)  # [N-1, K]

    @property
    def num_heads(self) -> int:
        return self.moduli.numel()

    def shifted(
        self, input_ids: torch.Tensor, positions: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """Compressed ids ``x_{t-j}`` for ``j = 0..N-1`` (each ``[B, S]``), the pad id before the start, and with
        ``positions [B, S]`` (each token's in its document) before its document's start."""
        x = self.old_to_new[input_ids]
        pad = torch.full_like(x, self.pad_id)
        back = [
            torch.cat([pad[:, :j], x[:, : x.shape[1] - j]], dim=1) for j in range(self.max_ngram)
        ]
        if positions is not None:
            back = [torch.where(positions >= j, b, pad) for j, b in enumerate(back)]
        return back

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Rows ``[B, S, (N-1)·K]``; ``positions``: as ``shifted``."""
        back = self.shifted(input_ids, positions)
        rows = []
        for n in range(2, self.max_ngram + 1):
            moduli = self.moduli[n - 2]
            if self.mode == "engram":
                mix = back[0] * self.multipliers[0]
                for j in range(1, n):
                    mix = mix ^ (back[j] * self.multipliers[j])
                rows.append(mix.unsqueeze(-1) % moduli)
            else:
                v = back[n - 1]
                for j in range(
                    n - 2, -1, -1
                ):  # Horner: the oldest token is the most significant digit
                    v = v * self.num_ids + back[j]
                keys = self.keys[n - 2]
                rows.append(((v.unsqueeze(-1) * keys) ^ keys) % moduli)
        return torch.cat(rows, dim=-1)
