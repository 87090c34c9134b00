"""The exported layout adapter (docs/spec.md §9): names, shapes and an exact round trip."""

from __future__ import annotations

import torch

from mhf_dist.config import load_config
from mhf_dist.hf.names import from_export, to_export
from mhf_dist.model import build_model
from mhf_dist.vocab.signatures import SignatureTable


def test_mhf_export_names_are_the_authors():
    cfg = load_config("tiny-h4b16k", overrides=["model.hash.num_buckets=32"]).model
    table = SignatureTable.build([f"t{i}" for i in range(50)], 4, 32)
    model = build_model(cfg, 50, table.codes)
    exported = to_export(model.state_dict(), table.codes)
    expected = (
        {
            "model.embed_tokens.weight",
            "lm_head.weight",
            "model.hash_map",
            "model.norm.weight",
            "model.combiner.scorer.0.weight",
            "model.combiner.scorer.0.bias",
            "model.combiner.scorer.2.weight",
            "model.combiner.scorer.2.bias",
            "model.combiner.output_proj.0.weight",
            "model.combiner.output_proj.0.bias",
        }
        | {
            f"hash_head.cascade_mixer.{k}.{j}.{p}"
            for k in range(3)
            for j in (0, 2)
            for p in ("weight", "bias")
        }
        | {
            f"model.layers.{i}.{n}.weight"
            for i in range(2)
            for n in (
                "self_attn.q_proj",
                "self_attn.k_proj",
                "self_attn.v_proj",
                "self_attn.o_proj",
                "self_attn.q_norm",
                "self_attn.k_norm",
                "mlp.gate_proj",
                "mlp.up_proj",
                "mlp.down_proj",
                "input_layernorm",
                "post_attention_layernorm",
            )
        }
    )
    assert set(exported) == expected
    emb = exported["model.embed_tokens.weight"]
    assert emb.shape == (4 * 32, 64)
    # head k's rows at offset k·B
    assert torch.equal(emb[2 * 32 + 5], model.vocab.tables.weight[2, 5])
    assert exported["lm_head.weight"] is emb
    assert exported["model.hash_map"].dtype == torch.int64

    back, codes = from_export(exported, num_tables=4)
    assert back.keys() == model.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())
    assert torch.equal(codes, table.codes)


def test_standard_exports_as_plain_qwen3():
    model = build_model(load_config("tiny-standard").model, 200)
    exported = to_export(model.state_dict())
    assert exported["model.embed_tokens.weight"].shape == (256, 64)
    assert not any(
        k.startswith(("hash_head", "model.combiner", "model.hash_map")) for k in exported
    )
    back, codes = from_export(exported, num_tables=1)
    assert codes is None and all(torch.equal(back[k], v) for k, v in model.state_dict().items())
