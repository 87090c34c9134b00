"""Resuming a run: a longer schedule."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from helpers.runs import metrics, run_cli, train_args, train_run
from mhf_dist.config import load_config
from mhf_dist.train.optim import lr_factor

WARMUP = "optimizer.warmup_steps=1"  # the schedule leaves warm-up at once, so its end (lr 0 at step 4) shows


@pytest.fixture(scope="module")
def finished(tmp_path_factory, data):
    """A one-rank run trained to its end, step 3."""
    root = tmp_path_factory.mktemp("finished")
    train_run(root, data, "run", 1, "parallel.zero_stage=1", WARMUP, steps=3)
    return root / "run"


def copy_of(run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run, tmp_path / "run"))


@pytest.mark.multirank
def test_a_raised_max_steps_sets_the_schedule_from_the_first_resumed_step(tmp_path, data, finished):
    run = copy_of(finished, tmp_path)
    out = run_cli(train_args(run, data, 1, "parallel.zero_stage=1", WARMUP, steps=5))
    change = "changed on resume, from step 4: train.max_steps: 3 -> 5 (the learning-rate schedule now ends at step 5)"
    assert out.count(change) == 1, out[-3000:]
    cfg = load_config("tiny-h4b16k", overrides=[WARMUP]).optimizer
    lr = {r["step"]: r["lr"] for r in metrics(run)}
    assert lr[3] == pytest.approx(cfg.lr * lr_factor(2, cfg, 3))
    assert lr[4] == pytest.approx(cfg.lr * lr_factor(3, cfg, 5)) and lr[4] > 0  # the old schedule ended at 0
    assert lr[5] == pytest.approx(cfg.lr * lr_factor(4, cfg, 5))
