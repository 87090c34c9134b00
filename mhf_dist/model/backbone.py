"""Qwen3-style decoder-only backbone (docs/spec.md §3): ``Backbone`` of ``Block``s (``Attention``, ``SwiGLU``).

Pre-norm RMSNorm blocks with grouped-query attention (RoPE, per-head RMSNorm on q and k) and a SwiGLU MLP, no biases,
then a final RMSNorm. Parameter names follow Hugging Face's Qwen3 (``self_attn.q_proj``, ``mlp.gate_proj``, ...), so
the exported layout (docs/spec.md §9) is a renaming of prefixes only. Head counts are read from the projections'
output sizes, so the same code runs when a tensor-parallel plan swaps in sharded projections. With ``model.engram``
the blocks of ``cfg.engram_layers`` first add their ``EngramMemory`` (docs/spec.md §8), which reads the token ids:
``x <- x + memory(x, ids)``. A backbone built with a ``document_eos`` (``data.document_masking``) keeps the documents
packed in a row apart (``mhf_dist.model.documents``): the blocks receive the positions and the attention mask
``block_inputs`` computes once per forward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from mhf_dist.config import ModelConfig
from mhf_dist.model.documents import (
    BlockInputs,
    attention_bias,
    document_mask,
    document_positions,
)
from mhf_dist.model.engram import EngramMemory
from mhf_dist.model.engram_sizes import table_sizes

if TYPE_CHECKING:
    from mhf_dist.vocab.engram_compression import CompressionTable


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin [..., head_dim]`` of ``positions [...]`` (``[S]``, or ``[B, S]`` per row) for rotate-half RoPE
    (Qwen3/Llama convention)."""
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim
    )
    angles = positions.float()[..., None] * inv_freq
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, heads, S, hd]`` by position."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


def block_inputs(
    x: torch.Tensor,
    input_ids: torch.Tensor | None,
    head_dim: int,
    theta: float,
    document_eos: int | None = None,
) -> BlockInputs:
    """The RoPE tables of the positions ``0..S-1`` of ``x [B, S, d]``; with ``document_eos`` those of each token's
    position in its document, the positions and the documents' attention mask (in ``x``'s dtype, from the token ids
    ``input_ids [B, S]``)."""
    if document_eos is None:
        return BlockInputs(
            *rope_cos_sin(torch.arange(x.shape[1], device=x.device), head_dim, theta)
        )
    if input_ids is None:
        raise ValueError("a backbone that masks documents needs the token ids")
    positions = document_positions(input_ids, document_eos)
    cos, sin = rope_cos_sin(positions, head_dim, theta)
    return BlockInputs(
        cos.unsqueeze(1),
        sin.unsqueeze(1),
        positions,
        attention_bias(document_mask(positions), x.dtype),
    )


def document_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    """Attention of ``q [B, heads, S, hd]`` over ``k, v [B, kv_heads, S, hd]`` with the documents' additive
    ``bias [B, 1, S, S]`` (``attention_bias``). The k/v heads are repeated to the query heads: with a mask, CUDA's
    grouped-query attention runs only in the math kernel, which holds the fp32 scores of every head, while the
    memory-efficient kernel takes a mask but not grouped heads (docs/design-model.md, "Document masking")."""
    if k.shape[1] != q.shape[1]:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype))


class Attention(nn.Module):
    """Causal GQA with RoPE and q/k RMSNorm; one output projection. With a document ``mask`` (``BlockInputs``) each
    query attends its own document's keys only."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hd = self.head_dim = cfg.resolved_head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * hd, cfg.d_model, bias=False)
        self.q_norm = nn.RMSNorm(hd, eps=cfg.norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=cfg.norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, s, -1, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, s, -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if mask is None:
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1]
            )
        else:
            out = document_attention(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """One pre-norm Transformer layer, optionally with an Engram memory before its attention."""

    def __init__(self, cfg: ModelConfig, engram: EngramMemory | None = None):
        super().__init__()
        self.engram = engram
        self.input_layernorm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        input_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``positions`` and ``mask``: the documents' (``BlockInputs``), None when the row is one sequence."""
        if self.engram is not None:
            x = x + self.engram(x, input_ids, positions)
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """``layers`` then the final norm: ``[B, S, d] -> [B, S, d]`` (the memories also read ``input_ids [B, S]``).

    ``checkpoint_interval = k > 0`` recomputes every k-th block's activations in
    backward (torch's non-reentrant checkpoint, which also works under ZeRO-3).
    ``compression`` (the tokenizer's, docs/spec.md §8) is needed only with ``cfg.engram``.
    ``document_eos``: the token id that ends each document packed in a row; the documents then do not see each other
    (``mhf_dist.model.documents``). None: a row is one sequence.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        compression: CompressionTable | None = None,
        checkpoint_interval: int = 0,
        document_eos: int | None = None,
    ):
        super().__init__()
        self.head_dim, self.rope_theta = cfg.resolved_head_dim, cfg.rope_theta
        self.document_eos = document_eos
        sizes = table_sizes(cfg.engram, cfg.engram_layers) if cfg.engram else {}
        if sizes and compression is None:
            raise ValueError(
                "model.engram needs the tokenizer's compression table (CompressionTable.build, or "
                ".identity for a synthetic vocabulary)"
            )
        self.layers = nn.ModuleList(
            Block(
                cfg,
                EngramMemory(cfg, i, sizes[i], compression, document_eos) if i in sizes else None,
            )
            for i in range(cfg.n_layers)
        )
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.checkpoint_interval = checkpoint_interval

    def compile_blocks(self) -> None:
        """``torch.compile`` each block in place (identical blocks share one compiled graph)."""
        for layer in self.layers:
            layer.compile()

    def block_inputs(self, x: torch.Tensor, input_ids: torch.Tensor | None) -> BlockInputs:
        """What every block reads beside ``x [B, S, d]`` (``block_inputs``)."""
        return block_inputs(x, input_ids, self.head_dim, self.rope_theta, self.document_eos)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        cos, sin, positions, mask = self.block_inputs(x, input_ids)
        k = self.checkpoint_interval
        for i, layer in enumerate(self.layers):
            if k and i % k == 0 and torch.is_grad_enabled():
                x = checkpoint(layer, x, cos, sin, input_ids, positions, mask, use_reentrant=False)
            else:
                x = layer(x, cos, sin, input_ids, positions, mask)
        return self.norm(x)
