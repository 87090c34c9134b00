"""State-dict names: ours, and the one adapter to and from the exported layout (docs/spec.md §9).

Our checkpoints store ``LanguageModel.state_dict()`` names. The exported layout
is the authors' (``HUIYINXUE/MHF``, ``qwen3_hashformer/modeling_qwen3.py``), so
their checkpoints import without converting weights and ours load in their code.

=========================================  ==============================================  =====================
ours                                       exported                                        shape change
=========================================  ==============================================  =====================
``vocab.tables.weight`` ``[H, B, d]``      ``model.embed_tokens.weight`` ``[H·B, d]``      head k at rows k·B…
                                           ``lm_head.weight`` (tied: same tensor)
``vocab.encoder.scorer.{0,2}.*``           ``model.combiner.scorer.{0,2}.*``
``vocab.encoder.output_proj.0.*``          ``model.combiner.output_proj.0.*``
``backbone.layers.{i}.<qwen3 names>``      ``model.layers.{i}.<qwen3 names>``
``backbone.norm.weight``                   ``model.norm.weight``
``vocab.decoder.cascade_mixer.{k}.{0,2}.*````hash_head.cascade_mixer.{k}.{0,2}.*``
signature table ``codes`` ``[V, H]``       ``model.hash_map`` ``[V, H]`` int64 buffer
=========================================  ==============================================  =====================

Qwen3 layer names: ``self_attn.{q,k,v,o}_proj.weight``, ``self_attn.{q,k}_norm.weight``,
``mlp.{gate,up,down}_proj.weight``, ``input_layernorm.weight``,
``post_attention_layernorm.weight``. The Standard model is a plain Qwen3:
``vocab.tables.weight [1, R, d]`` becomes ``model.embed_tokens.weight [R, d]`` and the tied
``lm_head.weight``; it has no encoder, mixers or hash map. Engram memories (docs/spec.md §8) export under their
layer, ``model.layers.{i}.engram.*``; the authors' code has no such module.
"""

from __future__ import annotations

import torch

from mhf_dist.errors import MhfError

_PREFIXES = [  # (ours, exported)
    ("vocab.encoder.", "model.combiner."),
    ("backbone.layers.", "model.layers."),
    ("backbone.norm.", "model.norm."),
    ("vocab.decoder.", "hash_head."),
]


class HFImportError(MhfError, ValueError):
    """Weights in the exported layout cannot be imported; the message names the problem and the fix."""


TABLES, EMBED = "vocab.tables.weight", "model.embed_tokens.weight"
LM_HEAD, HASH_MAP = "lm_head.weight", "model.hash_map"


def _rename(name: str, direction: int) -> str:
    for ours, theirs in _PREFIXES:
        src, dst = (ours, theirs) if direction > 0 else (theirs, ours)
        if name.startswith(src):
            return dst + name[len(src):]
    if direction > 0:
        raise KeyError(f"no exported name for parameter {name!r}")
    raise HFImportError(
        f"unexpected key {name!r} in the weights: not the authors' qwen3_hashformer layout (docs/spec.md §9)")


def to_export(state: dict[str, torch.Tensor], codes: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Our state dict (+ signature ``codes`` for MHF) -> the authors' names and shapes."""
    out = {}
    for name, tensor in state.items():
        if name == TABLES:
            out[EMBED] = tensor.reshape(-1, tensor.shape[-1])
            out[LM_HEAD] = out[EMBED]
        else:
            out[_rename(name, +1)] = tensor
    if codes is not None:
        out[HASH_MAP] = codes.to(torch.int64)
    return out


def from_export(state: dict[str, torch.Tensor], num_tables: int) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """The authors' layout -> (our state dict, signature codes or None). ``lm_head`` must equal the table if present."""
    out, codes = {}, None
    for name, tensor in state.items():
        if name == EMBED:
            out[TABLES] = tensor.reshape(num_tables, -1, tensor.shape[-1])
        elif name == LM_HEAD:
            if EMBED in state and not torch.equal(tensor, state[EMBED]):
                raise HFImportError("lm_head.weight differs from model.embed_tokens.weight: the tables must be tied")
        elif name == HASH_MAP:
            codes = tensor.to(torch.int32)
        else:
            out[_rename(name, -1)] = tensor
    return out, codes
