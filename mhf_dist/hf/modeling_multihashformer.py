"""Hugging Face model of an exported MultiHashFormer (hash-signature language model), built on transformers' Qwen3
layers: only the input map and the output head are new (docs/spec.md §1–§5; names: §9, the authors').

Every token ``w`` has a signature ``hash_map[w]`` of ``H`` buckets in ``1..B-1``, one in each table ``E_i [B, d]``.
Input (``ContextualGatingCombiner``): the token's H rows fused by a gate that sees only them. Output (the tables tied
with the input): H heads' softmaxes ``p_i`` over the B buckets, a ``CascadeMixer`` between heads reading the
previous head's soft retrieval ``E_iᵀ p_i``. The ``logits`` are ``log P_inf`` over the real vocabulary,
``Σ_i log p_i[hash_map[w, i]]`` renormalised over the registered tokens (the rest ``-inf``), so ``generate()``, the
KV cache and lm-evaluation-harness work unchanged; ``config.inference_temperature`` ``τ ≠ 1`` makes them the
calibrated ``log_softmax(τ · log P_inf)``.

Copied next to the weights by ``mhf-dist export-hf`` (``trust_remote_code=True``), it imports only torch and
transformers: the standalone counterpart of ``mhf_dist.model``, which a test holds it equal to.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin
from transformers.activations import ACT2FN
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.qwen3.modeling_qwen3 import Qwen3Model, Qwen3PreTrainedModel

from .configuration_multihashformer import MultiHashFormerConfig


class ContextualGatingCombiner(nn.Module):
    """The input gate: ``α = softmax_i(σ(u_i W1 + b1) W2 + b2)``, ``e = (Σ_i α_i u_i) W_s + b_s``, over a token's
    H bucket vectors ``u_i`` (``scorer`` is ``W1, σ, W2``; ``output_proj`` is ``W_s``)."""

    def __init__(self, config: MultiHashFormerConfig):
        super().__init__()
        d = config.hidden_size
        self.scorer = nn.Sequential(
            nn.Linear(d, config.bottle_neck_dim),
            ACT2FN[config.hidden_act],
            nn.Linear(config.bottle_neck_dim, 1),
        )
        self.output_proj = nn.Sequential(nn.Linear(d, d))

    def forward(self, bucket_vectors: torch.Tensor) -> torch.Tensor:
        weights = self.scorer(bucket_vectors).softmax(dim=-2)
        return self.output_proj((weights * bucket_vectors).sum(dim=-2))


class CascadeMixer(nn.Module):
    """The cascaded decoder: head i's bucket log-probs ``log softmax(E_i c_i)``, then one of the H-1 mixers
    ``c_{i+1} = c_i + W_up σ(W_dn [c_i ; ē_i] + b_dn) + b_up`` with ``ē_i = E_iᵀ p_i``."""

    def __init__(self, config: MultiHashFormerConfig):
        super().__init__()
        d, r = config.hidden_size, config.mixer_dim or config.bottle_neck_dim
        self.num_hashes, self.num_buckets = config.num_hashes, config.num_buckets
        self.cascade_mixer = nn.ModuleList(
            nn.Sequential(nn.Linear(2 * d, r), ACT2FN[config.hidden_act], nn.Linear(r, d))
            for _ in range(config.num_hashes - 1)
        )

    def forward(self, c: torch.Tensor, tables: torch.Tensor) -> list[torch.Tensor]:
        """``c [..., d]``, ``tables [H·B, d]`` -> per head ``log p_i [..., B]`` in fp32."""
        log_probs = []
        for i in range(self.num_hashes):
            table = tables[i * self.num_buckets : (i + 1) * self.num_buckets]
            logp = F.log_softmax((c @ table.t()).float(), dim=-1)
            log_probs.append(logp)
            if i < self.num_hashes - 1:
                soft = logp.exp().to(c.dtype) @ table  # ē_i = E_iᵀ p_i
                c = c + self.cascade_mixer[i](torch.cat([c, soft], dim=-1))
        return log_probs


class MultiHashFormerModel(Qwen3Model):
    """Qwen3 whose input embedding is the gated fusion of each token's H bucket rows (``hash_map`` gives them)."""

    config_class = MultiHashFormerConfig

    def __init__(self, config: MultiHashFormerConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.num_hashes * config.num_buckets, config.hidden_size)
        self.combiner = ContextualGatingCombiner(config)
        self.register_buffer(
            "hash_map", torch.zeros(config.vocab_size, config.num_hashes, dtype=torch.long)
        )
        self.post_init()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        offsets = (
            torch.arange(self.config.num_hashes, device=input_ids.device) * self.config.num_buckets
        )
        return self.combiner(self.embed_tokens(self.hash_map[input_ids] + offsets))

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs,
    ):
        if inputs_embeds is None and input_ids is not None:
            inputs_embeds = self.embed(input_ids)
        return super().forward(inputs_embeds=inputs_embeds, **kwargs)


class MultiHashFormerForCausalLM(Qwen3PreTrainedModel, GenerationMixin):
    config_class = MultiHashFormerConfig
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: MultiHashFormerConfig):
        super().__init__(config)
        self.model = MultiHashFormerModel(config)
        self.lm_head = nn.Linear(
            config.hidden_size, config.num_hashes * config.num_buckets, bias=False
        )
        self.hash_head = CascadeMixer(config)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def log_p_inf(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-norm output ``[..., d]`` -> ``log P_inf [..., V]`` (fp32), or ``log P_τ`` with the config's
        ``inference_temperature`` ``τ ≠ 1`` (module docstring)."""
        hash_map = self.model.hash_map
        log_probs = self.hash_head(hidden, self.lm_head.weight)
        score = sum(logp[..., hash_map[:, i]] for i, logp in enumerate(log_probs))
        score = score.masked_fill(~(hash_map != 0).any(dim=1), float("-inf"))
        temperature = getattr(self.config, "inference_temperature", 1.0)
        if temperature != 1:  # log P_inf = score - const, so τ·score renormalised is log P_τ
            score = score * temperature
        return F.log_softmax(score, dim=-1)

    def forward(
        self, input_ids=None, labels=None, logits_to_keep: int | torch.Tensor = 0, **kwargs
    ):
        outputs = self.model(input_ids=input_ids, **kwargs)
        hidden = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.log_p_inf(hidden[:, keep])
        loss = None
        if labels is not None:
            loss = self.loss_function(
                logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs
            )
        extra = {k: v for k, v in outputs.items() if k != "last_hidden_state"}
        return CausalLMOutputWithPast(loss=loss, logits=logits, **extra)
