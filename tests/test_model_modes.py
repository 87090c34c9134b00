"""A model's modes (mhf_dist/model/modes.py) are fixed when it is built: activation checkpointing recomputes the blocks
it was built to and changes no number, each model keeps its own fused-head kernel policy, a forward measures the
heads' entropies when its argument asks, and a training run (a pipeline too) builds its model in the run's modes."""

from __future__ import annotations

import logging

import pytest
import torch

import mhf_dist.model.backbone as backbone
import mhf_dist.model.fused_head as fused_head
from helpers.equivalence import assert_tensor_close
from helpers.ranks import run_ranks
from mhf_dist.config import load_config
from mhf_dist.model import build_model
from mhf_dist.model.modes import ModelModes
from mhf_dist.vocab.signatures import SignatureTable

V = 300


@pytest.fixture
def cfg():
    return load_config(
        "tiny-h4b16k", overrides=["model.hash.num_buckets=64", "model.decoder_chunk_tokens=5"]
    ).model


@pytest.fixture
def codes(cfg):
    return SignatureTable.build(
        [f"tok{i}" for i in range(V)], cfg.hash.num_hashes, 64, pad_id=0
    ).codes


def test_checkpointing_is_built_in_and_changes_no_number(cfg, codes, monkeypatch):
    recomputed = []

    def counted(block, *args, **kwargs):
        recomputed.append(block)
        return torch.utils.checkpoint.checkpoint(block, *args, **kwargs)

    monkeypatch.setattr(backbone, "checkpoint", counted)
    x = torch.randint(1, V, (2, 9), generator=torch.Generator().manual_seed(0))
    results = {}
    for interval in (0, 1, 2):
        model = build_model(cfg, V, codes, modes=ModelModes(checkpoint_interval=interval))
        recomputed.clear()
        out = model(x[:, :-1], x[:, 1:])
        out.loss.backward()
        layers = list(model.backbone.layers)
        assert recomputed == (layers[::interval] if interval else [])
        results[interval] = out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}
    for interval in (1, 2):
        torch.testing.assert_close(results[interval][0], results[0][0], rtol=0, atol=0)
        for name, grad in results[0][1].items():
            assert_tensor_close(results[interval][1][name], grad, name)


def test_each_model_keeps_its_own_kernel_policy(cfg, codes, monkeypatch, caplog):
    def broken_compile(fn, **kwargs):
        def run(*args):
            raise RuntimeError("no working triton")

        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    monkeypatch.setattr(fused_head, "_on_gpu", lambda x: True)  # auto compiles on GPUs only
    failing, other = (
        build_model(cfg, V, codes, modes=ModelModes(kernels="auto")) for _ in range(2)
    )
    eager = build_model(cfg, V, codes, modes=ModelModes(kernels="eager"))
    assert (
        eager.vocab.decoder.kernels.mode == "eager" and failing.vocab.decoder.kernels.mode == "auto"
    )
    x = torch.randint(1, V, (2, 9), generator=torch.Generator().manual_seed(0))
    with caplog.at_level(logging.WARNING, logger=fused_head.__name__):
        loss = failing(x[:, :-1], x[:, 1:]).loss  # falls back to eager
    assert failing.vocab.decoder.kernels.failed and not other.vocab.decoder.kernels.failed
    assert len([r for r in caplog.records if "runs eagerly" in r.getMessage()]) == 1
    torch.testing.assert_close(loss, eager(x[:, :-1], x[:, 1:]).loss, rtol=0, atol=0)
    with pytest.raises(ValueError, match="'fast' is not auto, compiled or eager"):
        build_model(cfg, V, codes, modes=ModelModes(kernels="fast"))


def test_a_forward_measures_the_entropies_it_asks_for(cfg, codes):
    model = build_model(cfg, V, codes)
    x = torch.randint(1, V, (2, 9), generator=torch.Generator().manual_seed(0))
    plain, measured = model(x[:, :-1], x[:, 1:]), model(x[:, :-1], x[:, 1:], entropy=True)
    assert plain.head_entropy is None and measured.head_entropy.shape == (cfg.hash.num_hashes,)
    torch.testing.assert_close(measured.loss, plain.loss, rtol=0, atol=0)
    assert model(x[:, :-1], x[:, 1:]).head_entropy is None  # nothing of the model was switched


def _run_modes(rank, world, run_dir, data):
    """The modes of the model a training run builds with checkpointing every block and eager kernels."""
    from mhf_dist.train.loop import TrainingLoop
    from mhf_dist.train.preemption import StopSignal

    cfg = load_config(
        "tiny-h4b16k",
        overrides=[
            f"tokenizer.path={data['tokenizer']}",
            f"data.path={data['shards']}",
            "data.seq_len=64",
            "parallel.activation_checkpoint_interval=1",
            "train.fused_head_kernel=eager",
        ],
    )
    loop = TrainingLoop(cfg, StopSignal())
    assert loop.setup(run_dir, "none")
    model = loop.trainer.engine.module
    return model.backbone.checkpoint_interval, model.vocab.decoder.kernels.mode


@pytest.mark.multirank
def test_a_run_builds_its_model_in_the_runs_modes(tmp_path, data):
    assert run_ranks(_run_modes, 1, tmp_path / "run", data)[0] == (1, "eager")


def _pipeline_interval(rank, world):
    from mhf_dist.backend.deepspeed.pipeline import build_pipeline
    from mhf_dist.parallel.construct import Materialiser, SeededValues, model_skeleton
    from mhf_dist.parallel.groups import ParallelGroups
    from test_construction import join_distributed

    join_distributed(rank, world)
    cfg = load_config("tiny-h4b16k", overrides=["model.hash.num_buckets=64"]).model
    codes = SignatureTable.build(
        [f"tok{i}" for i in range(V)], cfg.hash.num_hashes, 64, pad_id=0
    ).codes
    model = model_skeleton(cfg, V, codes, compression=None, modes=ModelModes(checkpoint_interval=1))
    materialise = Materialiser(
        model, SeededValues(cfg.init_std, 0), torch.device("cpu"), 0, 1, None
    )
    pipe, _ = build_pipeline(model, ParallelGroups.create(1, 2), seq_len=8, materialise=materialise)
    return pipe.activation_checkpoint_interval


@pytest.mark.multirank
def test_a_pipeline_checkpoints_its_blocks_as_the_model_was_built():
    assert run_ranks(_pipeline_interval, 2) == [1, 1]
