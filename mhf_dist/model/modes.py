"""How a model runs, beside its ``mhf_dist.config.ModelConfig``: fixed when it is built and never switched on it
afterwards. Besides how it computes (checkpointing, kernels), how it reads a row of packed documents
(``document_eos``, from ``data.document_masking``): its weights are the same either way. What one forward measures
besides its loss (the heads' entropies) is that forward's argument."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class ModelModes:
    # every k-th backbone block recomputes its activations in backward; 0: none (the backend's choice from
    # parallel.activation_checkpoint_interval and its config; a pipeline checkpoints its blocks at the same interval)
    checkpoint_interval: int = 0
    # how the fused decoder head's elementwise passes run (train.fused_head_kernel, fused_head.KernelPolicy)
    kernels: Literal["auto", "compiled", "eager"] = "auto"
    # data.document_masking: the tokenizer's EOS id, which ends each document packed in a row; the documents then do
    # not see each other (mhf_dist.model.documents). None: a row is one sequence
    document_eos: int | None = None
