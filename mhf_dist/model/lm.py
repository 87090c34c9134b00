"""The two language models: MultiHashFormer and the Standard baseline (SPEC §2–§5).

Both are ``tables -> input vector -> backbone -> CascadedDecoder`` over
:class:`BucketTables` tied between input and output:

- :class:`MultiHashFormer`: H bucket tables, a token's input is the
  :class:`HashEncoder` fusion of its signature's rows, the decoder predicts the
  H coordinates; ``codes`` is the signature table.
- :class:`StandardLM`: one table of (padded) vocabulary rows, the input is a
  plain row lookup, the decoder is a single tied head; ``codes`` is the identity.

Training loss: ``Σ_i -log p_i[H_i(w)]`` summed over heads, mean over tokens
(targets ``< 0`` are ignored). Inference: ``log P_inf`` over registered tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mhf_dist.config import ModelConfig
from mhf_dist.model.backbone import Backbone
from mhf_dist.model.decoder import CascadedDecoder
from mhf_dist.model.hash_encoder import HashEncoder
from mhf_dist.model.scoring import log_p_inf
from mhf_dist.model.tables import BucketTables


@dataclass
class LMOutput:
    loss: torch.Tensor  # sum over heads of the mean per-head NLL
    head_losses: torch.Tensor  # [H]


class LanguageModel(nn.Module):
    """Shared skeleton; subclasses define :meth:`embed` (``encoder`` is their input module, if any)."""

    def __init__(self, cfg: ModelConfig, tables: BucketTables, encoder: nn.Module | None, decoder: CascadedDecoder,
                 codes: torch.Tensor, registered: torch.Tensor):
        super().__init__()
        self.cfg = cfg
        self.tables = tables
        self.encoder = encoder
        self.backbone = Backbone(cfg)
        self.decoder = decoder
        self.register_buffer("codes", codes.long(), persistent=False)
        self.register_buffer("registered", registered.bool(), persistent=False)
        self.init_weights()

    def init_weights(self) -> None:
        """Normal(0, init_std) for matrices and tables, zero biases, unit norms."""
        std = self.cfg.init_std
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)
        nn.init.normal_(self.tables.weight, std=std)

    @property
    def vocab_size(self) -> int:
        return self.codes.shape[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Final-norm output ``h [B, S, d]``."""
        return self.backbone(self.embed(input_ids))

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor) -> LMOutput:
        h = self.hidden(input_ids)
        keep = targets >= 0
        nll = self.decoder.nll(h[keep], self.tables, self.codes[targets[keep]])
        head_losses = nll.mean(dim=0)
        return LMOutput(loss=head_losses.sum(), head_losses=head_losses)

    def log_p_inf(self, input_ids: torch.Tensor, last_only: bool = False, chunk_size: int = 65536) -> torch.Tensor:
        """``log P_inf [B, S, V]`` (``[B, V]`` with ``last_only``, as generation needs)."""
        h = self.hidden(input_ids)
        if last_only:
            h = h[:, -1:]
        flat = h.reshape(-1, h.shape[-1])
        logp = log_p_inf(self.decoder.log_probs(flat, self.tables), self.codes, self.registered, self.tables, chunk_size)
        logp = logp.view(*h.shape[:-1], -1)
        return logp[:, 0] if last_only else logp

    def parameter_counts(self) -> dict[str, int]:
        """``embedding`` (tables, encoder, decoder) and ``backbone`` parameter counts."""
        backbone = sum(p.numel() for p in self.backbone.parameters())
        total = sum(p.numel() for p in self.parameters())
        return {"embedding": total - backbone, "backbone": backbone, "total": total}


class MultiHashFormer(LanguageModel):
    """Hash-signature input and cascaded-decoder output; ``codes [V, H]`` from a SignatureTable."""

    def __init__(self, cfg: ModelConfig, codes: torch.Tensor):
        h = cfg.hash
        if codes.shape[1] != h.num_hashes:
            raise ValueError(f"signature table has H={codes.shape[1]} but model.hash.num_hashes={h.num_hashes}")
        super().__init__(
            cfg,
            tables=BucketTables(h.num_hashes, h.num_buckets, cfg.d_model),
            encoder=HashEncoder(cfg.d_model, h.gate_dim),
            decoder=CascadedDecoder(cfg.d_model, h.num_hashes, h.mixer_dim),
            codes=codes,
            registered=(codes != 0).any(dim=1),
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.encoder(self.tables.lookup(self.codes[input_ids]))


class StandardLM(LanguageModel):
    """Tied token embedding / LM head over ``vocab_size`` rows, padded to ``cfg.pad_vocab_to``."""

    def __init__(self, cfg: ModelConfig, vocab_size: int):
        rows = -(-vocab_size // cfg.pad_vocab_to) * cfg.pad_vocab_to
        ids = torch.arange(vocab_size)
        super().__init__(
            cfg,
            tables=BucketTables(1, rows, cfg.d_model),
            encoder=None,
            decoder=CascadedDecoder(cfg.d_model, 1, cfg.hash.mixer_dim, num_valid_rows=vocab_size),
            codes=ids[:, None],
            registered=torch.ones_like(ids, dtype=torch.bool),
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.tables.lookup(input_ids.unsqueeze(-1)).squeeze(-2)


def build_model(cfg: ModelConfig, vocab_size: int, codes: torch.Tensor | None = None) -> LanguageModel:
    """The model ``cfg.variant`` names; MultiHashFormer needs its signature table's ``codes [V, H]``."""
    if cfg.variant == "standard":
        return StandardLM(cfg, vocab_size)
    if codes is None or codes.shape[0] != vocab_size:
        raise ValueError(f"MultiHashFormer needs a signature table with {vocab_size} rows")
    return MultiHashFormer(cfg, codes)
