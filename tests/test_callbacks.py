"""The training loop's callbacks: one installed from the test directory through ``train.callbacks`` sees every hook,
once per step and in order, on every rank of a multi-rank run; a path that names no callback is refused with the
path named; the loss wrappers of callbacks reach the trainer in order."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers.callbacks import HookRecorder
from helpers.runs import metrics, run_cli, train_args
from mhf_dist.config import ConfigError, load_config
from mhf_dist.train.callbacks import Callback, Callbacks, installed
from mhf_dist.train.monitors import run_callbacks

RECORDER = 'train.callbacks=["helpers.callbacks:HookRecorder"]'
# a step that is logged, evaluated and saved; the evaluation's progress is called once per micro-batch and pass
STEP = [
    "before_step",
    "spike_limits",
    "wants_save",
    "after_step",
    "record",
    "before_eval",
    "eval_progress",
    "on_log",
    "wants_rollback",
    "allows_save",
    "before_save",
    "after_save",
]


def _calls(path: Path) -> list[tuple[str, int]]:
    """The hooks a recorder wrote, a run of ``eval_progress`` calls as one."""
    calls = [
        (hook, int(step)) for hook, step in (line.split() for line in path.read_text().splitlines())
    ]
    return [c for i, c in enumerate(calls) if not (c[0] == "eval_progress" and calls[i - 1] == c)]


@pytest.mark.multirank
def test_a_callback_from_the_test_directory_sees_every_hook_once_per_step_in_order(
    tmp_path, data, monkeypatch
):
    # where ranks started afresh would import it from
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))
    run = tmp_path / "run"
    run_cli(
        train_args(
            run, data, 2, RECORDER, "train.eval_interval=1", "train.checkpoint_interval=1", steps=3
        )
    )
    want = [
        ("on_start", 0),
        *((hook, step) for step in (1, 2, 3) for hook in STEP),
        ("on_end", 3),
        ("close(True)", 3),
    ]
    for rank in (0, 1):
        assert _calls(run / f"hooks-rank{rank}.txt") == want, rank
    assert [r["step"] for r in metrics(run)] == [1, 2, 3]  # the monitors ran as ever beside it


def test_the_setting_adds_the_callback_after_the_monitors_and_refuses_a_path_that_names_none():
    callbacks = run_callbacks(load_config("tiny-h4b16k", overrides=[RECORDER]))
    assert isinstance(callbacks[-1], HookRecorder) and not any(
        isinstance(c, HookRecorder) for c in callbacks[:-1]
    )
    with pytest.raises(
        ConfigError, match="train.callbacks: 'helpers.absent:Recorder' cannot be imported"
    ):
        installed(["helpers.absent:Recorder"])
    with pytest.raises(ConfigError, match="'helpers.runs:train_args' is not a Callback class"):
        installed(["helpers.runs:train_args"])


@pytest.mark.multirank
def test_a_run_with_a_bad_callback_path_stops_before_it_starts_naming_the_path(tmp_path, data):
    out = run_cli(
        train_args(tmp_path / "run", data, 1, 'train.callbacks=["helpers.runs:Absent"]'),
        expect_rc=2,
    )
    assert "train.callbacks: 'helpers.runs:Absent' cannot be imported" in out, out[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_the_trainer_gets_the_callbacks_loss_wrappers_one_after_the_other():
    class Times(Callback):
        def __init__(self, factor):
            self.factor = factor

        def wrap_loss(self, loss):
            return loss * self.factor

    class Plus(Callback):
        def wrap_loss(self, loss):
            return loss + 1

    # a run: the trainer's loss as it is
    assert Callbacks([Callback(), HookRecorder()]).loss_wrapper() is None
    wrapper = Callbacks([Times(3.0), Callback(), Plus()]).loss_wrapper()
    assert wrapper(torch.tensor(2.0)).item() == 7.0
