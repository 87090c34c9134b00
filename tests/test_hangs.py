"""A hang is named, not waited out: a rank that stops answering (SIGSTOP, as a lost node or a wedged device does)
ends the job within the hang timeout, with every live rank's stacks on disk and the stopped rank named, and the rerun
resumes; the heartbeats' verdicts; ``status`` says HUNG with the ranks."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from helpers.jobs import Job
from helpers.runs import metrics, train_args
from mhf_dist.cluster.status import gather, render
from mhf_dist.errors import (
    ERROR_EXIT_CODE,
    HUNG_EXIT_CODE,
    NODE_LOST_EXIT_CODE,
    PREEMPTED_EXIT_CODE,
)
from mhf_dist.storage.heartbeats import rank_health, read_heartbeats, write_heartbeat
from mhf_dist.storage.run_dir import RunDir
from mhf_dist.storage.run_lock import running
from mhf_dist.train.watchdog import HangSettings, Watchdog

STEPS = 10_000  # far more than a test waits for
HANG_TIMEOUT_S = 8


def _beat(
    rank: int,
    now: float,
    step: int = 5,
    phase: str = "step",
    since: float | None = None,
    beat: float | None = None,
    node: str = "n1",
) -> dict:
    return {
        "rank": rank,
        "node": node,
        "pid": 1000 + rank,
        "step": step,
        "phase": phase,
        "since": now - 1 if since is None else since,
        "beat": now if beat is None else beat,
        "beat_s": 1.0,
        "hang_timeout_s": 60.0,
        "started": now - 100,
    }


def test_heartbeats_tell_a_stopped_a_stuck_and_a_healthy_job_apart():
    now = time.time()
    healthy = [
        _beat(0, now),
        _beat(1, now, step=4, node="n2"),
    ]  # one rank a step behind for a moment: not a hang
    assert not rank_health(healthy, now).hung

    stopped = [_beat(0, now), _beat(1, now, step=4, beat=now - 30, node="n2")]
    health = rank_health(stopped, now)
    assert health.hung and [b["rank"] for b in health.not_answering] == [1]
    assert health.describe(now) == [
        "not answering: rank 1 (n2, pid 1001, last heartbeat 30 s ago, in step 4)",
        "did not reach step 5: rank 1 (n2, in step 4)",
    ]

    stuck = [
        _beat(0, now, since=now - 90),
        _beat(1, now, since=now - 90),
    ]  # both answer, no progress for 90 s
    assert rank_health(stuck, now).hung and len(rank_health(stuck, now).stalled) == 2

    gone = [
        _beat(0, now, beat=now - 30),
        _beat(1, now, beat=now - 30),
    ]  # every rank silent: no job runs
    assert rank_health(gone, now) is None
    finished = [
        _beat(0, now, phase="finished", since=now - 300),
        _beat(1, now, beat=now - 300, phase="finished"),
    ]
    assert not rank_health(finished, now).hung


def test_status_shows_a_running_job_whose_heartbeats_disagree_as_hung(tmp_path):
    run = RunDir(tmp_path / "run")
    run.heartbeats_dir.mkdir(parents=True)
    (run.path / "config.yaml").write_text("preset: tiny-h4b16k\ntrain: {max_steps: 100}\n")
    now = time.time()
    for beat in (_beat(0, now), _beat(1, now, node="n2")):
        write_heartbeat(run, beat)
    st = gather(run.path)
    assert not st.ranks.hung and st.ranks.nodes == ["n1", "n2"]
    assert "ranks      2 ranks on n1, n2" in render(st)

    write_heartbeat(run, _beat(1, now, step=4, beat=now - 30, node="n2"))
    st = gather(run.path)
    assert st.ranks.hung
    assert "ranks      HUNG (2 ranks on n1, n2): not answering: rank 1 (n2, pid 1001" in render(st)


def _stopped_mid_run(
    job: Job, run: Path, step: int, timeout: float
) -> tuple[int, str, dict[int, int]]:
    """Rank 1 of ``job`` stopped (SIGSTOP) once step ``step`` is logged and rank 1's own heartbeat says it is in a
    step (its heartbeat thread writes every few seconds, so right after the log it may still say "starting"): the
    job's exit code, output and rank pids."""
    job.wait_for(f"step {step}/{STEPS}")
    deadline = time.monotonic() + 60
    while not any(
        b["rank"] == 1 and b.get("phase") == "step" for b in read_heartbeats(RunDir(run))
    ):
        assert time.monotonic() < deadline, "rank 1's heartbeat never said it was in a step"
        time.sleep(0.2)
    ranks = job.ranks()
    os.kill(ranks[1], signal.SIGSTOP)
    try:
        code, out = job.end(timeout=timeout)
    finally:
        if running(ranks[1]):
            os.kill(ranks[1], signal.SIGKILL)
    return code, out, ranks


def test_only_a_hang_folder_made_after_the_watchdog_started_is_this_jobs(tmp_path):
    """A start that follows one the watchdog ended, within the second its last rank wrote the hang's folder, does
    not take that folder for a hang another of its own ranks declared; a folder made after it started is one."""
    run = RunDir(tmp_path / "run")
    earlier = run.hangs_dir / "2026-01-01T00-00-00Z"
    earlier.mkdir(parents=True)
    # written just now: the folder's time is this second's
    (earlier / "rank-0.txt").write_text("stacks")
    watchdog = Watchdog(run, rank=1, settings=HangSettings(hang_timeout_s=3))
    assert watchdog._declared_hang() is None
    declared = run.hangs_dir / "2026-01-01T00-00-09Z"
    declared.mkdir()
    assert watchdog._declared_hang() == declared


@pytest.mark.multirank
def test_a_stopped_rank_ends_the_job_with_every_live_ranks_stacks_and_the_rerun_resumes(
    tmp_path, data
):
    run = tmp_path / "run"
    # without the watchdog rank 0 would wait out the process group's 10 minutes, past job.end's limit
    args = train_args(
        run,
        data,
        2,
        "train.checkpoint_interval=2",
        f"train.hang_timeout_s={HANG_TIMEOUT_S}",
        "train.dist_timeout_minutes=10",
        steps=STEPS,
    )
    code, out, ranks = _stopped_mid_run(
        Job(args, tmp_path / "hang.log"), run, 3, HANG_TIMEOUT_S + 90
    )
    assert code == HUNG_EXIT_CODE, out[-3000:]

    (hang,) = (run / "hangs").iterdir()
    assert sorted(p.name for p in hang.iterdir()) == [
        "hang.json",
        "rank-0.txt",
        "summary.txt",
    ]  # rank 1 wrote none
    stacks = (hang / "rank-0.txt").read_text()
    assert "most recent call first" in stacks
    assert re.search(r'File ".*mhf_dist/train/loop\.py", line \d+ in run', stacks), stacks[:3000]
    assert re.search(
        rf"not answering: rank 1 \([^,]+, pid {ranks[1]}, last heartbeat \d+ s ago", out
    ), out[-3000:]
    assert f"stacks of ranks 0 in {hang}" in out and f"exit {HUNG_EXIT_CODE}" in out
    assert (hang / "summary.txt").read_text().splitlines()[1].startswith("not answering: rank 1")

    newest = sorted(p.parent.name for p in run.glob("checkpoints/step-*/complete.json"))[-1]
    job = Job(args, tmp_path / "rerun.log")
    job.wait_for(f"resumed from {run / 'checkpoints' / newest}")
    job.wait_for(f"step {int(newest[5:]) + 1}/{STEPS}")
    job.ctrl_c()
    code, out = job.end()
    assert code == PREEMPTED_EXIT_CODE, out[-3000:]
    beats = [json.loads(p.read_text()) for p in sorted((run / "heartbeats").glob("rank-*.json"))]
    assert [b["phase"] for b in beats] == ["finished", "finished"]


@pytest.mark.multirank
def test_a_rank_without_a_heartbeat_for_the_peer_timeout_is_lost_with_its_node(tmp_path, data):
    """A stopped rank's heartbeat ages as a dead node's would: once the others have waited on it for
    ``train.peer_timeout_s`` (long before the hang timeout), they stop with the node and rank named and recorded."""
    run = tmp_path / "run"
    args = train_args(
        run,
        data,
        2,
        "train.peer_timeout_s=4",
        "train.hang_timeout_s=600",
        "train.dist_timeout_minutes=10",
        steps=STEPS,
    )
    code, out, _ = _stopped_mid_run(Job(args, tmp_path / "lost.log"), run, 2, 90)
    assert code == NODE_LOST_EXIT_CODE, out[-3000:]
    lost = json.loads((run / "heartbeats" / "lost.json").read_text())
    assert lost["ranks"] == [1] and len(lost["nodes"]) == 1
    assert re.search(
        rf"lost node {re.escape(lost['nodes'][0])}: rank 1 sent no heartbeat for over 4 s "
        rf"\(train.peer_timeout_s\), in step \d+; stopping without a save \(exit {NODE_LOST_EXIT_CODE}\)",
        out,
    ), out[-3000:]
    assert not (run / "hangs").exists()  # not a hang: no stacks


def _hang_job(
    tmp_path: Path, data: dict, name: str, *overrides: str, steps: int = 2, **env: str
) -> tuple[int, str]:
    """One rank of a run ``run`` with ``train.hang_timeout_s`` of 3 s, to its end; its exit code and output."""
    args = train_args(tmp_path / "run", data, 1, "train.hang_timeout_s=3", *overrides, steps=steps)
    return Job(args, tmp_path / f"{name}.log", **env).end(timeout=300)


@pytest.mark.multirank
def test_healthy_phases_longer_than_the_hang_timeout_are_not_hangs(tmp_path, data):
    """A first step of 6 s (a compile), and at every step an evaluation of 8 s and a save of a second a file: each
    longer than the 3 s hang timeout, each making progress (micro-batches, files) or under the first step's budget."""
    code, out = _hang_job(
        tmp_path,
        data,
        "healthy",
        "train.first_step_timeout_s=20",
        "train.eval_interval=1",
        "train.checkpoint_interval=1",
        MHF_DIST_TEST_SLOW_WORK="first_step:6,eval_batch:1,checkpoint_file:1",
    )
    assert code == 0, out[-3000:]
    assert not (tmp_path / "run" / "hangs").exists(), out[-3000:]
    evals = [r for r in metrics(tmp_path / "run") if "val_loss" in r]
    assert [r["step"] for r in evals] == [1, 2]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step-*")) == [
        "step-00000001",
        "step-00000002",
    ]


@pytest.mark.multirank
def test_a_phase_the_watchdog_ended_gets_twice_as_long_once_then_stops_naming_the_setting(
    tmp_path, data
):
    """A save that stalls 8 s without writing: ended at the 3 s timeout (exit 87, requeued) with the setting to raise;
    the next start allows it 6 s and, ended there again, stops without requeueing (exit 2); with the setting raised
    as advised the run finishes."""
    stall = {"MHF_DIST_TEST_SAVE_PAUSE": "8"}
    code, out = _hang_job(tmp_path, data, "first", steps=1, **stall)
    assert code == HUNG_EXIT_CODE, out[-3000:]
    # (the seconds it saw: the budget, or more where a loaded machine ran the watchdog's check late)
    stuck = re.search(
        r"no progress for (\d+) s in the save of step 1 \(train\.hang_timeout_s=3\): a hang", out
    )
    assert stuck and int(stuck[1]) >= 3, out[-3000:]
    assert (
        "if in the save of step 1 is healthy work that takes longer than 3 s, the next start allows it 6 s once"
        in out.replace("\n", " ")
    ), out[-3000:]
    assert "--set train.hang_timeout_s=12" in out

    code, out = _hang_job(tmp_path, data, "second", steps=1, **stall)
    assert code == ERROR_EXIT_CODE, out[-3000:]
    assert (
        "this start allows it 6 s, and stops without requeueing if it ends there again"
        in out.replace("\n", " ")
    )
    assert "(6 s, twice what the previous start allowed it): a hang" in out
    assert "ended in the save of step 1 too, with half this budget: not requeued" in out.replace(
        "\n", " "
    )
    hangs = sorted((tmp_path / "run" / "hangs").iterdir())
    assert len(hangs) == 2 and all(
        (h / "summary.txt").exists() and (h / "rank-0.txt").exists() for h in hangs
    )

    code, out = _hang_job(tmp_path, data, "raised", "train.hang_timeout_s=12", steps=1, **stall)
    assert code == 0, out[-3000:]
    assert len(list((tmp_path / "run" / "hangs").iterdir())) == 2
