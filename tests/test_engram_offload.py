"""model.engram.offload: Engram tables in host memory, stepped by a host AdamW, equal to the dense tables."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from helpers.runs import metrics, run_cli, train_args
from mhf_dist.config import ConfigError, load_config
from mhf_dist.consolidate import trained_weights
from mhf_dist.engram_compression import CompressionTable
from mhf_dist.model import build_model
from mhf_dist.model.host_tables import HostTables
from mhf_dist.train.checkpoint_index import read_marker
from mhf_dist.train.host_tables import HOST_TABLES_FILE

V = 300
ENGRAM = ("model.engram.layers=[0,1]", "model.engram.table_size=1000")
OFFLOAD = "model.engram.offload=true"
STEPS = 4


def tiny(offload: bool):
    cfg = load_config("tiny-standard+engram", overrides=["model.engram.table_size=97", "model.engram.layers=[0,1]"]
                      + ([OFFLOAD] if offload else [])).model
    torch.manual_seed(0)
    return build_model(cfg, V, compression=CompressionTable.identity(V))


def test_host_lookup_and_gradient_equal_the_dense_tables():
    dense, host = tiny(False), tiny(True)
    tables = host.backbone.layers[1].engram.tables
    assert isinstance(tables, HostTables) and not any("engram.tables" in n for n, _ in host.named_parameters())
    assert torch.equal(tables.weight, dense.backbone.layers[1].engram.tables.weight)  # same initialisation
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
        assert (h.grad.abs().sum(-1) > 0).sum() < h.grad.shape[0] * h.grad.shape[1]  # only the rows read
    # a full state dict (train.init_from, an export) loads into the host tables
    host.load_state_dict(dense.state_dict())


@pytest.mark.parametrize("overrides, message", [
    (["parallel.tp=2"], r"offload with parallel.tp=2, parallel.pp=1.*tp = pp = 1 only"),
    (["parallel.pp=2"], r"offload with parallel.tp=1, parallel.pp=2"),
    (["parallel.zero_stage=0"], r"offload with parallel.zero_stage=0.*use parallel.zero_stage 1, 2 or 3"),
])
def test_offload_scope_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny-h4b16k+engram", overrides=[OFFLOAD, *overrides])


@pytest.mark.multirank
def test_offloaded_training_equals_dense_tables_and_resumes(tmp_path, data):
    """fp32, 1 rank, ZeRO-3, 4 micro-batches per step, grad_clip 1.0 (the tiny preset's): the offloaded run's
    losses, grad norms and every table row after 4 steps equal the dense run's; a resume at step 2 continues it."""
    def train(name, *extra):
        return run_cli(train_args(tmp_path / name, data, 1, *ENGRAM, *extra, preset="tiny-h4b16k+engram",
                                  steps=STEPS))

    train("dense")
    train("host", OFFLOAD)
    dense, host = metrics(tmp_path / "dense"), metrics(tmp_path / "host")
    for a, b in zip(host, dense, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * b["loss"], (a["step"], a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * b["grad_norm"], (
            a["step"], a["grad_norm"], b["grad_norm"])
    assert dense[0]["grad_norm"] > 1.0  # clipping was active
    ckpt = tmp_path / "host" / "checkpoints" / f"step-{STEPS:08d}"
    assert HOST_TABLES_FILE in read_marker(ckpt)["digests"]
    saved = load_file(str(ckpt / HOST_TABLES_FILE))
    assert {"layers.0.exp_avg", "layers.1.exp_avg_sq", "layers.1.step"} <= saved.keys()
    want, got = trained_weights(tmp_path / "dense").state, trained_weights(tmp_path / "host").state
    assert got.keys() == want.keys()  # the export holds the offloaded tables
    for name in want:
        assert torch.allclose(got[name], want[name], atol=1e-6, rtol=0), name

    train("resumed", OFFLOAD, "train.stop_at_step=2")
    train("resumed", OFFLOAD)
    resumed = metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in host]


@pytest.mark.multirank
def test_offloaded_training_with_two_data_parallel_ranks(tmp_path, data):
    """dp = 2: the host gradients are averaged over the ranks, so the losses are the single dense run's."""
    for name, nproc, extra in (("dense", 1, ()), ("host-dp2", 2, (OFFLOAD,))):
        run_cli(train_args(tmp_path / name, data, nproc, *ENGRAM, *extra, preset="tiny-h4b16k+engram", steps=3))
    for a, b in zip(metrics(tmp_path / "host-dp2"), metrics(tmp_path / "dense"), strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * b["loss"], (a["step"], a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * b["grad_norm"], (
            a["step"], a["grad_norm"], b["grad_norm"])
