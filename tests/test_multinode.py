"""Jobs of several nodes, on a cluster of network namespaces on this machine (:mod:`helpers.node_cluster`): each node
has its own address, host name and ``slurmd``, and ranks on different nodes talk over the namespaces' bridge."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from helpers.node_cluster import NodeCluster, unavailable
from helpers.runs import metrics, run_cli, train_args
from helpers.slurm import missing_binaries
from test_submit import wait_for


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = unavailable() or (f"SLURM is not installed here ({', '.join(missing_binaries())} missing)"
                               if missing_binaries() else None)
    if reason:
        if os.environ.get("CI"):
            raise RuntimeError(f"the namespace cluster cannot run in CI: {reason}")
        pytest.skip(reason)
    nodes = NodeCluster(tmp_path_factory.mktemp("nodes"), nodes=3)
    nodes.start()
    yield nodes
    nodes.stop()


def submit(cluster: NodeCluster, run, data, nodes: int, *overrides: str, steps: int) -> str:
    """``mhf-dist submit`` of a tiny run on ``nodes`` nodes of the cpu-local profile (2 ranks each); its job id."""
    args = train_args(run, data, 2, *overrides, steps=steps)
    args = ["submit", "--cluster", "cpu-local", "--nodes", str(nodes)] + [
        a for a in args[1:] if a not in ("--nproc-per-node", "2")]
    proc = subprocess.run([sys.executable, "-m", "mhf_dist", *args], env=cluster.env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return re.search(r"submitted job (\d+)", proc.stdout).group(1)


def job_log(run) -> str:
    return "".join(p.read_text() for p in sorted((run / "slurm").glob("*.out")))


@pytest.mark.slurm
@pytest.mark.multirank
def test_a_two_node_job_trains_as_one_node_does_and_resumes_bit_identically_after_a_requeue(tmp_path, data, cluster):
    """tp=2 × dp=2 with two ranks on each of two nodes: the same losses, bit for bit, as the four ranks on one host,
    also across a requeue mid-run (SIGTERM to every rank: they save, the job is queued again and resumes)."""
    steps, layout = 12, ("parallel.tp=2", "train.checkpoint_interval=100")
    reference = run_cli(train_args(tmp_path / "one-host", data, 4, *layout, steps=steps)) and metrics(
        tmp_path / "one-host")
    run = tmp_path / "run"
    job = submit(cluster, run, data, 2, *layout, steps=steps)
    log = run / "metrics.jsonl"
    wait_for(lambda: log.exists() and len(log.read_text().splitlines()) >= 3, 300, "training to start")
    shown = run_cli(["status", str(run)])
    assert re.search(r"^ranks +4 ranks on n1, n2$", shown, re.M), shown  # the job's nodes, from the ranks

    cluster.scontrol("requeue", job)
    wait_for(lambda: cluster.job_state(job)["JobState"] == "PENDING", 120, "the requeue")
    cluster.scontrol("update", f"JobId={job}", "StartTime=now")  # a requeued job otherwise waits ~2 minutes
    state = wait_for(lambda: (s := cluster.job_state(job))["JobState"] in ("COMPLETED", "FAILED") and s, 600,
                     "the job to finish")
    out = job_log(run)
    assert state["JobState"] == "COMPLETED", out[-4000:] + cluster.log_tail()
    assert int(state["Restarts"]) >= 1 and "resumed from" in out
    # the rendezvous is the first node's address on the bridge, not a loopback one
    assert re.search(rf"on n\[1-2\], rendezvous n1 \({re.escape(cluster.address('n1'))}\):\d+", out), out[:2000]
    assert [r["loss"] for r in metrics(run)] == [r["loss"] for r in reference]
    shown = run_cli(["status", str(run)])
    assert f"step       {steps} / {steps}" in shown and re.search(r"^ranks +4 ranks on n1, n2$", shown, re.M), shown
