"""``mhf-dist export-hf``: a checkpoint as a Hugging Face model directory (docs/spec.md §9).

A MultiHashFormer run becomes ``MultiHashFormerForCausalLM`` (remote code copied next to the weights), whose logits
are ``log P_inf``, in the authors' names (``mhf_dist.hf.names``); a Standard run a plain ``Qwen3ForCausalLM`` with
only the real vocabulary's rows. The classes are the variant's (``mhf_dist.model.variants.HFNames``).
``--inference-temperature`` makes an MHF model's logits ``log_softmax(τ · log P_inf)`` (``auto``:
``fitted_temperature``); a Standard model refuses ``τ ≠ 1``. The directory also holds the tokenizer, a generation
config and ``mhf_dist.yaml`` (the run config), and is written through ``mhf_dist.storage.output_dir``. The command
and why: docs/models.md, "Export".
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import yaml
from transformers import (
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from mhf_dist.config import ConfigError, ModelConfig, RunConfig
from mhf_dist.data.formats import MANIFEST
from mhf_dist.hf.configuration_multihashformer import MultiHashFormerConfig
from mhf_dist.hf.modeling_multihashformer import MultiHashFormerForCausalLM
from mhf_dist.hf.names import EMBED, LM_HEAD, to_export
from mhf_dist.model.dtypes import DTYPES
from mhf_dist.model.variants import variant
from mhf_dist.storage.output_dir import check_target, staged
from mhf_dist.train.trained_weights import TrainedWeights, check_source, trained_weights
from mhf_dist.vocab.signatures import SignatureTable
from mhf_dist.vocab.tokenizers import load_tokenizer

RUN_CONFIG = "mhf_dist.yaml"
MAX_POSITIONS = 32768  # RoPE has no learned positions; this only sizes static caches
HF_CLASSES = {
    cls.__name__: cls
    for cls in (Qwen3Config, Qwen3ForCausalLM, MultiHashFormerConfig, MultiHashFormerForCausalLM)
}  # a variant's HFNames name them


def hf_config(
    model: ModelConfig,
    vocab_size: int,
    tokenizer,
    table: SignatureTable | None,
    inference_temperature: float = 1.0,
    document_masking: bool = False,
) -> PretrainedConfig:
    """The Qwen3 config of ``model`` (+ the authors' hash keys and our ``inference_temperature`` for
    MultiHashFormer; ``document_masking: true`` for a run trained with ``data.document_masking``, which ``eval``
    reads to score documents apart)."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=model.d_model,
        intermediate_size=model.ffn_dim,
        num_hidden_layers=model.n_layers,
        num_attention_heads=model.n_heads,
        num_key_value_heads=model.n_kv_heads,
        head_dim=model.resolved_head_dim,
        hidden_act="silu",
        rms_norm_eps=model.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": model.rope_theta},
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        attention_bias=False,
        initializer_range=model.init_std,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    if document_masking:
        common["document_masking"] = True
    config_class = HF_CLASSES[variant(model).hf.config_class]
    if table is None:
        return config_class(**common)
    h = model.hash
    return config_class(
        **common,
        num_hashes=h.num_hashes,
        num_buckets=h.num_buckets,
        bottle_neck_dim=h.gate_dim,
        mixer_dim=None if h.mixer_dim == h.gate_dim else h.mixer_dim,
        num_lsh=0,
        signature_rule=table.hashing_rule(),
        inference_temperature=inference_temperature,
    )


def build_hf_model(
    cfg: RunConfig, state: dict[str, torch.Tensor], tokenizer, table: SignatureTable | None
) -> PreTrainedModel:
    """Our full state dict -> the Hugging Face model holding the same weights."""
    vocab_size, names = len(tokenizer), variant(cfg).hf
    if not names.remote_code and cfg.inference.temperature != 1:
        raise ConfigError(
            f"inference temperature {cfg.inference.temperature:g}: a Standard model exports as a plain "
            "Qwen3ForCausalLM, whose logits cannot apply a temperature without custom code; export with 1 "
            f"(--inference-temperature 1) and sample at temperature {1 / cfg.inference.temperature:.4g} instead"
        )
    config = hf_config(
        cfg.model,
        vocab_size,
        tokenizer,
        table,
        cfg.inference.temperature,
        document_masking=cfg.data.document_masking,
    )
    weights = to_export(state, table.codes if table is not None else None)
    if table is None:  # Standard: only the real vocabulary's rows
        weights[EMBED] = weights[LM_HEAD] = weights[EMBED][:vocab_size]
    model = HF_CLASSES[names.architecture](config)
    if names.remote_code:
        model.register_for_auto_class("AutoModelForCausalLM")
        config.register_for_auto_class()
    model.load_state_dict(weights, strict=True)
    model.tie_weights()
    return model.eval()


def parse_temperature(value: str | float) -> float:
    """A ``--inference-temperature`` number: finite and > 0."""
    try:
        tau = float(value)
    except ValueError:
        tau = math.nan
    if not (math.isfinite(tau) and tau > 0):
        raise ConfigError(
            f"--inference-temperature {value}: use a number > 0 (1: log P_inf itself) or auto"
        )
    return tau


def fitted_temperature(
    trained: TrainedWeights, tokenizer, table: SignatureTable | None
) -> tuple[float, str]:
    """``--inference-temperature auto``: ``(τ, where it comes from)``: the newest ``val_temperature`` of the run's
    ``metrics.jsonl`` at or before the checkpoint's step, else one fitted on the run's validation split."""
    from mhf_dist.train.metrics import read_metrics

    logged = [
        r
        for r in read_metrics(trained.run.path)
        if "val_temperature" in r and r["step"] <= trained.step
    ]
    if logged:
        return float(logged[-1]["val_temperature"]), f"val_temperature of step {logged[-1]['step']}"
    cfg = trained.cfg
    shards = Path(cfg.data.shard_dir) if cfg.data.shard_dir is not None else trained.run.data_dir
    manifest = shards / MANIFEST
    if not manifest.is_file() or "val" not in json.loads(manifest.read_text()).get("splits", {}):
        raise ConfigError(
            f"--inference-temperature auto: {trained.run.path / 'metrics.jsonl'} holds no "
            f"val_temperature up to step {trained.step} and {shards} has no validation split to fit "
            "one on; pass a number (mhf-dist eval --calibrate fits one)"
        )
    from mhf_dist.hf.evaluation import SplitPasses
    from mhf_dist.model.calibration import fit_temperature

    model = build_hf_model(cfg, trained.state, tokenizer, table)
    with torch.no_grad():
        fit = fit_temperature(
            SplitPasses(
                model,
                tokenizer,
                shards,
                split="val",
                max_sequences=cfg.train.eval_sequences,
                batch_size=8,
            )
        )
    return fit.temperature, f"fitted on {fit.tokens} tokens of {shards}'s validation split"


def export_hf(
    checkpoint: str | Path,
    out: str | Path,
    dtype: str = "fp32",
    overwrite: bool = False,
    inference_temperature: str | float | None = None,
) -> Path:
    """``inference_temperature``: a number, ``"auto"`` (``fitted_temperature``) or None (the run config's)."""
    check_source(checkpoint)  # first: a path that holds no model is named as such
    out = check_target(out, [checkpoint], overwrite)
    trained = trained_weights(checkpoint)
    run, cfg = trained.run, trained.cfg
    if cfg.model.engram is not None:
        raise ConfigError(
            "export-hf: the authors' layout (docs/spec.md §9) has no Engram memory; export the full "
            "state dict with `mhf-dist export` instead"
        )
    tokenizer = load_tokenizer(run.tokenizer_source(cfg))
    table = SignatureTable.load(run.signatures_dir) if variant(cfg).needs_signatures else None
    if inference_temperature is not None:
        if str(inference_temperature) == "auto" and not variant(cfg).hf.remote_code:
            raise ConfigError(
                "--inference-temperature auto: a Standard model exports as a plain Qwen3ForCausalLM, "
                "which cannot apply a temperature; its fitted τ (val_temperature) is near 1 anyway"
            )
        tau, source = (
            fitted_temperature(trained, tokenizer, table)
            if str(inference_temperature) == "auto"
            else (parse_temperature(inference_temperature), "given")
        )
        print(f"inference temperature {tau:.6g} ({source})")
        cfg = RunConfig.model_validate(
            cfg.model_dump(mode="json") | {"inference": {"temperature": tau}}
        )
    model = build_hf_model(cfg, trained.state, tokenizer, table).to(DTYPES[dtype])

    with staged(out) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        GenerationConfig(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ).save_pretrained(tmp)
        (tmp / RUN_CONFIG).write_text(
            yaml.safe_dump(
                cfg.model_dump(mode="json") | {"exported_step": trained.step}, sort_keys=False
            )
        )
    return out
