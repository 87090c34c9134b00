"""Training on a weighted mixture of shard directories: the global order, resume on another dp, per-source metrics."""

from __future__ import annotations

import json

import pytest
import yaml

from helpers.runs import MIXTURE_WEIGHTS as WEIGHTS
from helpers.runs import metrics, run_cli, train_args
from mhf_dist.data.mixture import MixtureSchedule

pytestmark = pytest.mark.multirank


def mixture_args(run, data, sources, nproc: int, *overrides: str) -> list[str]:
    listed = json.dumps([s.model_dump(exclude_none=True) for s in sources])
    return train_args(run, data, nproc, "data.path=null", f"data.sources={listed}", "train.eval_interval=2",
                      *overrides, steps=4)


def test_a_mixture_trains_resumes_on_another_dp_and_reports_each_source(tmp_path, data, sources):
    out = run_cli(mixture_args(tmp_path / "full", data, sources, 2))
    full = metrics(tmp_path / "full")
    assert "source psalms: 0.50 of the mix" in out and "source gospels: 0.20 of the mix" in out
    run_cli(mixture_args(tmp_path / "split", data, sources, 1, "train.stop_at_step=2"))
    run_cli(mixture_args(tmp_path / "split", data, sources, 2))  # dp 1 -> 2: every source continues where it was
    split = [r for r in metrics(tmp_path / "split") if "loss" in r]
    assert [r["step"] for r in split] == [1, 2, 3, 4]
    for got, want in zip(split, [r for r in full if "loss" in r]):
        assert abs(got["loss"] - want["loss"]) <= 1e-5 * want["loss"], (got["step"], got["loss"], want["loss"])
        assert got["source_tokens"] == want["source_tokens"]
    seed = yaml.safe_load((tmp_path / "full/config.yaml").read_text())["train"]["seed"]  # the data order's too
    schedule = MixtureSchedule(list(WEIGHTS.values()), seed=seed)
    read = schedule.consumed(4 * 8)  # four steps of 8 sequences
    assert full[-1]["source_tokens"] == {name: int(n) * 64 for name, n in zip(WEIGHTS, read)}
    evaluated = full[-1]
    assert all(f"val_loss/{name}" in evaluated for name in WEIGHTS)
    weighted = sum(evaluated[f"val_loss/{name}"] * w for name, w in WEIGHTS.items()) / sum(WEIGHTS.values())
    assert evaluated["val_loss"] == pytest.approx(weighted)
