"""Jobs of several nodes, on a cluster of network namespaces on this machine (``helpers.node_cluster``): each node
has its own address, host name and ``slurmd``, and ranks on different nodes talk over the namespaces' bridge."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from datetime import datetime

import pytest
import yaml

from helpers.node_cluster import NodeCluster, unavailable
from helpers.runs import MIXTURE_WEIGHTS, metrics, run_cli, train_args
from helpers.slurm import job_log, missing_binaries, submit_job, wait_for
from mhf_dist.data.mixture import MixtureSchedule


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = unavailable() or (
        f"SLURM is not installed here ({', '.join(missing_binaries())} missing)"
        if missing_binaries()
        else None
    )
    if reason:
        if os.environ.get("CI"):
            raise RuntimeError(f"the namespace cluster cannot run in CI: {reason}")
        pytest.skip(reason)
    nodes = NodeCluster(tmp_path_factory.mktemp("nodes"), nodes=3)
    nodes.start()
    yield nodes
    nodes.stop()


@pytest.fixture(autouse=True)
def every_node_up(request):
    """Each test starts with the three nodes in service (an earlier one may have killed one)."""
    if "cluster" in request.fixturenames:
        request.getfixturevalue("cluster").revive()


@pytest.mark.slurm
@pytest.mark.multirank
def test_a_two_node_job_trains_as_one_node_does_and_resumes_bit_identically_after_a_requeue(
    tmp_path, data, cluster
):
    """tp=2 × dp=2 with two ranks on each of two nodes: the same losses, bit for bit, as the four ranks on one host,
    also across a requeue mid-run (SIGTERM to every rank: they save, the job is queued again and resumes)."""
    steps, layout = 12, ("parallel.tp=2", "train.checkpoint_interval=100")
    reference = run_cli(
        train_args(tmp_path / "one-host", data, 4, *layout, steps=steps)
    ) and metrics(tmp_path / "one-host")
    run = tmp_path / "run"
    job = submit_job(cluster, train_args(run, data, 2, *layout, steps=steps), "2")
    log = run / "metrics.jsonl"
    wait_for(
        lambda: log.exists() and len(log.read_text().splitlines()) >= 3,
        300,
        "training to start",
        lambda: cluster.story(job, run),
    )
    shown = run_cli(["status", str(run)])
    # the job's nodes, from the ranks
    assert re.search(r"^ranks +4 ranks on n1, n2$", shown, re.M), shown

    cluster.scontrol("requeue", job)
    wait_for(lambda: cluster.job_state(job)["JobState"] == "PENDING", 120, "the requeue")
    # a requeued job otherwise waits ~2 minutes
    cluster.scontrol("update", f"JobId={job}", "StartTime=now")
    state = wait_for(
        lambda: (s := cluster.job_state(job))["JobState"] in ("COMPLETED", "FAILED") and s,
        600,
        "the job to finish",
    )
    out = job_log(run)
    assert state["JobState"] == "COMPLETED", out[-4000:] + cluster.log_tail()
    assert int(state["Restarts"]) >= 1 and "resumed from" in out
    # the rendezvous is the first node's address on the bridge, not a loopback one
    assert re.search(
        rf"on n\[1-2\], rendezvous n1 \({re.escape(cluster.address('n1'))}\):\d+", out
    ), out[:2000]
    assert [r["loss"] for r in metrics(run)] == [r["loss"] for r in reference]
    shown = run_cli(["status", str(run)])
    assert f"step       {steps} / {steps}" in shown and re.search(
        r"^ranks +4 ranks on n1, n2$", shown, re.M
    ), shown


@pytest.mark.slurm
@pytest.mark.multirank
def test_a_job_that_loses_a_node_finishes_on_the_nodes_left_without_a_person(
    tmp_path, data, sources, cluster
):
    """A 3-node elastic job (``--nodes 2-3``, tp=2 × dp=3, ZeRO-1) loses its third node (its slurmd and ranks
    killed) after its step-2 checkpoint: the job probes its nodes, continues on two at dp=2 from that checkpoint, and
    finishes. Its losses after the loss are those of a resume by hand from the same checkpoint at dp=2, and every
    source's tokens are those of the uninterrupted order."""
    steps, batch = 6, 12
    listed = json.dumps([s.model_dump(exclude_none=True) for s in sources])
    overrides = (
        "parallel.tp=2",
        "parallel.zero_stage=1",
        f"train.global_batch_size={batch}",
        "train.checkpoint_interval=2",
        "train.peer_timeout_s=10",
        "data.path=null",
        f"data.sources={listed}",
    )
    run = tmp_path / "run"
    job = submit_job(cluster, train_args(run, data, 2, *overrides, steps=steps), "2-3")
    log = run / "metrics.jsonl"
    wait_for(
        lambda: log.exists() and len(log.read_text().splitlines()) >= 3,
        300,
        "step 3",
        lambda: cluster.story(job, run),
    )
    assert (run / "checkpoints/step-00000002/complete.json").exists()
    lost_at = time.time()
    cluster.kill_node("n3")
    state = wait_for(
        lambda: (s := cluster.job_state(job))["JobState"] in ("COMPLETED", "FAILED") and s,
        900,
        "the job to finish",
    )
    out = job_log(run)
    assert state["JobState"] == "COMPLETED", out[-5000:] + cluster.log_tail()
    assert "round 0 on n1,n2,n3 (6 ranks)" in out and "round 1 on n1,n2 (4 ranks)" in out, out[
        -5000:
    ]
    assert "elastic: lost: node n3" in out
    assert "elastic: kept: checkpoint step-00000002 (step 2)" in out
    assert (
        "elastic: chose: dp 2 (was dp 3 on 3 nodes) on 2 nodes (n1, n2), 4 ranks: tp 2 x pp 1 kept"
        in out
    )
    assert (
        f"resumed from {run / 'checkpoints' / 'step-00000002'} at step 2 (converted to this layout)"
        in out
    )

    records = metrics(run)
    after = [r for r in records if "loss" in r and r["step"] > 2][-(steps - 2) :]
    assert [r["step"] for r in after] == [3, 4, 5, 6]
    # the first step trained after the loss
    back = min(datetime.fromisoformat(r["time"]).timestamp() for r in after)
    # docs/benchmarks.md
    print(f"from the lost node to the next trained step: {back - lost_at:.0f} s")

    by_hand = tmp_path / "by-hand"  # the same checkpoint resumed by hand at dp=2 on one host
    shutil.copytree(
        run, by_hand, ignore=shutil.ignore_patterns("jobs", "slurm", "heartbeats", "metrics.jsonl")
    )
    hand = train_args(by_hand, data, 4, *overrides, steps=steps) + [
        "--resume",
        str(by_hand / "checkpoints" / "step-00000002"),
    ]
    run_cli(hand)
    for got, want in zip(after, [r for r in metrics(by_hand) if "loss" in r]):
        assert abs(got["loss"] - want["loss"]) <= 1e-5 * want["loss"], (
            got["step"],
            got["loss"],
            want["loss"],
        )
    seed = yaml.safe_load((run / "config.yaml").read_text())["train"]["seed"]
    read = MixtureSchedule([s.weight for s in sources], seed=seed).consumed(steps * batch)
    assert after[-1]["source_tokens"] == {
        name: int(n) * 64 for name, n in zip(MIXTURE_WEIGHTS, read)
    }


@pytest.mark.slurm
@pytest.mark.multirank
def test_a_job_whose_ranks_on_a_node_stop_answering_queues_itself_again_without_that_node(
    tmp_path, data, cluster
):
    """A fixed 2-node job: the ranks on its second node stop (SIGSTOP) while that node's slurmd answers. The others
    exit 88 after train.peer_timeout_s naming the node; the job queues itself again without it, and the new job
    resumes from the newest checkpoint on the other two nodes and finishes."""
    steps = 6
    run = tmp_path / "run"
    job = submit_job(
        cluster,
        train_args(
            run,
            data,
            2,
            "parallel.zero_stage=1",
            "train.checkpoint_interval=2",
            "train.peer_timeout_s=10",
            steps=steps,
        ),
        "2",
    )
    log = run / "metrics.jsonl"
    wait_for(
        lambda: log.exists() and len(log.read_text().splitlines()) >= 3,
        300,
        "step 3",
        lambda: cluster.story(job, run),
    )
    assert cluster.job_state(job)["NodeList"] == "n[1-2]"
    cluster.stop_ranks("n2")
    jobs = run / "jobs" / "jobs.jsonl"
    again = wait_for(
        lambda: len(lines := jobs.read_text().splitlines()) > 1 and json.loads(lines[-1]),
        300,
        "the job to queue itself again",
        lambda: cluster.story(job, run),
    )
    assert again["requeue_of"] == job and again["excluded"] == ["n2"]
    new = again["job_id"]
    state = wait_for(
        lambda: (s := cluster.job_state(new))["JobState"] in ("COMPLETED", "FAILED") and s,
        600,
        "the new job to finish",
        lambda: cluster.story(new, run),
    )
    out = job_log(run)
    assert state["JobState"] == "COMPLETED" and state["NodeList"] == "n[1,3]", out[-5000:]
    assert cluster.job_state(job)["ExitCode"].startswith("88:"), out[-5000:]
    # the ranks whose heartbeat was the timeout old when the first rank looked: one of n2's or both
    assert re.search(r"lost node n2: ranks? [23](, 3)? sent no heartbeat", out), out[-5000:]
    assert f"requeue: queued again as job {new} without n2, to start when job {job} ends" in out
    assert "resumed from" in out and [r["step"] for r in metrics(run) if "loss" in r][-1] == steps
