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
    return train_args(
        run,
        data,
        nproc,
        "data.path=null",
        f"data.sources={listed}",
        "train.eval_interval=2",
        *overrides,
        steps=4,
    )


def test_a_mixture_trains_resumes_on_another_dp_and_reports_each_source(tmp_path, data, sources):
    out = run_cli(mixture_args(tmp_path / "full", data, sources, 2))
    full = metrics(tmp_path / "full")
    assert "source psalms: 0.50 of the mix" in out and "source gospels: 0.20 of the mix" in out
    run_cli(mixture_args(tmp_path / "split", data, sources, 1, "train.stop_at_step=2"))
    # dp 1 -> 2: every source continues where it was
    run_cli(mixture_args(tmp_path / "split", data, sources, 2))
    split = [r for r in metrics(tmp_path / "split") if "loss" in r]
    assert [r["step"] for r in split] == [1, 2, 3, 4]
    for got, want in zip(split, [r for r in full if "loss" in r]):
        assert abs(got["loss"] - want["loss"]) <= 1e-5 * want["loss"], (
            got["step"],
            got["loss"],
            want["loss"],
        )
        assert got["source_tokens"] == want["source_tokens"]
    # the data order's too
    seed = yaml.safe_load((tmp_path / "full/config.yaml").read_text())["train"]["seed"]
    schedule = MixtureSchedule(list(WEIGHTS.values()), seed=seed)
    read = schedule.consumed(4 * 8)  # four steps of 8 sequences
    assert full[-1]["source_tokens"] == {name: int(n) * 64 for name, n in zip(WEIGHTS, read)}
    evaluated = full[-1]
    assert all(f"val_loss/{name}" in evaluated for name in WEIGHTS)
    weighted = sum(evaluated[f"val_loss/{name}"] * w for name, w in WEIGHTS.items()) / sum(
        WEIGHTS.values()
    )
    assert evaluated["val_loss"] == pytest.approx(weighted)


def test_a_resume_through_the_run_directory_takes_another_mixture_with_data_restart(
    tmp_path, data, sources
):
    """docs/data.md: a resume with other sources or weights, given as data.sources or as a blend in data.path, reads
    the new mixture from its beginning with data.restart=true (refused without it); config.yaml then names it."""
    run = tmp_path / "run"
    listed = json.dumps([s.model_dump(exclude_none=True) for s in sources[:2]])
    run_cli(train_args(run, data, 1, "data.path=null", f"data.sources={listed}", steps=1))

    def resume(data_setting: str, *more: str, expect_rc: int = 0) -> str:
        return run_cli(
            ["train", "--run-dir", str(run), "--set", data_setting, *more], expect_rc=expect_rc
        )

    weighted = [{"path": s.path, "weight": w} for s, w in zip(sources, (1.0, 1.0, 2.0))]
    refused = resume(
        f"data.sources={json.dumps(weighted)}", "--set", "train.max_steps=2", expect_rc=2
    )
    assert (
        "--set data.restart=true" in refused and "fields a resume cannot change" not in refused
    ), refused[-3000:]
    out = resume(
        f"data.sources={json.dumps(weighted)}",
        "--set",
        "data.restart=true",
        "--set",
        "train.max_steps=2",
    )
    assert "data.restart: from step 2 the data is read from the beginning of" in out, out[-3000:]
    assert yaml.safe_load((run / "config.yaml").read_text())["data"]["sources"] == [
        {"path": s["path"], "weight": s["weight"], "name": None} for s in weighted
    ]
    assert set(metrics(run)[-1]["source_tokens"]) == {"psalms", "law", "gospels"}

    out = resume(
        f"data.path=1 {sources[2].path}", "--set", "data.restart=true", "--set", "train.max_steps=3"
    )
    assert "data.restart: from step 3 the data is read from the beginning of" in out, out[-3000:]
    saved = yaml.safe_load((run / "config.yaml").read_text())["data"]
    assert saved["path"] is None and saved["sources"] == [
        {"path": sources[2].path, "weight": 1.0, "name": None}
    ]
    assert set(metrics(run)[-1]["source_tokens"]) == {"gospels"}
