"""Hugging Face config of an exported MultiHashFormer (hash-signature language model).

A Qwen3 config plus the authors' hash keys (``num_hashes``, ``num_buckets``, ``bottle_neck_dim``, ``num_lsh = 0``,
``use_conditional_prob``, ``lsh_only_embed``, ``fused_decoding``), so the same ``config.json`` loads in their
``qwen3_hashformer`` code and in ours, and three of ours: ``mixer_dim`` (the cascade mixers' width when it differs
from ``bottle_neck_dim``), ``signature_rule`` (what rebuilds ``hash_map`` exactly: coordinate i of token w is
``mmh3.hash128(w, seed=seeds[i]) % (B - 1) + 1``, a taken signature re-hashes its last coordinate with seeds
``seeds[-1] + k``; docs/spec.md §1) and ``inference_temperature`` (``τ`` of the logits ``log_softmax(τ · log P_inf)``;
1: ``log P_inf``). Every key: docs/spec.md §9.

This file is copied next to the weights by ``mhf-dist export-hf`` and loaded with ``trust_remote_code=True``: it
imports only torch and transformers.
"""

from transformers.models.qwen3.configuration_qwen3 import Qwen3Config


class MultiHashFormerConfig(Qwen3Config):
    # The authors' type: their code reads this config.json unchanged, and AutoTokenizer (which reads the
    # config too) needs no remote code. AutoModelForCausalLM takes our class from auto_map.
    model_type = "qwen3"

    num_hashes: int = 4
    num_buckets: int = 16384
    bottle_neck_dim: int = 64
    mixer_dim: int | None = None
    num_lsh: int = 0
    use_conditional_prob: bool = True
    lsh_only_embed: bool = False
    fused_decoding: bool = False
    signature_rule: dict | None = None  # ours: how hash_map was built (seeds, uniqueness, pad id)
    inference_temperature: float = 1.0  # ours: τ of the logits log_softmax(τ · log P_inf)
