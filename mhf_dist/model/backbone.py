"""Qwen3-style decoder-only backbone (docs/spec.md §3): ``Backbone`` of ``Block``s (``Attention``, ``SwiGLU``).

Pre-norm RMSNorm blocks with grouped-query attention (RoPE, per-head RMSNorm on q and k) and a SwiGLU MLP, no biases,
then a final RMSNorm. Parameter names follow Hugging Face's Qwen3 (``self_attn.q_proj``, ``mlp.gate_proj``, ...), so
the exported layout (docs/spec.md §9) is a renaming of prefixes only. Head counts are read from the projections'
output sizes, so the same code runs when a tensor-parallel plan swaps in sharded projections. With ``model.engram``
the blocks of ``cfg.engram_layers`` first add their ``EngramMemory`` (docs/spec.md §8), which reads the token ids:
``x <- x + memory(x, ids)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from mhf_dist.config import ModelConfig
from mhf_dist.model.engram import EngramMemory
from mhf_dist.model.engram_sizes import table_sizes

if TYPE_CHECKING:
    from mhf_dist.vocab.engram_compression import CompressionTable


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin [S, head_dim]`` for rotate-half RoPE (Qwen3/Llama convention)."""
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim
    )
    angles = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, heads, S, hd]`` by position."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class Attention(nn.Module):
    """Causal GQA with RoPE and q/k RMSNorm; one output projection."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hd = self.head_dim = cfg.resolved_head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * hd, cfg.d_model, bias=False)
        self.q_norm = nn.RMSNorm(hd, eps=cfg.norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=cfg.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, s, -1, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, s, -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1]
        )
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
    ) -> torch.Tensor:
        if self.engram is not None:
            x = x + self.engram(x, input_ids)
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """``layers`` then the final norm: ``[B, S, d] -> [B, S, d]`` (the memories also read ``input_ids [B, S]``).

    ``checkpoint_interval = k > 0`` recomputes every k-th block's activations in
    backward (torch's non-reentrant checkpoint, which also works under ZeRO-3).
    ``compression`` (the tokenizer's, docs/spec.md §8) is needed only with ``cfg.engram``.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        compression: CompressionTable | None = None,
        checkpoint_interval: int = 0,
    ):
        super().__init__()
        self.head_dim, self.rope_theta = cfg.resolved_head_dim, cfg.rope_theta
        sizes = table_sizes(cfg.engram, cfg.engram_layers) if cfg.engram else {}
        if sizes and compression is None:
            raise ValueError(
                "model.engram needs the tokenizer's compression table (CompressionTable.build, or "
                ".identity for a synthetic vocabulary)"
            )
        self.layers = nn.ModuleList(
            Block(cfg, EngramMemory(cfg, i, sizes[i], compression) if i in sizes else None)
            for i in range(cfg.n_layers)
        )
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.checkpoint_interval = checkpoint_interval

    def compile_blocks(self) -> None:
        """``torch.compile`` each block in place (identical blocks share one compiled graph)."""
        for layer in self.layers:
            layer.compile()

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        cos, sin = rope_cos_sin(
            torch.arange(x.shape[1], device=x.device), self.head_dim, self.rope_theta
        )
        k = self.checkpoint_interval
        for i, layer in enumerate(self.layers):
            if k and i % k == 0 and torch.is_grad_enabled():
                x = checkpoint(layer, x, cos, sin, input_ids, use_reentrant=False)
            else:
                x = layer(x, cos, sin, input_ids)
        return self.norm(x)
