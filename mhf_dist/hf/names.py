"""State-dict names: ours, and the one adapter to and from the exported layout (docs/spec.md §9).

Our checkpoints store ``LanguageModel.state_dict()`` names. The exported layout is the authors' (``HUIYINXUE/MHF``,
``qwen3_hashformer/modeling_qwen3.py``), so their checkpoints import without converting weights and ours load in
their code. ``to_export`` and ``from_export`` rename by prefix and reshape the stacked tables, ``[H, B, d]`` ours,
``[H·B, d]`` exported (head k at rows k·B), with the signature table as the ``model.hash_map`` buffer. Every name,
both ways, the Standard model's and the Engram memories': docs/models.md, "Export".
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
            return dst + name[len(src) :]
    if direction > 0:
        raise KeyError(f"no exported name for parameter {name!r}")
    raise HFImportError(
        f"unexpected key {name!r} in the weights: not the authors' qwen3_hashformer layout (docs/spec.md §9)"
    )


def to_export(
    state: dict[str, torch.Tensor], codes: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
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


def from_export(
    state: dict[str, torch.Tensor], num_tables: int
) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """The authors' layout -> (our state dict, signature codes or None). ``lm_head`` must equal the table if present."""
    out, codes = {}, None
    for name, tensor in state.items():
        if name == EMBED:
            out[TABLES] = tensor.reshape(num_tables, -1, tensor.shape[-1])
        elif name == LM_HEAD:
            if EMBED in state and not torch.equal(tensor, state[EMBED]):
                raise HFImportError(
                    "lm_head.weight differs from model.embed_tokens.weight: the tables must be tied"
                )
        elif name == HASH_MAP:
            codes = tensor.to(torch.int32)
        else:
            out[_rename(name, -1)] = tensor
    return out, codes
