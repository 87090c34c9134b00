"""The two language models: ``MultiHashFormer`` and the Standard baseline ``StandardLM`` (docs/spec.md §2–§5).

Both are ``LanguageModel``s, ``vocabulary.embed -> backbone -> vocabulary.{loss, evaluation, log_p_inf}``, and differ
only in their ``vocabulary``; either may carry Engram memories in its backbone (docs/spec.md §8, ``cfg.engram``),
built from the tokenizer's compression table. ``forward`` is the training loss (DeepSpeed's engine hooks its module's
forward output, for gradient accumulation and ZeRO's backward, so what it differentiates must come out of that call),
``evaluation`` adds the evaluation sums to it, ``log_p_inf`` scores for inference. ``model_structure`` builds the
modules only, in the ``ModelModes`` given; ``build_model`` also gives every parameter its initial value (``init``: a
function of the seed and the name, so a model built in parts on many ranks starts from the same weights).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from mhf_dist.config import ModelConfig
from mhf_dist.model.backbone import Backbone
from mhf_dist.model.host_tables import HostTables
from mhf_dist.model.init import initialise
from mhf_dist.model.modes import ModelModes
from mhf_dist.model.scoring import LOG_P_INF_CHUNK
from mhf_dist.model.variants import variant
from mhf_dist.model.vocabulary import (
    Evaluation,
    HashVocabulary,
    TiedVocabulary,
    TokenVocabulary,
    TrainingLoss,
)

if TYPE_CHECKING:
    from mhf_dist.vocab.engram_compression import CompressionTable


class LanguageModel(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        vocab: TiedVocabulary,
        compression: CompressionTable | None = None,
        modes: ModelModes = ModelModes(),
    ):
        super().__init__()
        self.cfg = cfg
        self.vocab = vocab
        self.backbone = Backbone(cfg, compression, modes.checkpoint_interval, modes.document_eos)

    @property
    def vocab_size(self) -> int:
        return self.vocab.size

    def hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Final-norm output ``h [B, S, d]``."""
        return self.backbone(self.vocab.embed(input_ids), input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor,
        entropy: bool = False,
        z_loss_weight: float = 0.0,
        divisor: torch.Tensor | None = None,
    ) -> TrainingLoss:
        """The training loss of ``input_ids [B, S]`` predicting ``targets [B, S]`` (``< 0``: ignored); ``entropy``:
        with each head's entropy (``TrainingLoss.head_entropy``); ``z_loss_weight`` > 0: with the z-loss
        (``train.z_loss_weight``, ``TiedVocabulary.loss``); ``divisor``: what the sums over the kept targets are
        divided by instead of their count (``TiedVocabulary.loss``)."""
        return self.vocab.loss(self.hidden(input_ids), targets, entropy, z_loss_weight, divisor)

    def evaluation(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor,
        temperatures: torch.Tensor | None = None,
        divisor: torch.Tensor | None = None,
    ) -> Evaluation:
        """The training loss with the evaluation sums at ``temperatures`` (``TiedVocabulary.evaluation``)."""
        return self.vocab.evaluation(self.hidden(input_ids), targets, temperatures, divisor)

    @torch.no_grad()
    def row_scores(self, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per row of ``input_ids [B, S]``, the sums of ``log P_inf`` over its ``targets`` ``>= 0``
        (``TiedVocabulary.row_scores``): float64 ``[B, 3]``, NLL, top-1 hits, count."""
        return self.vocab.row_scores(self.hidden(input_ids), targets)

    def log_p_inf(
        self, input_ids: torch.Tensor, last_only: bool = False, chunk_size: int = LOG_P_INF_CHUNK
    ) -> torch.Tensor:
        """``log P_inf [B, S, V]`` (``[B, V]`` with ``last_only``, as generation needs)."""
        h = self.hidden(input_ids)
        return self.vocab.log_p_inf(h[:, -1] if last_only else h, chunk_size)

    def train_only_vocabulary_and_ends(self, blocks: int) -> None:
        """Freeze all but the vocabulary side, the final norm and the first and last ``blocks`` blocks
        (the paper's vocabulary-expansion stage, as the authors' ``main_ve.py`` trains it)."""
        layers = self.backbone.layers
        trained = set(range(blocks)) | set(range(len(layers) - blocks, len(layers)))
        for i, layer in enumerate(layers):
            layer.requires_grad_(i in trained)

    def parameter_counts(self) -> dict[str, int]:
        """``embedding`` (tables, encoder, decoder), ``backbone`` (without memories) and ``engram`` (the memories)
        parameter counts."""
        # model.engram.offload
        host = sum(m.weight.numel() for m in self.modules() if isinstance(m, HostTables))
        engram = (
            sum(p.numel() for n, p in self.backbone.named_parameters() if ".engram." in n) + host
        )
        backbone = sum(p.numel() for p in self.backbone.parameters()) + host - engram
        total = sum(p.numel() for p in self.parameters()) + host
        return {
            "embedding": total - backbone - engram,
            "backbone": backbone,
            "engram": engram,
            "total": total,
        }


class MultiHashFormer(LanguageModel):
    """Hash-signature input and cascaded-decoder output; ``codes [V, H]`` from a SignatureTable."""

    def __init__(
        self,
        cfg: ModelConfig,
        codes: torch.Tensor,
        compression: CompressionTable | None = None,
        modes: ModelModes = ModelModes(),
    ):
        h = cfg.hash
        if codes.shape[1] != h.num_hashes:
            raise ValueError(
                f"signature table has H={codes.shape[1]} but model.hash.num_hashes={h.num_hashes}"
            )
        super().__init__(
            cfg,
            HashVocabulary(
                codes,
                h.num_buckets,
                cfg.d_model,
                gate_dim=h.gate_dim,
                mixer_dim=h.mixer_dim,
                chunk_tokens=cfg.decoder_chunk_tokens,
                p_inf_loss_weight=h.p_inf_loss_weight,
                kernels=modes.kernels,
            ),
            compression,
            modes,
        )


class StandardLM(LanguageModel):
    """Tied token embedding / LM head over ``vocab_size`` rows, padded to ``cfg.pad_vocab_to``."""

    def __init__(
        self,
        cfg: ModelConfig,
        vocab_size: int,
        compression: CompressionTable | None = None,
        modes: ModelModes = ModelModes(),
    ):
        rows = cfg.padded_vocab_rows(vocab_size)
        super().__init__(
            cfg,
            TokenVocabulary(vocab_size, rows, cfg.d_model, cfg.decoder_chunk_tokens, modes.kernels),
            compression,
            modes,
        )


def model_structure(
    cfg: ModelConfig,
    vocab_size: int,
    codes: torch.Tensor | None = None,
    compression: CompressionTable | None = None,
    modes: ModelModes = ModelModes(),
) -> LanguageModel:
    """The modules of the model ``cfg.variant`` names (its record's builder, ``variants``) in
    ``modes``, their weights not yet initialised (see ``build_model``)."""
    if compression is not None and cfg.engram and compression.vocab_size != vocab_size:
        raise ValueError(
            f"the compression table has {compression.vocab_size} rows, the vocabulary {vocab_size}"
        )
    spec = variant(cfg)
    if spec.needs_signatures and (codes is None or codes.shape[0] != vocab_size):
        raise ValueError(f"{spec.title} needs a signature table with {vocab_size} rows")
    return spec.builder(cfg, vocab_size, codes, compression, modes)


def build_model(
    cfg: ModelConfig,
    vocab_size: int,
    codes: torch.Tensor | None = None,
    compression: CompressionTable | None = None,
    seed: int = 0,
    modes: ModelModes = ModelModes(),
) -> LanguageModel:
    """The model ``cfg.variant`` names, in ``modes``, initialised from ``seed`` (``init``);
    MultiHashFormer needs its signature table's ``codes [V, H]``, a model with ``cfg.engram`` the tokenizer's
    compression table (docs/spec.md §8; ignored without ``cfg.engram``). Parameters on the meta device stay
    uninitialised."""
    model = model_structure(cfg, vocab_size, codes, compression, modes)
    initialise(model, cfg.init_std, seed)
    return model
