"""Host memory per rank of the Engram tables kept in host memory (``model.engram.offload``), from the config alone
(``host_table_memory``): what ``plan`` prints and the start refuses past ``model.engram.host_budget_gb``. Every term:
docs/configuration.md, "Engram memory settings".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mhf_dist.config import ModelConfig, RunConfig
from mhf_dist.model.parameter_count import engram_table_rows

BYTES = {"fp32": 4, "bf16": 2}

GRADIENT_BYTES = (
    4  # the gradient buffer, and a row gradient held until the step's end (sharded tables): fp32
)


@dataclass(frozen=True)
class HostTableMemory:
    """One rank's host memory for the host tables, in bytes."""

    tables: int  # its rows' weights, moments, gradient and row mask
    buffers: int  # the rows gathered for its micro-batches, served to the others, and gradients held (sharded)
    ranks: int  # the ranks sharing one copy of the tables (1: whole tables on every rank)

    @property
    def total(self) -> int:
        return self.tables + self.buffers


def host_table_memory(
    cfg: ModelConfig,
    ranks: int,
    tokens: int,
    accum: int,
    compute_bytes: int,
    blocks: Sequence[int] | None = None,
) -> HostTableMemory:
    """Per rank, for tables split over ``ranks`` (1: whole), micro-batches of ``tokens`` tokens, ``accum`` of them
    per step, rows crossing in ``compute_bytes`` per value; the memories of ``blocks`` only (a pipeline stage's; None:
    all). Buffers count every looked-up row as unique (the bound)."""
    e, width = cfg.engram, cfg.engram_head_dim
    heads = (e.max_ngram - 1) * e.heads
    layers = [i for i in cfg.engram_layers if blocks is None or i in blocks]
    rows = sum(heads * engram_table_rows(cfg, i) for i in layers)
    # per value: the weight, two Adam moments, the gradient buffer; the row mask: one byte a row
    state = BYTES[e.table_dtype] + 2 * BYTES[e.moment_dtype] + GRADIENT_BYTES
    tables = (rows * width * state + rows) // ranks
    looked_up = len(layers) * tokens * heads  # rows a micro-batch reads, at most
    # the current micro-batch's rows and the next one's, on their way to the device
    buffers = 2 * looked_up * width * compute_bytes
    if (
        ranks > 1
    ):  # the rows the others ask of this rank, and the step's gradients: held, summed, received
        buffers += (
            looked_up * width * compute_bytes + 3 * accum * looked_up * width * GRADIENT_BYTES
        )
    return HostTableMemory(tables, buffers, ranks)


def sharing_ranks(cfg: ModelConfig, world: int, ranks_per_node: int, pp: int = 1) -> int:
    """The ranks holding one copy of the host tables (of a pipeline stage's): 1 for whole tables, else every rank of
    the stage or those of a node."""
    e = cfg.engram
    if e is None or e.offload != "sharded":
        return 1
    stage = world // pp
    return min(ranks_per_node, stage) if e.offload_shards == "node" else stage


def run_host_table_memory(
    cfg: RunConfig, ranks: int, accum: int, stages: Sequence[Sequence[int]] | None = None
) -> HostTableMemory:
    """``host_table_memory`` of a run's model, micro-batches and dtype, tables split over ``ranks``: for a rank of
    the stage whose memories take the most, of ``stages`` (each stage's blocks; None: one stage, or a cut not known,
    for which every stage is counted as holding every memory: a bound)."""
    tokens = cfg.train.micro_batch_size * cfg.data.seq_len
    dtype = 2 if cfg.train.dtype == "bf16" else 4
    return max(
        (host_table_memory(cfg.model, ranks, tokens, accum, dtype, b) for b in stages or [None]),
        key=lambda memory: memory.total,
    )
