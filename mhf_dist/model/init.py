"""Initial weights: one rule per parameter name (``RULES``), random values in fixed blocks, each block from its own
stream (``stream``), so the values are a function of the seed, the parameter's name and its full shape alone.

Tables (``tables.weight``: bucket and memory tables, table by table) and any other ``.weight`` (linear maps,
convolutions) are Normal(0, ``init_std``), RMSNorm gains (``...norm.weight``) ones, biases zeros. A parameter's
flattened value (each table's, for a stack ``[T, R, d]``) is cut into blocks of ``BLOCK`` elements, each drawn whole
from a CPU generator seeded from ``(seed, name[, table][, block])``. ``initial_shard`` writes any part of a parameter,
its tensor-parallel chunk or that chunk's ZeRO-3 range from ``start``, drawing only the blocks that hold it;
``initialise`` fills a whole model, ``host_tables`` finds the host-memory tables. Why, and what a rank draws:
docs/design-model.md, "Model construction".
"""

from __future__ import annotations

import hashlib
import math
import re

import torch
from torch import nn

from mhf_dist.model.host_tables import HostTables

# Elements per block of a parameter's flattened value (4 MiB in fp32). A parameter (a table of a stack) of at most
# this many elements is one block — every parameter of the tiny presets, the bucket tables of tiny-h4b16k exactly —
# drawn from one stream as it always was; changing it changes the initial weights of every larger one.
BLOCK = 2**20

RULES: list[tuple[re.Pattern, str]] = [
    (re.compile(p), rule)
    for p, rule in (
        (r"(.*\.)?tables\.weight", "tables"),
        (r"(.*\.)?\w*norm\.weight", "ones"),
        (r".*\.bias", "zeros"),
        (r".*\.weight", "normal"),
    )
]


def rule_for(name: str) -> str:
    rule = next((r for pattern, r in RULES if pattern.fullmatch(name)), None)
    if rule is None:
        raise ValueError(
            f"no initialisation rule for parameter {name}; add one to mhf_dist.model.init.RULES"
        )
    return rule


def stream(seed: int, name: str, index: int | None = None, block: int = 0) -> torch.Generator:
    """The CPU generator of block ``block`` of parameter ``name`` (table ``index`` of a stack), seeded from
    ``(seed, name, index, block)``; block 0's key leaves the block out."""
    key = f"{seed}/{name}" + ("" if index is None else f"/{index}") + (f"#{block}" if block else "")
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


def draw_block(
    out: torch.Tensor, std: float, seed: int, name: str, index: int | None, block: int
) -> None:
    """``out`` (contiguous fp32 on the CPU, the block's full length) <- block ``block`` of the stream's value."""
    out.normal_(0.0, std, generator=stream(seed, name, index, block))


def draw_size(name: str, full_shape: tuple[int, ...]) -> int:
    """Elements drawn at once for parameter ``name``: one block (of one table, for a stack), 0 for the constants."""
    rule = rule_for(name)
    if rule in ("ones", "zeros"):
        return 0
    return min(BLOCK, math.prod(full_shape[1:] if rule == "tables" else full_shape))


class _Chunk:
    """Chunk ``rank`` of ``parts`` along ``dim`` (as ``torch.chunk``) of a value of ``shape``, flattened: its element
    ``j`` is element ``full(j)`` of the flattened value. The chunk is a run of ``width`` elements in each ``row`` of
    ``stride`` elements, beginning ``offset`` elements into the row."""

    def __init__(self, shape: tuple[int, ...], dim: int | None, rank: int, parts: int):
        self.numel = math.prod(shape)
        if dim is None or parts == 1:
            self.stride = self.width = max(self.numel, 1)
            self.offset = 0
            return
        inner = math.prod(shape[dim + 1 :])
        size = -(-shape[dim] // parts)
        self.stride = shape[dim] * inner
        self.offset = min(rank * size, shape[dim]) * inner
        self.width = max(0, min(size, shape[dim] - rank * size)) * inner

    @property
    def size(self) -> int:
        """Elements in the chunk."""
        return self.numel // self.stride * self.width

    def full(self, j: int) -> int:
        return j // self.width * self.stride + self.offset + j % self.width

    def count(self, x: int) -> int:
        """How many of the chunk's elements lie before element ``x`` of the full value."""
        row, col = divmod(x, self.stride)
        return row * self.width + min(max(col - self.offset, 0), self.width)

    def gather(self, dst: torch.Tensor, src: torch.Tensor, base: int, lo: int) -> None:
        """``dst[k] <- src[full(lo + k) - base]``: elements ``lo ..`` of the chunk from the part of the full value that
        begins at element ``base`` (at most a first partial run, whole runs, a last partial run)."""
        hi, k = lo + dst.numel(), 0
        while lo < hi:
            row, col = divmod(lo, self.width)
            at = row * self.stride + self.offset + col - base
            if col or hi - lo < self.width:
                m = min(self.width - col, hi - lo)
                dst[k : k + m].copy_(src[at : at + m])
            else:
                rows = (hi - lo) // self.width
                m = rows * self.width
                dst[k : k + m].view(rows, self.width).copy_(
                    src[at:].as_strided((rows, self.width), (self.stride, 1))
                )
            k, lo = k + m, lo + m


def _draw_range(
    out: torch.Tensor,
    shape: tuple[int, ...],
    dim: int | None,
    *,
    rank: int,
    parts: int,
    start: int,
    std: float,
    seed: int,
    name: str,
    index: int | None,
    buffer: torch.Tensor | None,
) -> None:
    """``out`` (flat, contiguous) <- elements ``start .. start + out.numel()`` of chunk ``rank`` of ``parts`` along
    ``dim`` of the flattened value of ``shape`` drawn from the streams of ``(seed, name, index)``: each block that holds
    some of them is drawn whole, into ``out`` when all of it lands there (fp32 on the CPU), else into ``buffer``."""
    n = out.numel()
    if n == 0:
        return
    chunk = _Chunk(shape, dim, rank, parts)
    end = start + n
    direct = out.device.type == "cpu" and out.dtype == torch.float32
    for block in range(chunk.full(start) // BLOCK, chunk.full(end - 1) // BLOCK + 1):
        first = block * BLOCK
        length = min(BLOCK, chunk.numel - first)
        lo, hi = max(start, chunk.count(first)), min(end, chunk.count(first + length))
        if lo >= hi:  # the block falls between two runs of the chunk
            continue
        dst = out[lo - start : hi - start]
        if direct and hi - lo == length:  # the whole block, contiguous in the chunk
            draw_block(dst, std, seed, name, index, block)
            continue
        src = (
            buffer[:length]
            if buffer is not None and buffer.numel() >= length
            else torch.empty(length)
        )
        draw_block(src, std, seed, name, index, block)
        chunk.gather(dst, src, first, lo)


@torch.no_grad()
def initial_shard(
    name: str,
    full_shape: torch.Size | tuple[int, ...],
    out: torch.Tensor,
    *,
    std: float,
    seed: int,
    dim: int | None = None,
    rank: int = 0,
    parts: int = 1,
    buffer: torch.Tensor | None = None,
    start: int = 0,
) -> None:
    """Write into ``out`` chunk ``rank`` of ``parts`` along ``dim`` (the whole parameter when ``dim`` is None) of
    parameter ``name``'s initial value, whose full shape is ``full_shape`` — or, from ``start``, only elements
    ``start .. start + out.numel()`` of that chunk flattened (``out`` in row-major order: a ZeRO-3 partition). Only
    the blocks holding those elements are drawn (docs/design-model.md, "Model construction"), one at a time, into
    ``buffer`` (CPU fp32, of ``draw_size`` elements) unless a block lands whole in ``out``."""
    rule = rule_for(name)
    if rule in ("ones", "zeros"):
        out.fill_(1.0 if rule == "ones" else 0.0)
        return
    full_shape = tuple(full_shape)
    flat = (
        out.view(-1)
        if out.is_contiguous()
        else torch.empty(out.numel(), dtype=out.dtype, device=out.device)
    )
    n = flat.numel()
    if (
        rule == "tables"
    ):  # [T, R, d]: each table E_i a value of its own, from the streams (seed, name, i)
        tables = list(range(full_shape[0]))
        if dim == 0:
            tables = [int(i) for i in torch.arange(full_shape[0]).chunk(parts)[rank]]
        inner = None if dim in (None, 0) else dim - 1
        per = _Chunk(full_shape[1:], inner, rank, parts).size  # elements of each table's chunk
        for t in range(start // per, (start + n - 1) // per + 1 if n and per else 0):
            lo, hi = max(start, t * per), min(start + n, (t + 1) * per)
            _draw_range(
                flat[lo - start : hi - start],
                full_shape[1:],
                inner,
                rank=rank,
                parts=parts,
                start=lo - t * per,
                std=std,
                seed=seed,
                name=name,
                index=tables[t],
                buffer=buffer,
            )
    else:
        _draw_range(
            flat,
            full_shape,
            dim,
            rank=rank,
            parts=parts,
            start=start,
            std=std,
            seed=seed,
            name=name,
            index=None,
            buffer=buffer,
        )
    if not out.is_contiguous():
        out.copy_(flat.view(out.shape))


def host_tables(model: nn.Module) -> list[tuple[str, HostTables]]:
    """``[(weight name, module)]`` of the Engram tables kept in host memory (``model.engram.offload``): their
    weights are tensors, not parameters, initialised by the same rule as the device tables they replace."""
    return [
        (f"{prefix}.weight", module)
        for prefix, module in model.named_modules()
        if isinstance(module, HostTables)
    ]


def initialise(model: nn.Module, std: float, seed: int) -> None:
    """Every parameter of a full (unsharded) model from its rule, host tables included; parameters on the meta
    device are skipped."""
    for name, param in model.named_parameters():
        if not param.is_meta:
            initial_shard(name, param.shape, param.data, std=std, seed=seed)
    for name, tables in host_tables(model):
        initial_shard(name, tables.weight.shape, tables.weight, std=std, seed=seed)
