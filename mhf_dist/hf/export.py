"""``mhf-dist export-hf``: a checkpoint as a Hugging Face model directory (SPEC §9).

MultiHashFormer runs become ``MultiHashFormerForCausalLM`` (remote code copied
next to the weights: ``AutoModelForCausalLM.from_pretrained(OUT,
trust_remote_code=True)``), whose logits are ``log P_inf``; the weights use the
authors' names, with the signature table as the ``model.hash_map`` buffer.
Standard runs become a plain ``Qwen3ForCausalLM`` (no remote code): its
``embed_tokens`` keeps only the real vocabulary's rows (the rows padding the
table to ``pad_vocab_to`` are never predicted in training), so its softmax is
our ``log P_inf``.

The directory also holds the tokenizer, a generation config and
``mhf_dist.yaml`` (the run config, so ``import-hf`` restores the run exactly).
It is written beside ``OUT`` and renamed into place when complete
(:mod:`mhf_dist.output_dir`).
"""

from __future__ import annotations

from pathlib import Path

import torch
import yaml
from transformers import GenerationConfig, PretrainedConfig, PreTrainedModel, Qwen3Config, Qwen3ForCausalLM

from mhf_dist.config import ConfigError, ModelConfig, RunConfig
from mhf_dist.export import DTYPES, trained_weights
from mhf_dist.hf.configuration_multihashformer import MultiHashFormerConfig
from mhf_dist.hf.layout import EMBED, LM_HEAD, to_export
from mhf_dist.hf.modeling_multihashformer import MultiHashFormerForCausalLM
from mhf_dist.output_dir import check_target, staged
from mhf_dist.signatures import SignatureTable
from mhf_dist.tokenizers import load_tokenizer

RUN_CONFIG = "mhf_dist.yaml"
MAX_POSITIONS = 32768  # RoPE has no learned positions; this only sizes static caches


def hf_config(model: ModelConfig, vocab_size: int, tokenizer, table: SignatureTable | None) -> PretrainedConfig:
    """The Qwen3 config of ``model`` (+ the authors' hash keys for MultiHashFormer)."""
    common = dict(
        vocab_size=vocab_size, hidden_size=model.d_model, intermediate_size=model.ffn_dim,
        num_hidden_layers=model.n_layers, num_attention_heads=model.n_heads, num_key_value_heads=model.n_kv_heads,
        head_dim=model.resolved_head_dim, hidden_act="silu", rms_norm_eps=model.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": model.rope_theta},
        max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=True, attention_bias=False,
        initializer_range=model.init_std, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    if table is None:
        return Qwen3Config(**common)
    h = model.hash
    return MultiHashFormerConfig(
        **common, num_hashes=h.num_hashes, num_buckets=h.num_buckets, bottle_neck_dim=h.gate_dim,
        mixer_dim=None if h.mixer_dim == h.gate_dim else h.mixer_dim, num_lsh=0,
        signature_rule=table.hashing_rule(),
    )


def build_hf_model(cfg: RunConfig, state: dict[str, torch.Tensor], tokenizer,
                   table: SignatureTable | None) -> PreTrainedModel:
    """Our full state dict -> the Hugging Face model holding the same weights."""
    vocab_size = len(tokenizer)
    config = hf_config(cfg.model, vocab_size, tokenizer, table)
    weights = to_export(state, table.codes if table is not None else None)
    if table is None:  # Standard: only the real vocabulary's rows
        weights[EMBED] = weights[LM_HEAD] = weights[EMBED][:vocab_size]
        model = Qwen3ForCausalLM(config)
    else:
        model = MultiHashFormerForCausalLM(config)
        model.register_for_auto_class("AutoModelForCausalLM")
        config.register_for_auto_class()
    model.load_state_dict(weights, strict=True)
    model.tie_weights()
    return model.eval()


def export_hf(checkpoint: str | Path, out: str | Path, dtype: str = "fp32", overwrite: bool = False) -> Path:
    out = check_target(out, [checkpoint], overwrite)
    trained = trained_weights(checkpoint)
    run, cfg = trained.run, trained.cfg
    if cfg.model.engram is not None:
        raise ConfigError("export-hf: the authors' layout (SPEC §9) has no Engram memory; export the full state dict "
                          "with `mhf-dist export` instead")
    tokenizer = load_tokenizer(run.tokenizer_source(cfg))
    table = SignatureTable.load(run.signatures_dir) if cfg.model.variant == "mhf" else None
    model = build_hf_model(cfg, trained.state, tokenizer, table).to(DTYPES[dtype])

    with staged(out) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id).save_pretrained(tmp)
        (tmp / RUN_CONFIG).write_text(yaml.safe_dump(cfg.model_dump(mode="json") | {"exported_step": trained.step},
                                                     sort_keys=False))
    return out
