"""Learning-rate schedules (``optimizer.schedule``): each one's learning rate at every step, the settings refused at
the edge, a WSD run extended on resume and a decay branched from its checkpoint into a new run directory, both
step for step the run started with those settings, the refused extension of a cosine run, and ``status``."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from helpers.runs import metrics, run_cli, train_args, train_run
from mhf_dist.cli import main
from mhf_dist.config import ConfigError, OptimizerConfig, load_config
from mhf_dist.train.optim import build_optimizer, lr_factor
from mhf_dist.train.schedule import check_continuous

# a tiny run's schedule: 2 warm-up steps, so that stable and decay phases fit in a few steps
WSD = ("optimizer.schedule=wsd", "optimizer.warmup_steps=2", "parallel.zero_stage=1")


# ---------------------------------------------------------------- the formulas, written out here


def expected(step: int, schedule: str, lr_min: float, warmup: int, steps: int, **wsd) -> float:
    """The multiplier of optimizer.lr at 0-based ``step``, as docs/training.md defines each schedule."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    if schedule == "wsd":
        start = wsd.get("decay_start")
        if start is None:
            start = max(warmup, steps - round(wsd.get("decay_fraction", 0.2) * steps))
        shape = wsd.get("decay_shape", "1-sqrt")
    else:
        start, shape = warmup, schedule
    if step < start:
        return 1.0
    p = min(1.0, (step - start) / max(1, steps - start))
    if shape == "cosine":
        return lr_min + (1 - lr_min) * 0.5 * (1 + math.cos(math.pi * p))
    left = 1 - p if shape == "linear" else 1 - math.sqrt(p)
    return lr_min + (1 - lr_min) * left


CASES = [
    ("cosine", 0.0, 100, 1000, {}),
    ("cosine", 0.1, 10, 200, {}),
    ("cosine", 0.0, 0, 37, {}),
    ("linear", 0.0, 10, 200, {}),
    ("linear", 0.05, 3, 41, {}),
    ("constant", 0.0, 10, 200, {}),
    ("wsd", 0.0, 10, 200, {}),
    ("wsd", 0.1, 10, 200, {"decay_fraction": 0.33}),
    ("wsd", 0.0, 4, 97, {"decay_shape": "linear"}),
    ("wsd", 0.02, 4, 97, {"decay_shape": "cosine", "decay_fraction": 1.0}),
    ("wsd", 0.0, 10, 200, {"decay_start": 150}),
    ("wsd", 0.1, 10, 200, {"decay_start": 10, "decay_shape": "linear"}),
    ("wsd", 0.0, 50, 60, {"decay_fraction": 0.5}),  # the decay would begin in the warm-up: after it
]


@pytest.mark.parametrize("schedule, lr_min, warmup, steps, wsd", CASES)
def test_every_schedule_follows_its_formula_at_every_step(schedule, lr_min, warmup, steps, wsd):
    cfg = OptimizerConfig(
        schedule=schedule, min_lr_ratio=lr_min, warmup_steps=warmup, lr=1e-3, **wsd
    )
    for step in range(steps + 3):  # the scheduler is asked past the last step too
        assert lr_factor(step, cfg, steps) == expected(
            step, schedule, lr_min, warmup, steps, **wsd
        ), step
    # what the optimizer's groups are given, step by step
    weight, bias = torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2))
    optimizer, scheduler = build_optimizer(
        [("backbone.up.weight", weight), ("backbone.up.bias", bias)], cfg, steps
    )
    for step in range(steps):
        want = 1e-3 * expected(step, schedule, lr_min, warmup, steps, **wsd)
        assert [g["lr"] for g in optimizer.param_groups] == [want, want], step
        optimizer.step()
        scheduler.step()


def test_the_default_schedule_is_the_papers_cosine():
    cfg = load_config("tiny-h4b16k").optimizer
    assert cfg.schedule == "cosine" and cfg.allow_lr_jump is False
    assert (cfg.decay_start, cfg.decay_fraction, cfg.decay_shape) == (None, None, None)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["optimizer.decay_start=50"],
            "optimizer.decay_start=50 with optimizer.schedule=cosine: only wsd has a decay phase to place; "
            "set optimizer.schedule=wsd, or leave decay_start unset",
        ),
        (
            ["optimizer.schedule=linear", "optimizer.decay_shape=cosine"],
            "optimizer.decay_shape=cosine with optimizer.schedule=linear",
        ),
        (
            ["optimizer.schedule=wsd", "optimizer.decay_start=200"],
            "optimizer.decay_start=200 is not before train.max_steps=200: no step would decay; set "
            "decay_start below 200, or raise train.max_steps",
        ),
        (
            ["optimizer.schedule=wsd", "optimizer.decay_start=5"],
            "optimizer.decay_start=5 falls in the warm-up (optimizer.warmup_steps=10)",
        ),
        (
            ["optimizer.schedule=constant", "optimizer.min_lr_ratio=0.1"],
            "optimizer.min_lr_ratio=0.1 with optimizer.schedule=constant, which never decays",
        ),
        (
            ["optimizer.schedule=wsd", "optimizer.decay_fraction=0"],
            "optimizer.decay_fraction: Input should be greater than 0",
        ),
        (
            ["optimizer.schedule=wsd", "optimizer.decay_shape=sqrt"],
            "optimizer.decay_shape: Input should be 'linear', 'cosine' or '1-sqrt'",
        ),
        (
            ["optimizer.schedule=step"],
            "optimizer.schedule: Input should be 'cosine', 'wsd', 'linear' or 'constant'",
        ),
    ],
)
def test_schedule_settings_are_checked_at_the_edge(overrides, message):
    with pytest.raises(ConfigError, match="invalid run config") as caught:
        load_config("tiny-h4b16k", overrides=overrides)
    assert message in str(caught.value)


def test_a_resume_may_change_the_timing_only_where_the_learning_rate_stays_continuous():
    cosine, wsd = OptimizerConfig(warmup_steps=10), OptimizerConfig(warmup_steps=10, schedule="wsd")
    check_continuous(5, cosine, 100, cosine, 200)  # in the warm-up: as a run started with 200
    check_continuous(60, wsd, 100, wsd, 200)  # stable in both: the decay moves from 80 to 160
    branch = wsd.model_copy(update={"decay_start": 60})
    check_continuous(60, wsd, 100, branch, 90)  # a decay branched from the checkpoint of step 60
    check_continuous(50, cosine, 100, cosine.model_copy(update={"allow_lr_jump": True}), 200)
    with pytest.raises(ConfigError) as cosine_error:
        check_continuous(50, cosine, 100, cosine, 200)
    with pytest.raises(ConfigError) as wsd_error:
        check_continuous(90, wsd, 100, wsd, 200)
    with pytest.raises(ConfigError) as branch_error:
        check_continuous(70, wsd, 100, branch, 90)
    assert (
        "train.max_steps 100 -> 200 would make the learning rate jump at the resumed step 51"
        in str(cosine_error.value)
    )
    assert (
        "step 90, the checkpoint's, is past step 80, after which the schedule it was trained with"
        in str(wsd_error.value)
    )
    assert "decay from the checkpoint of step 60 (--resume RUN/checkpoints/step-00000060)" in str(
        branch_error.value
    )
    for error in (cosine_error, wsd_error, branch_error):
        assert "--set optimizer.allow_lr_jump=true" in str(error.value)


# ---------------------------------------------------------------- training runs (one rank)


@pytest.fixture(scope="module")
def stable(tmp_path_factory, data):
    """A WSD run of 8 steps (its decay after step 6) stopped at step 5, in its stable phase."""
    root = tmp_path_factory.mktemp("stable")
    train_run(root, data, "run", 1, *WSD, "train.stop_at_step=5", steps=8)
    return root / "run"


def lr_and_loss(records: list[dict]) -> dict[int, tuple[float, float]]:
    return {r["step"]: (r["lr"], r["loss"]) for r in records if "loss" in r}


def snapshot(path: Path) -> dict[str, str]:
    """Every file under ``path`` and a digest of its content."""
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file() and "heartbeats" not in p.parts
    }


@pytest.mark.multirank
def test_a_wsd_run_extended_on_resume_is_the_run_started_that_long(tmp_path, data, stable):
    # a copy: the module's run stays as it is
    run = Path(shutil.copytree(stable, tmp_path / "run", symlinks=True))
    out = run_cli(train_args(run, data, 1, *WSD, steps=12))
    assert (
        "changed on resume, from step 6: train.max_steps: 8 -> 12 (the learning-rate schedule now ends at "
        "step 12; its decay begins after step 10)"
    ) in out, out[-3000:]
    whole = lr_and_loss(train_run(tmp_path, data, "whole", 1, *WSD, steps=12))
    extended = lr_and_loss(metrics(run))
    assert sorted(extended) == list(range(1, 13))
    assert extended == whole  # bit-identical learning rates and losses
    lrs = [whole[s][0] for s in range(1, 13)]
    # the peak from step 3 to step 11, the decay's first (at progress 0), then the decay
    assert lrs[2:11] == [lrs[2]] * 9 and lrs[10] > lrs[11] > 0


@pytest.mark.multirank
def test_a_decay_branched_from_a_stable_checkpoint_is_the_run_with_that_decay_start(
    tmp_path, data, stable, capsys
):
    before = snapshot(stable)
    branch = tmp_path / "branch"
    out = run_cli(
        [
            "train",
            "--config",
            str(stable / "config.yaml"),
            "--run-dir",
            str(branch),
            "--nproc-per-node",
            "1",
            "--resume",
            str(stable / "checkpoints" / "step-00000005"),
            "--set",
            "train.stop_at_step=null",
            "--set",
            "optimizer.decay_start=5",
            "--set",
            "train.max_steps=8",
        ]
    )
    assert "changed on resume, from step 6: optimizer.decay_start: None -> 5" in out, out[-3000:]
    assert snapshot(stable) == before  # the source run is as it was: it may go on, or branch again
    uninterrupted = lr_and_loss(
        train_run(tmp_path, data, "uninterrupted", 1, *WSD, "optimizer.decay_start=5", steps=8)
    )
    source, branched = lr_and_loss(metrics(stable)), lr_and_loss(metrics(branch))
    assert sorted(source) == [1, 2, 3, 4, 5] and sorted(branched) == [6, 7, 8]
    assert source | branched == uninterrupted  # bit-identical, step for step
    assert uninterrupted[6][0] > uninterrupted[7][0] > uninterrupted[8][0]

    assert main(["status", str(branch), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["schedule"] == {
        "name": "wsd",
        "phase": "decay",
        "decay_start": 5,
    }
    assert main(["status", str(stable)]) == 0
    assert "schedule   wsd, stable at step 5 (decay after step 6 to 8)\n" in capsys.readouterr().out


@pytest.mark.multirank
def test_a_longer_cosine_run_is_refused_on_resume_naming_wsd_and_the_jump_setting(tmp_path, data):
    cosine = ("optimizer.warmup_steps=1", "parallel.zero_stage=1")
    train_run(tmp_path, data, "run", 1, *cosine, steps=3)
    run = tmp_path / "run"
    out = run_cli(train_args(run, data, 1, *cosine, steps=5), expect_rc=2)
    assert (
        "train.max_steps 3 -> 5 would make the learning rate jump at the resumed step 4, from 0 to"
        in out
    )
    assert "train the runs you may extend with optimizer.schedule=wsd" in out, out[-3000:]
    assert "--set optimizer.allow_lr_jump=true" in out
    assert [r["step"] for r in metrics(run) if "loss" in r] == [1, 2, 3]  # nothing trained
