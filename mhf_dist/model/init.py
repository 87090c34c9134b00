"""Initial weights: one rule per parameter name, one random stream per parameter (a function of the seed alone).

| parameter (name ends with)                           | initial value                           |
|------------------------------------------------------|-----------------------------------------|
| ``tables.weight`` (bucket tables, memory tables)     | Normal(0, ``init_std``), table by table |
| ``...norm.weight`` (every RMSNorm gain)              | ones                                    |
| ``.bias`` (gate, decoder mixers)                     | zeros                                   |
| any other ``.weight`` (linear maps, convolutions)    | Normal(0, ``init_std``)                 |

(the distributions the model has always used). A parameter's random values come from its own
``torch.Generator`` (CPU), seeded from ``(seed, name)``; the stacked tables ``[T, R, d]`` draw each table
``E_i`` from its own stream ``(seed, name, i)``, so no rank ever draws more than one table. The values are a
function of the seed, the parameter's name and its full shape only — not of the order in which modules
are built, nor of which rank builds which part — so every layout (tp × pp × dp) starts from the same
weights, and a rank that holds a shard draws the full parameter (one table, for stacked tables) and
keeps its slice (:func:`initial_shard`).
"""

from __future__ import annotations

import hashlib
import math
import re

import torch
from torch import nn

from mhf_dist.model.host_tables import HostTables

RULES: list[tuple[re.Pattern, str]] = [(re.compile(p), rule) for p, rule in (
    (r"(.*\.)?tables\.weight", "tables"),
    (r"(.*\.)?\w*norm\.weight", "ones"),
    (r".*\.bias", "zeros"),
    (r".*\.weight", "normal"),
)]


def rule_for(name: str) -> str:
    rule = next((r for pattern, r in RULES if pattern.fullmatch(name)), None)
    if rule is None:
        raise ValueError(f"no initialisation rule for parameter {name}; add one to mhf_dist.model.init.RULES")
    return rule


def stream(seed: int, name: str, index: int | None = None) -> torch.Generator:
    """The CPU generator of parameter ``name`` (table ``index`` of a stack), seeded from ``(seed, name, index)``."""
    key = f"{seed}/{name}" + ("" if index is None else f"/{index}")
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


def draw_size(name: str, full_shape: tuple[int, ...]) -> int:
    """Elements drawn at once for parameter ``name``: one table of a stack, else the whole parameter."""
    rule = rule_for(name)
    return 0 if rule in ("ones", "zeros") else math.prod(full_shape[1:] if rule == "tables" else full_shape)


def _draw(out: torch.Tensor, shape, std: float, generator: torch.Generator, keep,
          buffer: torch.Tensor | None) -> None:
    """``out <- keep(N(0, std²) of ``shape``)``, drawn on the CPU: straight into ``out`` when it is that whole
    draw (contiguous fp32 CPU), else into ``buffer`` (CPU fp32, reused between calls) or a new tensor."""
    if keep is None and out.device.type == "cpu" and out.dtype == torch.float32 and out.is_contiguous() \
            and tuple(out.shape) == tuple(shape):
        out.normal_(0.0, std, generator=generator)
        return
    numel = math.prod(shape)
    value = buffer[:numel].view(shape) if buffer is not None and buffer.numel() >= numel else torch.empty(shape)
    value.normal_(0.0, std, generator=generator)
    out.copy_(value if keep is None else keep(value))


@torch.no_grad()
def initial_shard(name: str, full_shape: torch.Size | tuple[int, ...], out: torch.Tensor, std: float, seed: int,
                  dim: int | None = None, rank: int = 0, parts: int = 1, buffer: torch.Tensor | None = None) -> None:
    """Write into ``out`` chunk ``rank`` of ``parts`` along ``dim`` (the whole parameter when ``dim`` is None) of
    parameter ``name``'s initial value, whose full shape is ``full_shape``. At most one full table (stacks) or one
    full parameter (otherwise) is drawn at a time besides ``out``, into ``buffer`` when it holds
    :func:`draw_size` elements."""
    rule = rule_for(name)
    if rule in ("ones", "zeros"):
        out.fill_(1.0 if rule == "ones" else 0.0)
        return
    full_shape = tuple(full_shape)
    if rule == "tables":  # [T, R, d]: one stream per table
        tables = list(range(full_shape[0]))
        if dim == 0:
            tables = [int(i) for i in torch.arange(full_shape[0]).chunk(parts)[rank]]
        keep = None if dim in (None, 0) else (lambda table: table.chunk(parts, dim - 1)[rank])
        for j, i in enumerate(tables):
            _draw(out[j], full_shape[1:], std, stream(seed, name, i), keep, buffer)
        return
    _draw(out, full_shape, std, stream(seed, name), None if dim is None else (lambda v: v.chunk(parts, dim)[rank]),
          buffer)


def host_tables(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{name: weight}`` of the Engram tables kept in host memory (``model.engram.offload``): tensors, not
    parameters, initialised by the same rule as the device tables they replace."""
    return {f"{prefix}.weight": module.weight for prefix, module in model.named_modules()
            if isinstance(module, HostTables)}


def initialise(model: nn.Module, std: float, seed: int) -> None:
    """Every parameter of a full (unsharded) model from its rule, host tables included; parameters on the meta
    device are skipped."""
    for name, param in model.named_parameters():
        if not param.is_meta:
            initial_shard(name, param.shape, param.data, std, seed)
    for name, weight in host_tables(model).items():
        initial_shard(name, weight.shape, weight, std, seed)
