"""The tensor-parallel layers one by one (Megatron's tensor_parallel/test_layers.py is the model): on 2 gloo ranks,
each layer built from the shards of a full layer gives the full layer's output, and its gradients are the full
layer's gradients (sharded, or whole on every rank for a replicated weight). The whole-model equivalence tests in
test_tensor_parallel.py cover them together; these name the layer that breaks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from helpers.ranks import run_ranks
from mhf_dist.model.tables import BucketTables
from mhf_dist.parallel.layers import (
    BucketParallelEmbedding,
    ColumnParallelLinear,
    RegionRMSNorm,
    ReplicatedHeadsLinear,
    RowParallelLinear,
    mark_region,
)

pytestmark = pytest.mark.multirank
TP, D, OUT, ROWS, TABLES = 2, 8, 6, 10, 3


def inputs(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def shard(t: torch.Tensor, dim: int, rank: int) -> torch.Tensor:
    return t.chunk(TP, dim=dim)[rank].clone()


def run(
    module: nn.Module, x: torch.Tensor, weight_out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(output, input gradient, parameter gradients) of ``(module(x) * weight_out).sum()``."""
    x = x.clone().requires_grad_()
    out = module(x)
    (out * weight_out).sum().backward()
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in module.named_parameters()}


def full_layers() -> dict:
    """The single-process layers and their inputs, the same on every rank."""
    torch.manual_seed(0)
    linear = nn.Linear(D, OUT, bias=False).double()
    norm = nn.RMSNorm(D, eps=1e-6).double()
    with torch.no_grad():
        norm.weight.copy_(inputs(1, D))
    return {
        "linear": linear,
        "norm": norm,
        "x": inputs(2, 4, D),
        "table": inputs(3, TABLES, ROWS, D),
    }


def layers_worker(rank: int, world: int) -> dict:
    group, full, results = dist.group.WORLD, full_layers(), {}
    x = full["x"]

    # ColumnParallelLinear: this rank's output columns of the full product
    column = ColumnParallelLinear(D, OUT, TP).double()
    with torch.no_grad():
        column.weight.copy_(shard(full["linear"].weight, 0, rank))
    # the region copies its input once, so the input gradient sums over the ranks
    mark_region(column, group)
    results["column"] = run(column, x, shard(inputs(4, 4, OUT), 1, rank))

    # RowParallelLinear: this rank's input features, partial products all-reduced to the full output
    row = RowParallelLinear(OUT, D, group, TP).double()
    w = inputs(5, D, OUT)
    with torch.no_grad():
        row.weight.copy_(shard(w, 1, rank))
    results["row"] = run(row, shard(inputs(6, 4, OUT), 1, rank), inputs(7, 4, D))

    # RegionRMSNorm: a replicated weight used on this rank's heads; its gradient is summed over the group
    norm = RegionRMSNorm(D // TP, 1e-6, group).double()
    with torch.no_grad():
        norm.weight.copy_(shard(full["norm"].weight, 0, 0))
    results["norm"] = run(norm, shard(inputs(8, 4, D), 1, rank), shard(inputs(9, 4, D), 1, rank))

    # ReplicatedHeadsLinear: the whole projection on every rank, cut to this rank's columns
    heads = ReplicatedHeadsLinear(
        D, OUT, slice(rank * OUT // TP, (rank + 1) * OUT // TP), group
    ).double()
    with torch.no_grad():
        heads.weight.copy_(full["linear"].weight)
    results["heads"] = run(heads, x, shard(inputs(4, 4, OUT), 1, rank))

    # BucketParallelEmbedding: this rank's rows; lookups, and the sharded log-softmax over all rows
    table = BucketParallelEmbedding(TABLES, ROWS, D, group, rank, TP).double()
    with torch.no_grad():
        table.weight.copy_(shard(full["table"], 1, rank))
    logits = inputs(10, 4, TABLES, ROWS)
    results["log_softmax"] = table.log_softmax(shard(logits, 2, rank))
    results["softmax"] = table.softmax(shard(logits, 2, rank))
    results["row_offset"] = table.row_offset
    return results


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(layers_worker, TP)


def test_column_parallel_linear_gives_its_columns_and_sums_the_input_gradient(ranks):
    full = full_layers()
    out, dx, grads = run(full["linear"], full["x"], inputs(4, 4, OUT))
    for rank, r in enumerate(ranks):
        got_out, got_dx, got_grads = r["column"]
        torch.testing.assert_close(got_out, shard(out, 1, rank))
        torch.testing.assert_close(got_dx, dx)  # every rank's part, all-reduced on the way back
        torch.testing.assert_close(got_grads["weight"], shard(grads["weight"], 0, rank))


def test_row_parallel_linear_all_reduces_the_partial_products(ranks):
    full = nn.Linear(OUT, D, bias=False).double()
    with torch.no_grad():
        full.weight.copy_(inputs(5, D, OUT))
    out, dx, grads = run(full, inputs(6, 4, OUT), inputs(7, 4, D))
    for rank, r in enumerate(ranks):
        got_out, got_dx, got_grads = r["row"]
        torch.testing.assert_close(got_out, out)
        torch.testing.assert_close(got_dx, shard(dx, 1, rank))
        torch.testing.assert_close(got_grads["weight"], shard(grads["weight"], 1, rank))


def test_region_rms_norm_sums_its_replicated_weights_gradient(ranks):
    weight = shard(full_layers()["norm"].weight, 0, 0).detach()
    x, g = inputs(8, 4, D), inputs(9, 4, D)
    # one process: the same norm applied to each rank's half of the features, one weight for both
    halves = [F.rms_norm(part, (D // TP,), weight, 1e-6) for part in x.chunk(TP, dim=1)]
    leaf = weight.clone().requires_grad_()
    (
        torch.cat([F.rms_norm(p, (D // TP,), leaf, 1e-6) for p in x.chunk(TP, dim=1)], dim=1) * g
    ).sum().backward()
    for rank, r in enumerate(ranks):
        got_out, _, got_grads = r["norm"]
        torch.testing.assert_close(got_out, halves[rank])
        torch.testing.assert_close(got_grads["weight"], leaf.grad)  # the sum of both ranks' parts


def test_replicated_heads_linear_cuts_its_columns_and_sums_the_weight_gradient(ranks):
    full = full_layers()
    out, _, grads = run(full["linear"], full["x"], inputs(4, 4, OUT))
    for rank, r in enumerate(ranks):
        got_out, _, got_grads = r["heads"]
        torch.testing.assert_close(got_out, shard(out, 1, rank))
        torch.testing.assert_close(got_grads["weight"], grads["weight"])


def test_bucket_parallel_embedding_normalises_over_every_rank_s_rows(ranks):
    logits = inputs(10, 4, TABLES, ROWS)
    whole = BucketTables(TABLES, ROWS, D)
    for rank, r in enumerate(ranks):
        assert r["row_offset"] == rank * ROWS // TP
        torch.testing.assert_close(r["log_softmax"], shard(whole.log_softmax(logits), 2, rank))
        torch.testing.assert_close(r["softmax"], shard(whole.softmax(logits), 2, rank))


def test_a_table_that_does_not_split_over_tp_is_refused():
    with pytest.raises(ValueError, match="11 table rows cannot be split over tp=2"):
        BucketParallelEmbedding(TABLES, 11, D, None, 0, 2)
