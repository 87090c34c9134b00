"""Loss and gradient spikes: detected against the recent window, and under train.on_spike=skip left out before their
update on every layout (an injected spike: one step's loss multiplied by a large factor)."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from pydantic import ValidationError

from helpers.runs import metrics, run_cli, train_args
from mhf_dist.backend import SpikeLimits, consolidate
from mhf_dist.config import ConfigError, TrainConfig, load_config
from mhf_dist.data.reader import ShardReader
from mhf_dist.train.divergence import DivergenceSettings, LossWatch
from mhf_dist.train.fault_injection import LOSS_SPIKE_ENV
from mhf_dist.train.optim import skippable

SPIKE_STEP = 7


def test_the_watch_sets_limits_from_the_unspiked_window_and_counts_what_the_trainer_left_out():
    watch = LossWatch(
        DivergenceSettings.of(TrainConfig(spike_factor=3, grad_spike_factor=5, on_spike="skip"))
    )
    assert watch.limits() == SpikeLimits(math.inf, math.inf)  # fewer than five values: no limit yet
    for step, (loss, norm) in enumerate([(10, 1), (9, 2), (8, 1), (7, 2), (6, 1)], start=1):
        assert watch.observe(step, loss, norm) == []
    assert watch.limits() == SpikeLimits(3 * 8, 5 * 1)
    warnings = watch.observe(6, 30, 1, skipped=True)
    assert warnings == [
        "step 6: loss spike 30 > 3 x median of the last 5 (8); the step applied no update "
        "(train.on_spike=skip)"
    ]
    assert watch.observe(7, 7, 6) == ["step 7: gradient spike 6 > 5 x median of the last 5 (1)"]
    assert (watch.loss_spikes, watch.grad_spikes, watch.skipped) == (1, 1, 1)
    assert watch.limits() == SpikeLimits(3 * 8, 5 * 1)  # spikes stay out of the window
    resumed = LossWatch(watch.cfg)
    resumed.load_state_dict(watch.state_dict())
    assert resumed.limits() == watch.limits() and resumed.state_dict() == watch.state_dict()


def test_a_left_out_step_changes_no_weight_moment_or_step_count():
    p = torch.nn.Parameter(torch.randn(6))
    optimizer = skippable(torch.optim.AdamW([p], lr=0.1, weight_decay=0.1, fused=True))
    assert type(optimizer) is torch.optim.AdamW  # as DeepSpeed's ZeRO requires
    p.grad = torch.randn(6)
    optimizer.step()
    before = p.detach().clone(), {k: v.clone() for k, v in optimizer.state[p].items()}
    optimizer.skip_if = lambda: torch.tensor(1.0)
    p.grad = torch.randn(6) * 1e3
    optimizer.step()
    assert torch.equal(p.detach(), before[0])
    assert all(torch.equal(v, before[1][k]) for k, v in optimizer.state[p].items())
    optimizer.skip_if = lambda: torch.tensor(0.0)
    optimizer.step()
    assert not torch.equal(p.detach(), before[0]) and optimizer.state[p]["step"] == 2


def test_skip_needs_a_spike_factor_and_zero():
    with pytest.raises(
        ValidationError,
        match="train.on_spike=skip with neither train.spike_factor nor train.grad_spike_factor",
    ):
        TrainConfig(on_spike="skip")
    with pytest.raises(ConfigError, match="train.on_spike=skip with parallel.zero_stage=0"):
        load_config(
            "tiny-h4b16k",
            overrides=["train.on_spike=skip", "train.spike_factor=3", "parallel.zero_stage=0"],
        )


def _spiked_run(run, data, monkeypatch, *overrides, on_spike="skip", steps=SPIKE_STEP + 1):
    # a sample of the step's batch of 8
    monkeypatch.setenv(LOSS_SPIKE_ENV, f"{(SPIKE_STEP - 1) * 8}:1000")
    return run_cli(
        train_args(
            run,
            data,
            2,
            *overrides,
            "train.spike_factor=3",
            f"train.on_spike={on_spike}",
            "train.checkpoint_interval=1",
            steps=steps,
        )
    )


def _weights(run, step: int, pipeline: bool) -> dict[str, torch.Tensor]:
    return consolidate(run / "checkpoints" / f"step-{step:08d}", pipeline)


def _assert_skipped(run, out: str, pipeline: bool) -> None:
    """The spike of ``SPIKE_STEP`` was left out: its weights are those of the step before, bit for bit."""
    assert (
        f"warning: step {SPIKE_STEP}: loss spike" in out and "the step applied no update" in out
    ), out[-3000:]
    before, after, next_step = (
        _weights(run, s, pipeline) for s in (SPIKE_STEP - 1, SPIKE_STEP, SPIKE_STEP + 1)
    )
    assert before.keys() == after.keys()
    for name in before:
        assert torch.equal(before[name], after[name]), name
    assert any(not torch.equal(after[n], next_step[n]) for n in after)  # the run trains on after it
    records = {r["step"]: r for r in metrics(run) if "loss" in r}
    spike = records[SPIKE_STEP]
    assert spike["loss"] > 100 * records[SPIKE_STEP - 1]["loss"]
    assert (spike["skipped_steps"], spike["loss_spikes"]) == (1, 1)
    assert (
        records[SPIKE_STEP - 1]["skipped_steps"] == 0
        and records[SPIKE_STEP + 1]["skipped_steps"] == 1
    )
    # the schedule moved on (still warming up)
    assert records[SPIKE_STEP + 1]["lr"] > records[SPIKE_STEP]["lr"]


@pytest.mark.multirank
@pytest.mark.parametrize(
    "overrides, pipeline",
    [
        (["parallel.tp=2"], False),
        (["parallel.pp=2", "parallel.zero_stage=1", "train.dtype=bf16"], True),
    ],
    ids=["tp2-zero3", "pp2-zero1-bf16"],
)
def test_a_skipped_spike_leaves_every_weight_as_it_was(
    tmp_path, data, monkeypatch, overrides, pipeline
):
    """With tp > 1, and under the pipeline engine with ZeRO-1 in bf16 (DeepSpeed's bf16 optimizer: its fp32 master
    weights, unchanged, are copied back); ZeRO-3 with dp = 2 in fp32 is the next test's."""
    run = tmp_path / "run"
    _assert_skipped(run, _spiked_run(run, data, monkeypatch, *overrides), pipeline)


@pytest.mark.multirank
def test_warn_applies_the_spike_and_a_resumed_run_skips_it_as_the_uninterrupted_one(
    tmp_path, data, monkeypatch
):
    """ZeRO-3, dp = 2: the spike is left out, and under warn (the control) its update is applied. And the window of
    recent losses is in the checkpoint, so a run resumed just before the spike leaves it out as the run it continues
    does."""
    warned = tmp_path / "warn"
    out = _spiked_run(warned, data, monkeypatch, on_spike="warn", steps=SPIKE_STEP)
    assert f"warning: step {SPIKE_STEP}: loss spike" in out and "no update" not in out
    before, after = (_weights(warned, s, False) for s in (SPIKE_STEP - 1, SPIKE_STEP))
    assert any(not torch.equal(before[n], after[n]) for n in before)

    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    _assert_skipped(whole, _spiked_run(whole, data, monkeypatch), False)
    shutil.copytree(
        whole, resumed, ignore=shutil.ignore_patterns("metrics.jsonl", "tensorboard", "heartbeats")
    )
    # the spike injected as before
    before_spike = resumed / "checkpoints" / f"step-{SPIKE_STEP - 1:08d}"
    run_cli(
        train_args(
            resumed, data, 2, "train.spike_factor=3", "train.on_spike=skip", steps=SPIKE_STEP + 1
        )
        + ["--resume", str(before_spike)]
    )
    want = {r["step"]: r for r in metrics(whole) if "loss" in r}
    got = {r["step"]: r for r in metrics(resumed) if "loss" in r and r["step"] >= SPIKE_STEP}
    for step, record in got.items():
        assert (record["loss"], record["skipped_steps"]) == (
            want[step]["loss"],
            want[step]["skipped_steps"],
        ), step
    assert got[SPIKE_STEP]["skipped_steps"] == 1


def _batches(data, dp: int, count: int, skipped=(), state=None) -> tuple[list[set[bytes]], dict]:
    """``count`` global batches of 8 read by ``dp`` ranks' readers (each batch as the set of its samples), and the
    state after them."""
    readers = [
        ShardReader(data["shards"], dp_rank=r, dp_size=dp, skipped=skipped) for r in range(dp)
    ]
    for reader in readers:
        if state is not None:
            reader.load_state_dict(state)
    batches = [
        {row.tobytes() for reader in readers for row in reader.next_rows(8 // dp)}
        for _ in range(count)
    ]
    state = readers[0].state_dict()
    for reader in readers:
        reader.close()
    return batches, state


def test_a_skipped_range_is_never_read_on_any_rank_count_nor_after_a_resume(data):
    plain, _ = _batches(data, 1, 8)
    for dp in (1, 2, 4):
        batches, state = _batches(data, dp, 2, skipped=[(16, 32), (48, 56)])
        # the next unread: past the range
        assert batches == plain[:2] and state["position"] == 32, dp
        later, _ = _batches(data, dp, 3, skipped=[(16, 32), (48, 56)], state=state)
        assert later == [plain[4], plain[5], plain[7]], dp
    # a checkpoint's position
    resumed, _ = _batches(data, 2, 2, skipped=[(16, 32)], state={**state, "position": 16})
    assert resumed == plain[4:6]


@pytest.mark.multirank
def test_a_rollback_skips_the_spiking_data_and_matches_a_resume_by_hand(
    tmp_path, data, monkeypatch
):
    """Spikes come with two batches' data (those of steps 7 and 9 of an unskipped run). The first rolls the run back
    to its step-6 checkpoint (train.spike_patience=1) and skips that data; the run trains on, reading on past it, and
    meets the second at step 9, past train.max_rollbacks=1: it stops, naming the spike and the checkpoint to resume
    from. A copy of the run resumed by hand from step 6 with the same record reads the same data and meets the same
    numbers and stop."""
    monkeypatch.setenv(LOSS_SPIKE_ENV, "48:1000,72:1000")
    run = tmp_path / "run"

    def args(path):
        return train_args(
            path,
            data,
            2,
            "train.spike_factor=3",
            "train.on_spike=rollback",
            "train.spike_patience=1",
            "train.max_rollbacks=1",
            "train.checkpoint_interval=2",
            steps=10,
        )

    out = run_cli(args(run), expect_rc=2)
    back_to = run / "checkpoints" / "step-00000006"
    assert (
        f"rollback 1/1: 1 spike within the last 50 steps (step 7); back to {back_to} (step 6); the data read "
        "since it (global samples 48-55) is skipped"
    ) in out, out[-3000:]
    record = json.loads((run / "rollbacks.json").read_text())
    assert [(r["step"], r["spikes"], r["checkpoint"], r["skipped"]) for r in record] == [
        (7, [7], "step-00000006", [48, 56])
    ]
    stop = (
        "1 spike within the last 50 steps (step 9), and the run made its 1 rollback(s) (train.max_rollbacks; "
        f"{run / 'rollbacks.json'}); stopped without saving step 9. Resume from {run / 'checkpoints'}"
    )
    assert stop in out and "step-00000008 with a lower optimizer.lr" in out
    rolled = {r["step"]: r for r in metrics(run) if "loss" in r}
    assert sorted(rolled) == list(range(1, 10)) and rolled[7]["loss"] < 10 * rolled[6]["loss"]

    hand = tmp_path / "hand"
    shutil.copytree(
        run, hand, ignore=shutil.ignore_patterns("metrics.jsonl", "tensorboard", "heartbeats")
    )
    again = run_cli(
        args(hand) + ["--resume", str(hand / "checkpoints" / "step-00000006")], expect_rc=2
    )
    assert "back to" not in again and "(step 9), and the run made its 1 rollback(s)" in again
    by_hand = {r["step"]: r for r in metrics(hand) if "loss" in r}
    for step in (7, 8, 9):
        assert (by_hand[step]["loss"], by_hand[step]["grad_norm"]) == (
            rolled[step]["loss"],
            rolled[step]["grad_norm"],
        )
