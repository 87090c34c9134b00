"""model.engram.offload=sharded: host tables whose rows are split over the ranks, equal to whole host tables."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import yaml
from safetensors.torch import load_file, save_file
from torch import nn

from helpers.ranks import run_ranks
from helpers.runs import run_cli, train_args, train_run
from mhf_dist.cli import main
from mhf_dist.cluster.profile import load_profile
from mhf_dist.commands.plan import memory_plan
from mhf_dist.config import load_config
from mhf_dist.model import build_model
from mhf_dist.model.host_memory import run_host_table_memory
from mhf_dist.model.host_tables import HostTables
from mhf_dist.model.init import host_tables
from mhf_dist.parallel.sharded_host_tables import (
    HostShards,
    ShardedHostTables,
    shard_host_tables,
)
from mhf_dist.train.checkpoint.index import read_marker
from mhf_dist.train.host_adamw import HostAdamW
from mhf_dist.train.host_table_files import SHARD_FILE, HostTableFiles, shard_metadata
from mhf_dist.train.host_tables import HostTablesStep
from mhf_dist.train.trained_weights import trained_weights
from mhf_dist.vocab.engram_compression import CompressionTable

T, R, D = 3, 64, 8  # tables, rows, width
ENGRAM = ("model.engram.layers=[0,1]", "model.engram.table_size=1000")
SHARDED = "model.engram.offload=sharded"
STEPS = 4
VOCAB = 300


def rows_of(rank: int) -> torch.Tensor:
    """Rank ``rank``'s micro-batch of table rows ``[B, S, T]``: a few rows, some shared with the other ranks."""
    generator = torch.Generator().manual_seed(100 + rank)
    return torch.randint(0, R // 2, (2, 5, T), generator=generator) * 2


def whole_tables() -> HostTables:
    tables = HostTables(T, R, D)
    tables.weight.copy_(torch.randn(T, R, D, generator=torch.Generator().manual_seed(0)))
    return tables


def output_grad(rank: int) -> torch.Tensor:
    return torch.randn(2, 5, T, D, generator=torch.Generator().manual_seed(200 + rank))


def exchange_worker(rank, world):
    whole = whole_tables()
    sharded = ShardedHostTables(T, R, D, HostShards(dist.group.WORLD, rank, world))
    first, last = sharded.rows
    sharded.weight.copy_(whole.weight[:, first:last])
    sharded.touched = torch.zeros(T * sharded.block, dtype=torch.bool)
    # a prefetched lookup (the worker thread's exchange), then its gradient sent to the owners
    sharded.prefetch(rows_of(rank))
    sharded.advance()
    out = sharded.lookup(rows_of(rank))
    expected = whole.lookup(rows_of(rank))
    forward_bytes = sharded.sent_bytes
    out.backward(output_grad(rank))
    sharded.release()
    sharded.send_gradients()
    return {
        "out": out.detach(),
        "expected": expected.detach(),
        "grad": sharded.grad.clone(),
        "touched": sharded.touched.clone(),
        "forward_bytes": forward_bytes,
        "bytes": sharded.sent_bytes,
    }


def expected_bytes(rank: int, world: int) -> tuple[int, int]:
    """What rank ``rank`` sends in one lookup and in returning its gradients: a count to each other rank (int64),
    then the ids of its unique rows that others own (int64), then the rows the others asked of it (fp32 width D);
    for the gradients the same counts and ids, and the gradient rows (fp32)."""
    block = R // world

    def flat(r):
        return torch.unique(rows_of(r) + torch.arange(T) * R)

    def owner(index):
        return index % R // block

    mine = flat(rank)
    asked_of_others = int((owner(mine) != rank).sum())
    asked_of_me = sum(int((owner(flat(r)) == rank).sum()) for r in range(world) if r != rank)
    counts = (world - 1) * 8
    forward = counts + asked_of_others * 8 + asked_of_me * D * 4
    backward = counts + asked_of_others * 8 + asked_of_others * D * 4
    return forward, forward + backward


@pytest.mark.multirank
@pytest.mark.parametrize("world", [2, 4])
def test_sharded_lookup_and_gradients_equal_whole_tables(world):
    """Each rank looks up its own rows through the exchange: the rows are the whole tables' own, and after the
    gradients go to the owners each owner holds, for its rows, the sum over the ranks of the whole tables' gradients
    (exact at two ranks, whose sum has one order; to rounding at four); the bytes sent equal their formula and no
    rank reads more rows than were asked of it."""
    ranks = run_ranks(exchange_worker, world)
    whole_grad = torch.zeros(T, R, D)
    for rank in range(world):
        whole = whole_tables()
        whole.grad = torch.zeros(T, R, D)
        whole.lookup(rows_of(rank)).backward(output_grad(rank))
        whole_grad += whole.grad
    block = R // world
    for rank, got in enumerate(ranks):
        assert torch.equal(got["out"], got["expected"])
        want = whole_grad[:, rank * block : (rank + 1) * block]
        if world == 2:
            assert torch.equal(got["grad"], want)
        else:
            torch.testing.assert_close(got["grad"], want, rtol=1e-6, atol=1e-6)
        read = want.abs().sum(-1).reshape(-1) > 0
        assert torch.equal(got["touched"], read)
        assert (got["forward_bytes"], got["bytes"]) == expected_bytes(rank, world)
    # every rank's rows were asked for, not the whole table
    assert sum(int(r["touched"].sum()) for r in ranks) < T * R


def shards_worker(rank, world):
    out = []
    for per_node, pp in ((2, 1), (1, 2)):
        shards = HostShards.create(world, rank, per_node, pp=pp)
        replicas = dist.get_process_group_ranks(shards.replicas)
        group = dist.get_process_group_ranks(shards.group)
        out.append((shards.rank, shards.size, group, replicas, shards.stage, shards.first_copy))
    return out


@pytest.mark.multirank
def test_one_copy_per_node_splits_within_the_node():
    """offload_shards=node on 2 nodes of 2 ranks: each node's ranks split the rows, and each rank's replicas are
    the ranks of the other node with the same rows; under pp = 2 on 4 nodes of 1 rank, each rank holds its stage's
    rows whole, with the other rank of its stage as its replica, and one rank a stage counts in the norm."""
    assert [run[0] for run in run_ranks(shards_worker, 4)] == [
        (0, 2, [0, 1], [0, 2], 0, True),
        (1, 2, [0, 1], [1, 3], 0, True),
        (0, 2, [2, 3], [0, 2], 0, False),
        (1, 2, [2, 3], [1, 3], 0, False),
    ]
    assert [run[1] for run in run_ranks(shards_worker, 4)] == [
        (0, 1, [0], [0, 1], 0, True),
        (0, 1, [1], [0, 1], 0, False),
        (0, 1, [2], [2, 3], 1, True),
        (0, 1, [3], [2, 3], 1, False),
    ]


def test_checkpoint_files_read_any_rows(tmp_path):
    """Shard files of any split (and a whole-tables file) give any range of rows back; a gap is refused."""
    full = torch.randn(T, R, D)
    step = torch.tensor(3.0)
    for g, (first, last) in enumerate(((0, 16), (16, 40), (40, 64))):
        save_file(
            {"layers.1.weight": full[:, first:last].contiguous(), "layers.1.step": step},
            tmp_path / SHARD_FILE.format(g, 3),
            metadata=shard_metadata(first, last, R),
        )
    files = HostTableFiles(tmp_path)
    assert files.num_rows == R
    assert torch.equal(files.read("layers.1.weight"), full)
    assert torch.equal(files.read("layers.1.weight", 10, 45), full[:, 10:45])
    assert torch.equal(files.read("layers.1.step"), step)
    (tmp_path / SHARD_FILE.format(1, 3)).unlink()
    with pytest.raises(FileNotFoundError, match="rows start at"):
        HostTableFiles(tmp_path)


def test_sharded_offload_settings():
    cfg = load_config("tiny-h4b16k+engram", overrides=["model.engram.offload=sharded"])
    assert cfg.model.engram.offload == "sharded" and cfg.model.engram.offload_shards == "all"
    with pytest.raises(ValueError, match="set model.engram.offload=sharded"):
        load_config(
            "tiny-h4b16k+engram",
            overrides=["model.engram.offload=true", "model.engram.offload_shards=node"],
        )


@pytest.mark.multirank
def test_sharded_training_equals_whole_host_tables_and_resumes(tmp_path, data):
    """fp32, dp = 2, ZeRO-3, unclipped: the sharded run is the whole-tables run bit for bit (losses, every weight
    and table row at the end) and the device tables' to rounding (the first step's grad norm and every loss to 1e-6;
    unclipped, AdamW amplifies the rounding where a gradient is near its eps, so later grad norms drift by up to 1%);
    each rank's checkpoint file holds its rows; a resume at step 2 continues bit for bit, and the same checkpoint
    resumed on 4 ranks (the rows cut anew) continues as the dp = 2 run does to the dp tolerance of the other layout
    tests."""

    def run(name, nproc, *extra):
        return train_run(
            tmp_path,
            data,
            name,
            nproc,
            *ENGRAM,
            "optimizer.grad_clip=0",
            *extra,
            preset="tiny-h4b16k+engram",
            steps=STEPS,
        )

    whole, sharded = run("whole", 2, "model.engram.offload=true"), run("sharded", 2, SHARDED)
    assert [r["loss"] for r in sharded] == [r["loss"] for r in whole]
    device = run("device", 2)
    first = device[0]["grad_norm"]
    assert abs(sharded[0]["grad_norm"] - first) <= 1e-6 * first
    for a, b in zip(sharded, device, strict=True):  # DeepSpeed averages in another order
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * b["loss"], (a["step"], a["loss"], b["loss"])
    want, got = (trained_weights(tmp_path / name).state for name in ("whole", "sharded"))
    assert got.keys() == want.keys()
    assert [name for name in want if not torch.equal(got[name], want[name])] == []
    digests = read_marker(tmp_path / "sharded" / "checkpoints" / f"step-{STEPS:08d}")["digests"]
    assert {SHARD_FILE.format(0, 2), SHARD_FILE.format(1, 2)} <= digests.keys()

    run("resumed", 2, SHARDED, "train.stop_at_step=2")
    shutil.copytree(tmp_path / "resumed", tmp_path / "resumed-4")
    resumed = run("resumed", 2, SHARDED)
    assert [r["loss"] for r in resumed] == [r["loss"] for r in sharded]
    on_four = run("resumed-4", 4, SHARDED)
    assert [r["step"] for r in on_four] == list(range(1, STEPS + 1))
    last = read_marker(tmp_path / "resumed-4" / "checkpoints" / f"step-{STEPS:08d}")["digests"]
    assert sum(name.startswith("engram-host-tables") for name in last) == 4
    for a, b in zip(on_four[2:], sharded[2:], strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * b["loss"], (a["step"], a["loss"], b["loss"])


BIG = ("model.engram.layers=[0,1]", "model.engram.table_size=25000", "train.micro_batch_size=2")


def budget_case():
    """The tables of ``BIG`` and a per-rank budget they fit split over 4 ranks, not whole: (config, budget GiB)."""
    cfg = load_config(
        "tiny-h4b16k+engram",
        overrides=[*BIG, SHARDED, "data.seq_len=64", "train.global_batch_size=8"],
    )
    sharded, whole = (run_host_table_memory(cfg, ranks, 1) for ranks in (4, 1))
    budget = round(sharded.total * 1.02 / 2**30, 4)
    assert (
        whole.tables >= 3.5 * budget * 2**30
    )  # the tables' host state alone, 3.5 times the budget
    return cfg, budget


@pytest.mark.multirank
def test_tables_past_one_ranks_budget_train_sharded_where_whole_tables_are_refused(tmp_path, data):
    """Tables whose host state is 3.5 times one rank's budget (model.engram.host_budget_gb): whole on every rank
    they are refused before any rank starts, naming the sharded layout and its memory; split over 4 ranks they
    train as the device tables do (fp32, clipped, losses to 1e-6)."""
    _, budget = budget_case()
    common = (*BIG, f"model.engram.host_budget_gb={budget}")
    out = run_cli(
        train_args(
            tmp_path / "whole",
            data,
            4,
            *common,
            "model.engram.offload=true",
            preset="tiny-h4b16k+engram",
            steps=2,
        ),
        expect_rc=2,
    )
    assert "over the budget" in out and "set model.engram.offload=sharded" in out, out[-2000:]
    assert not (tmp_path / "whole" / "metrics.jsonl").exists()
    runs = train_run(
        tmp_path, data, "sharded", 4, *common, SHARDED, preset="tiny-h4b16k+engram", steps=2
    )
    device = train_run(tmp_path, data, "device", 4, *BIG, preset="tiny-h4b16k+engram", steps=2)
    assert [r["step"] for r in runs] == [1, 2]
    for a, b in zip(runs, device, strict=True):  # dp = 4, clipped: the device tables' losses
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * b["loss"], (a["step"], a["loss"], b["loss"])


def test_plan_counts_host_tables_per_rank_and_names_the_sharded_layout(tmp_path, capsys):
    """plan adds the host tables to a rank's host memory: whole tables past the node's memory do not fit and the
    verdict names what the sharded tables would take; sharded over the node's 4 ranks they fit."""
    cfg, _ = budget_case()
    profile = load_profile("cpu-local").model_copy(
        update={"name": "four", "gpus_per_node": 4, "cores_per_node": 4}
    )
    construction = max(p.construction_gb for p in memory_plan(cfg, profile, 1))
    whole, sharded = (run_host_table_memory(cfg, r, 1).total / 2**30 for r in (1, 4))
    memory = 4 * (construction + (whole + sharded) / 2) / 0.9  # between the two
    path = tmp_path / "four.yaml"
    path.write_text(yaml.safe_dump(profile.model_dump() | {"memory_gb_per_node": memory}))
    args = ["plan", "--preset", "tiny-h4b16k+engram", "--cluster", str(path)]
    args += [f"--set={o}" for o in (*BIG, "data.seq_len=64", "train.global_batch_size=8")]
    assert main([*args, "--set=model.engram.offload=true"]) == 0
    out = capsys.readouterr().out
    assert f"whole on every rank): {whole:.2f} GB per rank" in out, out
    assert "host memory: does not fit" in out
    assert f"with model.engram.offload=sharded the tables take {sharded:.2f} GB per rank" in out
    assert main([*args, f"--set={SHARDED}"]) == 0
    out = capsys.readouterr().out
    assert f"rows split over 4 ranks): {sharded:.2f} GB per rank" in out, out
    assert "host memory: fits" in out


def test_plan_counts_the_host_tables_of_the_heaviest_stage(tmp_path, capsys):
    """pp = 2 with one Engram layer a stage: a rank holds 1/2 of its own stage's tables, not of every layer's."""
    overrides = [*ENGRAM, SHARDED, "parallel.pp=2"]
    cfg = load_config("tiny-standard+engram", overrides=overrides)
    profile = load_profile("cpu-local").model_copy(
        update={"name": "four", "gpus_per_node": 4, "cores_per_node": 4}
    )
    path = tmp_path / "four.yaml"
    path.write_text(yaml.safe_dump(profile.model_dump()))
    plans = memory_plan(cfg, profile, 1, VOCAB)  # a light output side: a block a stage
    assert [list(p.block_range) for p in plans] == [[0], [1]]
    stage = run_host_table_memory(cfg, 2, 1, [[0]])
    assert stage.total < run_host_table_memory(cfg, 2, 1).total
    args = ["plan", "--preset", "tiny-standard+engram", "--cluster", str(path)]
    args += ["--vocab-size", str(VOCAB)]
    assert main([*args, *(f"--set={o}" for o in overrides)]) == 0
    out = capsys.readouterr().out
    assert f"the stage holding the most): {stage.total / 2**30:.2f} GB per rank" in out, out


@pytest.mark.multirank
def test_sharded_tables_under_tensor_parallelism_equal_device_tables(tmp_path, data):
    """tp = 2 × dp = 2, fp32, clipped (the preset's grad_clip 1.0): the rows split over all four ranks (each tp
    group's first rank sends the row gradients its peers compute alike) train as the device tables split over tp
    do: the first step's gradient norm (the host tables' included) to 1e-7 (a missing or doubled tp or dp share
    would be off by tens of percent), the losses to 1e-6; the two paths' gradients agree to rounding, not bit for
    bit, which AdamW amplifies where a gradient is near its eps, so later grad norms drift apart to about 2e-4."""
    layout = ("parallel.tp=2",)
    runs = [
        train_run(
            tmp_path,
            data,
            name,
            4,
            *ENGRAM,
            *layout,
            *extra,
            preset="tiny-h4b16k+engram",
            steps=STEPS,
        )
        for name, extra in (("device", ()), ("sharded", (SHARDED,)))
    ]
    first = runs[0][0]["grad_norm"]
    assert abs(runs[1][0]["grad_norm"] - first) <= 1e-7 * first
    for a, b in zip(runs[1], runs[0], strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * b["loss"], (a["step"], a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-3 * b["grad_norm"], (a["step"], a, b)


def test_bf16_tables_step_in_fp32_and_round_once(monkeypatch):
    """bf16 weights and moments: each AdamW step reads them into fp32, applies fused AdamW there and rounds each
    value once; a step cut into blocks of rows equals one over the whole table, and the lazy update touches only
    its rows."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(T, R, D, generator=generator)
    grad = torch.randn(T * R, D, generator=generator)
    hyper = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    stored = HostAdamW({0: weight.to(torch.bfloat16)}, torch.bfloat16)
    stored.step(0, grad, None, hyper)
    # the same step in fp32 from the same (bf16) values, rounded at the end
    start = HostAdamW({0: weight.to(torch.bfloat16).float()}, torch.float32)
    start.step(0, grad, None, hyper)
    assert stored.weights[0].dtype == stored.state[0]["exp_avg"].dtype == torch.bfloat16
    assert torch.equal(stored.weights[0], start.weights[0].to(torch.bfloat16))
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(stored.state[0][key], start.state[0][key].to(torch.bfloat16))
    assert stored.state[0]["step"].item() == 1
    monkeypatch.setattr("mhf_dist.train.host_adamw.BLOCK_ROWS", 5)
    blocks = HostAdamW({0: weight.to(torch.bfloat16)}, torch.bfloat16)
    blocks.step(0, grad, None, hyper)
    assert torch.equal(blocks.weights[0], stored.weights[0])
    rows = torch.tensor([3, 70, 100])
    lazy = HostAdamW({0: weight.to(torch.bfloat16)}, torch.bfloat16)
    lazy.step(0, grad[rows], rows, hyper)
    flat = lazy.weights[0].view(-1, D)
    assert torch.equal(flat[rows], stored.weights[0].view(-1, D)[rows])
    untouched = torch.ones(T * R, dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(flat[untouched], weight.to(torch.bfloat16).view(-1, D)[untouched])


@pytest.mark.multirank
def test_bf16_host_tables_checkpoint_in_bf16_and_resume_bit_identically(tmp_path, data):
    """table_dtype = moment_dtype = bf16, sharded (over the one rank): the checkpoint holds bf16 weights and moments
    (half the bytes), a resume at step 2 continues bit for bit."""
    bf16 = (SHARDED, "model.engram.table_dtype=bf16", "model.engram.moment_dtype=bf16")
    whole = train_run(tmp_path, data, "bf16", 1, *ENGRAM, *bf16, preset="tiny-h4b16k+engram")
    shard = tmp_path / "bf16" / "checkpoints" / "step-00000003" / SHARD_FILE.format(0, 1)
    saved = {
        name: load_file(str(shard))[name].dtype for name in ("layers.0.weight", "layers.1.exp_avg")
    }
    assert saved == {"layers.0.weight": torch.bfloat16, "layers.1.exp_avg": torch.bfloat16}
    train_run(
        tmp_path,
        data,
        "resumed",
        1,
        *ENGRAM,
        *bf16,
        "train.stop_at_step=2",
        preset="tiny-h4b16k+engram",
    )
    resumed = train_run(tmp_path, data, "resumed", 1, *ENGRAM, *bf16, preset="tiny-h4b16k+engram")
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole]


def small_model():
    """A tiny Standard model with Engram memories at layers 0 and 1 in whole host tables (the same on every rank)."""
    cfg = load_config(
        "tiny-standard+engram",
        overrides=["model.engram.table_size=97", "model.engram.layers=[0,1]", SHARDED],
    ).model
    torch.manual_seed(0)
    return build_model(cfg, VOCAB, compression=CompressionTable.identity(VOCAB))


def ids_of(rank: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(300 + rank))


def reduction_worker(rank, world, per_node):
    shards = HostShards.create(world, rank, per_node)
    model = small_model()
    whole = {name: tables.weight.clone() for name, tables in host_tables(model)}
    shard_host_tables(model, shards)
    for name, tables in host_tables(model):
        first, last = tables.rows
        tables.weight.copy_(whole[name][:, first:last])
    trainer = SimpleNamespace(
        device=torch.device("cpu"),
        optimizer=torch.optim.AdamW([nn.Parameter(torch.zeros(1))]),
        layers=None,
    )
    step = HostTablesStep(
        model,
        trainer,
        compute_dtype=torch.float32,
        dp_group=dist.group.WORLD,
        dp=world,
        update="dense",
        settings=(1.0, 0.0),
        shards=shards,
    )
    model.hidden(ids_of(rank)).square().sum().backward()
    step.before_step()
    grads = {
        i: (t.rows, step.grads[i].view(t.weight.shape).clone()) for i, t in step.tables.items()
    }
    return grads, step.host_norm.item()


@pytest.mark.multirank
@pytest.mark.parametrize("per_node", [None, 2], ids=["all", "node"])
def test_the_step_averages_each_rows_gradient_over_the_data_parallel_ranks(per_node):
    """4 ranks, rows split over all of them or over each node's 2 (two copies, averaged over the nodes): before the
    optimizer step each rank holds, for its rows, the mean over the ranks of the whole tables' gradients, and the
    host norm is the whole mean gradient's."""
    ranks = run_ranks(reduction_worker, 4, per_node)
    mean = {}
    for rank in range(4):
        model = small_model()
        model.hidden(ids_of(rank)).square().sum().backward()
        for i, block in enumerate(model.backbone.layers):
            mean[i] = mean.get(i, 0) + block.engram.tables.grad / 4
    for grads, norm in ranks:
        for i, ((first, last), grad) in grads.items():
            torch.testing.assert_close(grad, mean[i][:, first:last], rtol=1e-5, atol=1e-7)
        whole_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in mean.values()]))
        assert abs(norm - whole_norm.item()) <= 1e-5 * whole_norm.item()


@pytest.mark.multirank
def test_sharded_tables_under_pipeline_parallelism_equal_device_tables_and_reshard(tmp_path, data):
    """pp = 2 × dp = 2, fp32, clipped: each stage's ranks split its memory's rows (Standard, whose light output
    side puts one block and its Engram layer on each stage), the host norm joins the norm DeepSpeed takes inside the
    pipeline's step over both stages: the first step's gradient
    norm as the device tables' to 1e-7, the losses to 1e-6. Each stage's ranks write their rows of its layer; a
    resume at step 2 continues bit for bit, and the same checkpoint resumed at dp = 4 without a pipeline (the rows
    and layers gathered from both stages' files, cut anew) continues within the dp tolerance."""

    def run(name, nproc, *extra):
        return train_run(
            tmp_path, data, name, nproc, *ENGRAM, *extra, preset="tiny-standard+engram", steps=STEPS
        )

    pipeline = ("parallel.pp=2",)
    device, sharded = run("device", 4, *pipeline), run("sharded", 4, *pipeline, SHARDED)
    first = device[0]["grad_norm"]
    assert abs(sharded[0]["grad_norm"] - first) <= 1e-7 * first
    for a, b in zip(sharded, device, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * b["loss"], (a["step"], a["loss"], b["loss"])
    marker = read_marker(tmp_path / "sharded" / "checkpoints" / f"step-{STEPS:08d}")["digests"]
    # stage s's rank g of 2 writes file 2·s + g of 4: layer 0's rows, then layer 1's
    assert {SHARD_FILE.format(g, 4) for g in range(4)} <= marker.keys()
    files = HostTableFiles(tmp_path / "sharded" / "checkpoints" / f"step-{STEPS:08d}")
    assert [layers for _, layers, *_ in files.files] == [[0], [1], [0], [1]]

    run("resumed", 4, *pipeline, SHARDED, "train.stop_at_step=2")
    shutil.copytree(tmp_path / "resumed", tmp_path / "resumed-dp4")
    resumed = run("resumed", 4, *pipeline, SHARDED)
    assert [r["loss"] for r in resumed] == [r["loss"] for r in sharded]
    on_dp = run(
        "resumed-dp4", 4, SHARDED, "parallel.zero_stage=1"
    )  # DeepSpeed converts pp to ZeRO-1/2
    assert [r["step"] for r in on_dp] == list(range(1, STEPS + 1))
    for a, b in zip(on_dp[2:], sharded[2:], strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * b["loss"], (a["step"], a["loss"], b["loss"])


@pytest.mark.multirank
def test_bf16_pipeline_counts_the_host_tables_in_its_norm(tmp_path, data):
    """bf16 under pp = 2 × dp = 2 steps through DeepSpeed's bf16 optimizer (not its ZeRO one): the host tables'
    norm joins its norm there, on one rank of each model-parallel group: the first step's gradient norm is the
    device tables' to 1e-4 (the gradients accumulate in fp32), where counting the host tables on every rank of the
    group, or on none, is 7% off."""
    common = (*ENGRAM, "parallel.pp=2", "train.dtype=bf16")
    device, sharded = (
        train_run(tmp_path, data, name, 4, *common, *extra, preset="tiny-standard+engram", steps=1)
        for name, extra in (("device", ()), ("sharded", (SHARDED,)))
    )
    first = device[0]["grad_norm"]
    assert abs(sharded[0]["grad_norm"] - first) <= 1e-4 * first, (sharded[0], device[0])
