"""``EngramMemory``: a conditional N-gram memory added to the residual stream (docs/spec.md §8).

At a configured layer, before the block's attention (as in DeepSeek's demo), ``x <- x + memory(x, ids)``: the N-grams
of compressed ids ending at each position are hashed to one row per head (``NgramHash``), the rows are looked up
(``u_k = E_k[idx_k]``) and fused by a gate that reads the hidden state ``h = x`` there: ``SigmoidGate`` (DeepSeek's
demo, its causal depthwise convolution ``ShortConv``) or ``SoftmaxGate``, whose formulas docs/spec.md §8 gives.
Everything looks backwards: the hash reads tokens ``<= t``, ``h`` comes from a causal backbone and the convolution is
left-padded. Given the tokens' ``positions`` in their documents (``data.document_masking``,
``mhf_dist.model.documents``), neither the N-grams nor the convolution reach back across a document start. The tables
are one ``BucketTables`` ``[(N-1)·K, R, head_dim]`` (each head's padded to ``R`` rows, a multiple of ``pad_rows_to``;
rows ``>= M_k`` are never read), sharded along their rows like the bucket tables (docs/spec.md §7), every use through
the module's ``forward`` (ZeRO-3); with ``offload`` a ``HostTables`` in host memory, whose rows the trainer prefetches
per micro-batch (``EngramMemory.prefetch``). Choices: docs/design-engram.md.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from mhf_dist.config import ModelConfig
from mhf_dist.model.documents import document_positions
from mhf_dist.model.dtypes import DTYPES
from mhf_dist.model.host_tables import HostTables
from mhf_dist.model.ngram_hash import NgramHash
from mhf_dist.model.tables import BucketTables

if TYPE_CHECKING:
    from mhf_dist.vocab.engram_compression import CompressionTable


class SoftmaxGate(nn.Module):
    def __init__(self, dim: int, threshold: float | None):
        super().__init__()
        self.dim, self.threshold = dim, threshold
        self.out_proj = nn.Linear(dim, dim, bias=False)

    def weights(self, h: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """``h [..., d]``, ``u [..., T, d]`` -> ``w [..., T]``."""
        scores = (u @ h.unsqueeze(-1)).squeeze(-1) / math.sqrt(self.dim)
        if self.threshold is None:
            return torch.softmax(scores, dim=-1)
        keep = scores >= self.threshold
        # the lowest finite score rather than -inf: an all-masked position gets weights 0, not NaN
        return (
            torch.softmax(scores.masked_fill(~keep, torch.finfo(scores.dtype).min), dim=-1) * keep
        )

    def forward(
        self, h: torch.Tensor, u: torch.Tensor, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``positions``: unused (the gate reads each position alone)."""
        return self.out_proj((self.weights(h, u).unsqueeze(-1) * u).sum(dim=-2))


class DocumentConv1d(nn.Conv1d):
    """A depthwise ``nn.Conv1d`` over a left-padded ``[B, d, pad + S]`` (``pad = (kernel_size - 1)·dilation``) that
    can also be given the outputs' ``positions [B, S]`` in their documents: a tap reaching back past its output's
    document start then reads zero, as a tap before the row's start reads the padding. The weight is read in this
    module's ``forward`` only (ZeRO-3 gathers it there)."""

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        if positions is None:
            return super().forward(x)
        (taps,), (dilation,), seq = self.kernel_size, self.dilation, positions.shape[1]
        out = torch.zeros_like(x[..., :seq])
        for j in range(taps):  # tap j reads input t - back
            back = (taps - 1 - j) * dilation
            tap = x[..., j * dilation : j * dilation + seq] * self.weight[:, :, j]
            out = out + torch.where((positions >= back).unsqueeze(1), tap, 0.0)
        return out


class ShortConv(nn.Module):
    """``SiLU(causal depthwise conv(RMSNorm(v)))`` over the sequence: ``[B, S, d] -> [B, S, d]``; with
    ``positions``, within each document."""

    def __init__(self, dim: int, kernel_size: int, dilation: int, eps: float):
        super().__init__()
        self.norm = nn.RMSNorm(dim, eps=eps)
        self.conv = DocumentConv1d(dim, dim, kernel_size, dilation=dilation, groups=dim, bias=False)
        self.left_pad = (kernel_size - 1) * dilation  # output t sees inputs t, t-dilation, ...

    def forward(self, v: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        x = F.pad(self.norm(v).transpose(1, 2), (self.left_pad, 0))
        return F.silu(self.conv(x, positions)).transpose(1, 2)


class SigmoidGate(nn.Module):
    def __init__(self, memory_dim: int, dim: int, kernel_size: int, dilation: int, eps: float):
        super().__init__()
        self.dim = dim
        self.key_proj = nn.Linear(memory_dim, dim, bias=False)
        self.value_proj = nn.Linear(memory_dim, dim, bias=False)
        self.key_norm = nn.RMSNorm(dim, eps=eps)
        self.query_norm = nn.RMSNorm(dim, eps=eps)
        self.short_conv = ShortConv(dim, kernel_size, dilation, eps)

    def forward(
        self, h: torch.Tensor, u: torch.Tensor, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        e = u.flatten(-2)
        g = (self.key_norm(self.key_proj(e)) * self.query_norm(h)).sum(dim=-1) / math.sqrt(self.dim)
        # sqrt has an infinite slope at 0: clamp |g| as the demo does
        alpha = torch.sigmoid(g.sign() * g.abs().clamp_min(1e-6).sqrt())
        v = alpha.unsqueeze(-1) * self.value_proj(e)
        return v + self.short_conv(v, positions)


class EngramMemory(nn.Module):
    """The memory of backbone layer ``layer``: ``(h [B, S, d], input_ids [B, S]) -> [B, S, d]``, to be added to ``h``.

    ``sizes[n-2][k]`` is the prime size ``M_k`` of head ``k`` of order ``n``
    (``table_sizes``). ``document_eos``: the backbone's (``Backbone``); ``prefetch`` derives the positions from it
    as the backbone does.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        layer: int,
        sizes: list[list[int]],
        compression: "CompressionTable",
        document_eos: int | None = None,
    ):
        super().__init__()
        e = cfg.engram
        self.document_eos = document_eos
        self.hash = NgramHash(
            e, layer, sizes, compression.old_to_new, compression.num_ids, compression.pad_id
        )
        rows = -(-max(max(order) for order in sizes) // e.pad_rows_to) * e.pad_rows_to
        if e.offload:
            self.tables = HostTables(
                self.hash.num_heads, rows, cfg.engram_head_dim, DTYPES[e.table_dtype]
            )
            # a host copy of the hash for prefetching, not a submodule: model.to(device) leaves it on the host
            object.__setattr__(
                self,
                "host_hash",
                NgramHash(
                    e, layer, sizes, compression.old_to_new, compression.num_ids, compression.pad_id
                ),
            )
        else:
            self.tables = BucketTables(self.hash.num_heads, rows, cfg.engram_head_dim)
        if e.gate == "softmax":
            self.gate = SoftmaxGate(cfg.d_model, e.threshold)
        else:
            self.gate = SigmoidGate(
                self.hash.num_heads * cfg.engram_head_dim,
                cfg.d_model,
                e.kernel_size,
                e.max_ngram,
                cfg.norm_eps,
            )

    def forward(
        self, h: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``positions [B, S]``: each token's position in its document (``BlockInputs``); None: one sequence."""
        u = self.tables.lookup(self.hash(input_ids, positions)).to(h.dtype)
        return self.gate(h, u, positions)

    def prefetch(self, input_ids: torch.Tensor) -> None:
        """Offloaded tables: start gathering the rows that ``input_ids [B, S]`` (on the host) will read."""
        positions = None
        if self.document_eos is not None:
            positions = document_positions(input_ids, self.document_eos)
        self.tables.prefetch(self.host_hash(input_ids, positions))
