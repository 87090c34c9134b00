"""Hugging Face config of an exported MultiHashFormer (hash-signature language model).

A Qwen3 config plus the authors' hash keys (``num_hashes``, ``num_buckets``,
``bottle_neck_dim``, ``num_lsh = 0``, ``use_conditional_prob``,
``lsh_only_embed``, ``fused_decoding``), so the same ``config.json`` loads in
their ``qwen3_hashformer`` code and in ours. ``mixer_dim`` is ours: the
cascade mixers' width when it differs from the gate's ``bottle_neck_dim``;
``signature_rule`` records how ``hash_map`` was built: coordinate i of token w
(its vocabulary string) is ``mmh3.hash128(w, seed=seeds[i]) % (B - 1) + 1``;
tokens register in id order, and one whose full signature is already taken
re-hashes its last coordinate with seeds ``seeds[-1] + k`` (k = 1, 2, ...)
until it is free (``unique``); the pad token's row is all zeros. So an import
restores the signature table exactly. ``inference_temperature`` is
ours too: ``τ`` of the calibrated logits ``log_softmax(τ · log P_inf)``
(1: ``log P_inf``; see the modeling file).

This file is copied next to the weights by ``mhf-dist export-hf`` and loaded
with ``trust_remote_code=True``: it imports only torch and transformers.
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
