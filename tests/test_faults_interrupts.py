"""Interruptions by a person or a node: Ctrl-C once (save, stop), twice (abort without saving), a rank killed, the
launcher killed. Real processes and signals: the command runs in a session of its own and gets Ctrl-C as a terminal
sends it, to its whole process group.

Each case ends in one line per process saying what happened and what was lost (no traceback unless --debug), a
documented exit code, no rank left running, and nothing already saved lost.
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from helpers.jobs import Job
from helpers.runs import metrics, train_args
from mhf_dist.errors import ABORTED_EXIT_CODE, PREEMPTED_EXIT_CODE, RANK_LOST_EXIT_CODE
from mhf_dist.storage.run_lock import running
from mhf_dist.train.preemption import StopSignal

STEPS = 10_000  # far more than a test waits for: every run here ends by a signal


def _args(run, data, nproc: int | None, *overrides: str) -> list[str]:
    """Training arguments with ``nproc`` local ranks, or one process without a launcher (None)."""
    args = train_args(run, data, nproc or 1, *overrides, steps=STEPS)
    return args if nproc else [a for a in args if a not in ("--nproc-per-node", "1")]


def _complete(run) -> list[str]:
    return sorted(p.parent.name for p in run.glob("checkpoints/step-*/complete.json"))


def _assert_ended(pids) -> None:
    assert not [pid for pid in pids if running(pid)], "a rank outlived its launcher"


@pytest.mark.multirank
@pytest.mark.parametrize("nproc", [None, 2], ids=["one-process", "2-ranks"])
def test_ctrl_c_saves_and_stops_and_a_second_aborts_without_saving(tmp_path, data, nproc):
    run = tmp_path / "run"
    job = Job(_args(run, data, nproc), tmp_path / "first.log")
    job.wait_for(f"step 2/{STEPS}")
    ranks = job.ranks().values()
    job.ctrl_c()
    code, out = job.end()
    assert code == PREEMPTED_EXIT_CODE, out[-3000:]
    assert (
        "interrupted: finishing this step, then saving (Ctrl-C again aborts without saving)" in out
    )
    saved = re.search(
        r"interrupted: saved (step-\d{8}); rerun the same command to resume", out
    ).group(1)
    assert "Traceback" not in out and "KeyboardInterrupt" not in out
    assert _complete(run) == [saved] and metrics(run)[-1]["step"] == int(saved[5:])
    _assert_ended(ranks)

    # the same command resumes; Ctrl-C twice, the second while the save is under way, aborts it
    job = Job(_args(run, data, nproc), tmp_path / "second.log", MHF_DIST_TEST_SAVE_PAUSE="60")
    job.wait_for(f"step {int(saved[5:]) + 1}/{STEPS}")
    ranks = job.ranks().values()
    job.ctrl_c()
    job.wait_for("Ctrl-C again aborts without saving")
    job.ctrl_c()
    code, out = job.end()
    assert code == ABORTED_EXIT_CODE, out[-3000:]
    assert (
        f"aborted without saving: the steps since {saved} are lost; rerun the same command to resume from it"
        in out
    )
    assert "Traceback" not in out and "KeyboardInterrupt" not in out
    assert _complete(run) == [saved]
    _assert_ended(ranks)


def test_a_first_ctrl_c_during_start_up_promises_no_step_and_no_save(capfd, monkeypatch):
    """Before the first step there is no step to finish and nothing to save: the note says what happens instead."""
    monkeypatch.delenv("RANK", raising=False)
    before = (
        signal.getsignal(signal.SIGINT),
        signal.getsignal(signal.SIGUSR1),
        signal.getsignal(signal.SIGTERM),
    )
    try:
        notes = []
        for training in (False, True):
            # a new one each time: a second Ctrl-C would abort
            stop = StopSignal(lambda: "nothing is lost")
            if training:
                # the ranks agreed to go on: the steps begin
                assert stop.start_up_ends(False) is False
            os.kill(os.getpid(), signal.SIGINT)
            assert stop.received and stop.interrupted
            notes.append(capfd.readouterr().err)
    finally:
        for sig, handler in zip((signal.SIGINT, signal.SIGUSR1, signal.SIGTERM), before):
            signal.signal(sig, handler)
    assert notes == [
        "interrupted during start-up: stopping once the model is built, before the first step and "
        "without a checkpoint (Ctrl-C again aborts at once)\n",
        "interrupted: finishing this step, then saving (Ctrl-C again aborts without saving)\n",
    ]


@pytest.mark.multirank
def test_a_rank_killed_by_a_signal_is_named_and_the_others_stop(tmp_path, data):
    run = tmp_path / "run"
    args = _args(run, data, 2, "train.checkpoint_interval=2", "train.checkpoint_minutes=60")
    job = Job(args, tmp_path / "plain.log")
    job.wait_for("step-00000002 (interval")
    ranks = job.ranks()
    os.kill(ranks[1], signal.SIGKILL)
    code, out = job.end()
    assert code == RANK_LOST_EXIT_CODE, out[-3000:]
    assert f"rank 1 (pid {ranks[1]}) was killed by SIGKILL; stopping the others" in out
    newest = _complete(run)[-1]
    assert (
        f"the steps since {newest} are lost; rerun the same command to resume from it "
        "(train.checkpoint_minutes=60 bounds such a loss to 60 min)"
    ) in out
    # rank 0's collective failed when rank 1's connection closed: one line, no traceback
    assert re.findall(
        r"^mhf-dist \[rank 0\]: a collective failed, as another rank ended or stopped answering \(.+\); "
        r"stopping \(--debug shows the traceback\)$",
        out,
        re.M,
    ), out[-3000:]
    assert "Traceback" not in out and "[rank0]" not in out
    _assert_ended(ranks.values())

    # --debug: the surviving rank's traceback in full; the rerun resumes from the newest checkpoint
    job = Job(["--debug", *args], tmp_path / "debug.log")
    job.wait_for(f"resumed from {run / 'checkpoints' / newest}")
    job.wait_for(f"step {int(newest[5:]) + 1}/{STEPS}")
    os.kill(job.ranks()[1], signal.SIGKILL)
    code, out = job.end()
    assert code == RANK_LOST_EXIT_CODE and "Traceback" in out and "Connection" in out, out[-3000:]


@pytest.mark.multirank
def test_ranks_end_with_their_launcher(tmp_path, data):
    job = Job(_args(tmp_path / "run", data, 1), tmp_path / "out.log")
    job.wait_for(f"step 1/{STEPS}")
    (rank,) = job.ranks().values()
    job.proc.kill()  # the launcher alone, which cannot reap or stop anything
    job.end()
    deadline = time.time() + 60
    while running(rank) and time.time() < deadline:
        time.sleep(0.1)
    still = running(rank)
    if still:
        os.kill(rank, signal.SIGKILL)
    assert not still, "the rank kept training after its launcher was killed"
