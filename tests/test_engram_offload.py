"""model.engram.offload: Engram tables in host memory, stepped by a host AdamW, equal to the dense tables."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from helpers.runs import metrics, run_cli, train_args, train_run
from mhf_dist.config import ConfigError, load_config
from mhf_dist.model import build_model
from mhf_dist.model.host_tables import HostTables
from mhf_dist.train.checkpoint.index import read_marker
from mhf_dist.train.host_tables import HOST_TABLES_FILE, HostTablesStep
from mhf_dist.train.trained_weights import trained_weights
from mhf_dist.vocab.engram_compression import CompressionTable

V = 300
ENGRAM = ("model.engram.layers=[0,1]", "model.engram.table_size=1000")
OFFLOAD = "model.engram.offload=true"
STEPS = 4


def tiny(offload: bool, *extra: str):
    cfg = load_config(
        "tiny-standard+engram",
        overrides=["model.engram.table_size=97", "model.engram.layers=[0,1]"]
        + ([OFFLOAD] if offload else [])
        + list(extra),
    ).model
    torch.manual_seed(0)
    return build_model(cfg, V, compression=CompressionTable.identity(V))


def test_host_lookup_and_gradient_equal_the_dense_tables():
    dense, host = tiny(False), tiny(True)
    tables = host.backbone.layers[1].engram.tables
    assert isinstance(tables, HostTables) and not any(
        "engram.tables" in n for n, _ in host.named_parameters()
    )
    # same initialisation
    assert torch.equal(tables.weight, dense.backbone.layers[1].engram.tables.weight)
    assert host.parameter_counts() == dense.parameter_counts()
    ids = torch.randint(0, V, (2, 16))
    # a prefetched gather (the trainer's path) and the synchronous one give the same output
    host.backbone.layers[1].engram.prefetch(ids)
    tables.advance()
    for model in (dense, host):
        model.backbone.layers[1].engram.tables.grad = None
        model.hidden(ids).square().sum().backward()
    tables.release()
    for i in (0, 1):
        d, h = dense.backbone.layers[i].engram.tables, host.backbone.layers[i].engram.tables
        assert torch.allclose(d.weight.grad, h.grad, atol=1e-6, rtol=1e-5)
        # only the rows read
        assert (h.grad.abs().sum(-1) > 0).sum() < h.grad.shape[0] * h.grad.shape[1]
    # a full state dict (train.init_from, an export) loads into the host tables
    host.load_state_dict(dense.state_dict())


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["parallel.tp=2"], r"offload=true with parallel.tp=2.*set model.engram.offload=sharded"),
        (["parallel.pp=2"], r"offload=true with parallel.pp=2.*set model.engram.offload=sharded"),
        (
            ["parallel.zero_stage=0"],
            r"offload with parallel.zero_stage=0.*use parallel.zero_stage 1, 2 or 3",
        ),
    ],
)
def test_offload_scope_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny-h4b16k+engram", overrides=[OFFLOAD, *overrides])


LR, BETAS, EPS, WD, CLIP = 1e-2, (0.9, 0.95), 1e-8, 0.1, 1.0


class TrainerStandIn:
    """The part of a ``Trainer`` the host step reads, without DeepSpeed: the decayed group's
    hyperparameters, gradient clipping 1.0, and (set by ``train_step``) a global norm that is the host tables'
    own."""

    device = torch.device("cpu")
    layers = None  # every block

    def __init__(self):
        self.optimizer = torch.optim.AdamW(
            [nn.Parameter(torch.zeros(1))], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD
        )
        self.norm = float("nan")

    def gradient_clipping(self) -> float:
        return CLIP

    def step_skipped(self) -> bool:
        return False

    def global_grad_norm(self) -> float:
        return float(self.norm)


def host_step(model, update: str) -> HostTablesStep:
    """The trainer's host step, on a ``TrainerStandIn`` (the tables' lr scale 1, weight decay ``WD``)."""
    return HostTablesStep(
        model,
        TrainerStandIn(),
        compute_dtype=torch.float32,
        dp_group=None,
        dp=1,
        update=update,
        settings=(1.0, WD),
    )


def train_step(model, host: HostTablesStep, ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """One step on ``ids``; returns the rows ``[T, R]`` of each layer's tables marked read (lazy update)."""
    model.hidden(ids).square().sum().backward()
    read = (
        {i: t.touched.view(t.weight.shape[:2]).clone() for i, t in host.tables.items()}
        if host.lazy
        else {}
    )
    host.before_step()
    host.trainer.norm = float("nan")  # not read: the trainer hands the norm it read over
    host.after_step(host.host_norm.item())
    return read


def test_lazy_update_equals_dense_when_every_row_is_read():
    """Every row of every table read every step (4096 tokens on ~100-row tables): the lazy update is the dense AdamW,
    clipping and weight decay included, with the same checkpoint state. The padding rows beyond each table's prime
    size are never read: the lazy update leaves them as they are, the dense one decays them."""
    models = {u: tiny(True, f"model.engram.offload_update={u}") for u in ("dense", "lazy")}
    hosts = {u: host_step(m, u) for u, m in models.items()}
    initial = {i: t.weight.clone() for i, t in hosts["lazy"].tables.items()}
    readable = {
        i: torch.arange(t.weight.shape[1])
        < models["lazy"].backbone.layers[i].engram.hash.moduli.view(-1, 1)
        for i, t in hosts["lazy"].tables.items()
    }
    for _ in range(3):
        ids = torch.randint(0, V, (8, 512))
        train_step(models["dense"], hosts["dense"], ids)
        read = train_step(models["lazy"], hosts["lazy"], ids)
        assert all(torch.equal(read[i], readable[i]) for i in readable)
        assert hosts["dense"].host_norm > 10 * CLIP  # clipping is active
    dense, lazy = hosts["dense"].state()[0], hosts["lazy"].state()[0]
    assert {k: (v.dtype, v.shape) for k, v in lazy.items()} == {
        k: (v.dtype, v.shape) for k, v in dense.items()
    }
    assert {"layers.0.exp_avg", "layers.0.exp_avg_sq", "layers.1.step"} <= lazy.keys()
    for i, r in readable.items():
        assert lazy[f"layers.{i}.step"].item() == dense[f"layers.{i}.step"].item() == 3
        for key in ("weight", "exp_avg", "exp_avg_sq"):
            assert torch.allclose(
                lazy[f"layers.{i}.{key}"][r], dense[f"layers.{i}.{key}"][r], atol=1e-6, rtol=0
            ), key
        assert torch.equal(lazy[f"layers.{i}.weight"][~r], initial[i][~r])
        assert torch.allclose(dense[f"layers.{i}.weight"][~r], initial[i][~r] * (1 - LR * WD) ** 3)
        assert not lazy[f"layers.{i}.exp_avg_sq"][~r].any()


def test_lazy_update_steps_only_the_rows_read():
    """After a full step, two steps on a few tokens: the rows not read keep their weights and moments bit for bit;
    the rows read follow AdamW by hand, with the clipped gradient and the global step count for bias correction."""
    model = tiny(True, "model.engram.offload_update=lazy")
    host = host_step(model, "lazy")
    train_step(model, host, torch.randint(0, V, (8, 512)))
    for step in (2, 3):
        ids = torch.randint(0, V, (1, 8))
        before = {
            i: {k: v.clone() for k, v in host.adamw.state[i].items()} | {"w": t.weight.clone()}
            for i, t in host.tables.items()
        }
        model.hidden(ids).square().sum().backward()
        grads = {i: t.grad.clone() for i, t in host.tables.items()}
        read = {i: t.touched.view(t.weight.shape[:2]).clone() for i, t in host.tables.items()}
        host.before_step()
        host.trainer.norm = host.host_norm
        host.after_step()
        norm = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g) for g in grads.values()])
        )
        coefficient = max(1.0, (norm.item() + 1e-6) / CLIP)
        assert coefficient > 1  # clipping is active
        for i, t in host.tables.items():
            state, b, r = host.adamw.state[i], before[i], read[i]
            assert 0 < r.sum() < r.numel() // 4
            assert state["step"].item() == step == b["step"].item() + 1
            assert (grads[i][~r] == 0).all() and (grads[i][r].abs().sum(-1) > 0).all()
            for now, then in (
                (t.weight, b["w"]),
                (state["exp_avg"], b["exp_avg"]),
                (state["exp_avg_sq"], b["exp_avg_sq"]),
            ):
                assert torch.equal(now[~r], then[~r])
            g = grads[i][r] / coefficient
            m = BETAS[0] * b["exp_avg"][r] + (1 - BETAS[0]) * g
            v = BETAS[1] * b["exp_avg_sq"][r] + (1 - BETAS[1]) * g * g
            denom = v.sqrt() / (1 - BETAS[1] ** step) ** 0.5 + EPS
            w = b["w"][r] * (1 - LR * WD) - LR / (1 - BETAS[0] ** step) * m / denom
            assert torch.allclose(state["exp_avg"][r], m, atol=1e-7, rtol=1e-6)
            assert torch.allclose(state["exp_avg_sq"][r], v, atol=1e-9, rtol=1e-5)
            assert torch.allclose(t.weight[r], w, atol=1e-6, rtol=0)
            assert not t.grad.any() and not t.touched.any()  # ready for the next step


def test_lazy_update_needs_offloaded_tables():
    with pytest.raises(
        ConfigError,
        match=r"offload_update=lazy applies to host-memory tables only.*"
        r"set model.engram.offload=true",
    ):
        load_config("tiny-h4b16k+engram", overrides=["model.engram.offload_update=lazy"])
    assert load_config(
        "tiny-h4b16k+engram", overrides=[OFFLOAD, "model.engram.offload_update=lazy"]
    )


@pytest.mark.multirank
def test_offloaded_training_equals_dense_tables_and_resumes(tmp_path, data):
    """fp32, 1 rank, ZeRO-3, 4 micro-batches per step. Without clipping the offloaded run is the dense run bit for bit:
    losses, every weight and table row after 4 steps. With the preset's clipping (grad_clip 1.0, active) the global
    norm is summed in another order (the host tables' norm joins DeepSpeed's), 1 ulp apart at step 1; the clip
    coefficient passes that to AdamW, whose update amplifies it where a gradient is near its eps, so the runs agree
    to rounding: losses to 1e-6, grad norms to 1e-4, where the rounding leaves them 2.6e-5 apart at step 4 (a host
    path that left its tables unclipped is 6e-4 off at step 3). A resume at step 2 continues the offloaded run bit
    for bit."""

    def train(name, *extra):
        return run_cli(
            train_args(
                tmp_path / name, data, 1, *ENGRAM, *extra, preset="tiny-h4b16k+engram", steps=STEPS
            )
        )

    for name, extra in (("dense", ()), ("host", (OFFLOAD,))):
        train(name, *extra)
        train(f"{name}-unclipped", *extra, "optimizer.grad_clip=0")
    dense, host = metrics(tmp_path / "dense"), metrics(tmp_path / "host")
    for a, b in zip(host, dense, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * b["loss"], (a["step"], a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * b["grad_norm"], (
            a["step"],
            a["grad_norm"],
            b["grad_norm"],
        )
    assert dense[0]["grad_norm"] > 1.0  # clipping was active
    ckpt = tmp_path / "host" / "checkpoints" / f"step-{STEPS:08d}"
    assert HOST_TABLES_FILE in read_marker(ckpt)["digests"]
    saved = load_file(str(ckpt / HOST_TABLES_FILE))
    assert {"layers.0.exp_avg", "layers.1.exp_avg_sq", "layers.1.step"} <= saved.keys()

    unclipped = [metrics(tmp_path / f"{name}-unclipped") for name in ("dense", "host")]
    assert [r["loss"] for r in unclipped[1]] == [r["loss"] for r in unclipped[0]]
    want, got = (
        trained_weights(tmp_path / f"{name}-unclipped").state for name in ("dense", "host")
    )
    assert got.keys() == want.keys()  # the export holds the offloaded tables
    assert [name for name in want if not torch.equal(got[name], want[name])] == []

    train("resumed", OFFLOAD, "train.stop_at_step=2")
    train("resumed", OFFLOAD)
    resumed = metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in host]


@pytest.mark.multirank
def test_lazy_update_with_two_data_parallel_ranks_and_a_dense_resume(tmp_path, data):
    """fp32, 3 steps: with dp = 2 the rows either rank read are stepped, so the run equals the single-rank lazy one,
    which differs from the dense update (rows unread in a step keep their values); a lazy checkpoint resumes with
    the dense update (the same AdamW state), continuing from the lazy run's weights."""
    lazy = (OFFLOAD, "model.engram.offload_update=lazy")
    runs = {
        name: train_run(tmp_path, data, name, nproc, *ENGRAM, *extra, preset="tiny-h4b16k+engram")
        for name, nproc, extra in (
            ("lazy", 1, lazy),
            ("lazy-dp2", 2, lazy),
            ("dense", 1, (OFFLOAD,)),
        )
    }
    for a, b in zip(runs["lazy-dp2"], runs["lazy"], strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * b["loss"], (a["step"], a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * b["grad_norm"], (
            a["step"],
            a["grad_norm"],
            b["grad_norm"],
        )
    assert runs["lazy"][0]["loss"] == runs["dense"][0]["loss"]
    assert (
        abs(runs["lazy"][-1]["loss"] - runs["dense"][-1]["loss"]) > 1e-6 * runs["dense"][-1]["loss"]
    )

    train_run(
        tmp_path,
        data,
        "resumed",
        1,
        *ENGRAM,
        *lazy,
        "train.stop_at_step=2",
        preset="tiny-h4b16k+engram",
    )
    resumed = train_run(tmp_path, data, "resumed", 1, *ENGRAM, OFFLOAD, preset="tiny-h4b16k+engram")
    assert [r["step"] for r in resumed] == [1, 2, 3]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in runs["lazy"]]
