"""Job submission: rendered scripts (golden files), named errors, and a real SLURM requeue end to end."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mhf_dist.cli import main
from mhf_dist.cluster import load_profile
from mhf_dist.config import ConfigError, load_config
from mhf_dist.submit import render
from slurm_cluster import LocalSlurm, missing_binaries
from train_utils import metrics, run_cli, train_args

GOLDEN = Path(__file__).parent / "golden"
DATA = "data.path=/shared/data"
CASES = {  # golden file: (profile, nodes, preset, overrides, extra)
    "a100-80g-2nodes.sbatch": ("a100-80g", 2, "1b-h4b16k", [DATA, "parallel.tp=2"], {"depends_on": "1234"}),
    "mi300x-4nodes.sbatch": ("mi300x", 4, "3b-h4b16k", [DATA, "parallel.tp=2", "parallel.pp=2"], {}),
    "cpu-local-1node.sbatch": ("cpu-local", 1, "tiny-h4b16k", ["train.micro_batch_size=4"], {}),
    "a100-80g-2nodes.hostfile.sh": ("a100-80g", 2, "1b-h4b16k", [DATA], {"hostfile": "/shared/hostfile"}),
}


def rendered(name: str) -> str:
    profile, nodes, preset, overrides, extra = CASES[name]
    kind = "hostfile" if "hostfile" in extra else "sbatch"
    return render(kind, load_config(preset, overrides=overrides), load_profile(profile), nodes,
                  Path("/shared/runs/demo"), preset, None, overrides, python="/opt/venv/bin/python",
                  workdir=Path("/shared/mhf-dist"), **extra)


@pytest.mark.parametrize("name", list(CASES))
def test_rendered_scripts_match_reviewed_golden_files(name):
    if os.environ.get("MHF_DIST_UPDATE_GOLDEN"):
        (GOLDEN / name).write_text(rendered(name))
    assert rendered(name) == (GOLDEN / name).read_text()


def test_script_contents():
    script = rendered("mi300x-4nodes.sbatch")
    assert "#SBATCH --nodes=4" in script and "#SBATCH --ntasks-per-node=8" in script
    assert "#SBATCH --signal=USR1@120" in script and "#SBATCH --requeue" in script
    assert 'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in script
    assert "export HSA_FORCE_FINE_GRAIN_PCIE=1" in script and "module load rocm" in script
    assert 'if [ "$rc" -eq 85 ]' in script
    assert "#SBATCH --dependency=afterany:1234" in rendered("a100-80g-2nodes.sbatch")


def test_nodes_that_do_not_fit_the_layout_fail_before_submitting(capsys):
    with pytest.raises(ConfigError, match=r"world size 24 does not fit parallel.tp=16"):
        render("sbatch", load_config("3b-h4b16k", overrides=[DATA, "parallel.tp=16"]), load_profile("a100-80g"), 3,
               Path("/x"), "3b-h4b16k", None, [])
    assert main(["submit", "--preset", "tiny-h4b16k", "--cluster", "nope", "--run-dir", "/tmp/x", "--dry-run"]) == 2
    assert "cluster profile 'nope' not found" in capsys.readouterr().err


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    missing = missing_binaries()
    if missing and not os.environ.get("CI"):
        pytest.skip(f"SLURM is not installed here ({', '.join(missing)} missing); .ci/run installs it")
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
    except Exception as e:  # noqa: BLE001 - report why, then skip (CI must be able to start it)
        if os.environ.get("CI"):
            raise
        pytest.skip(f"SLURM could not start here: {e}")
    yield cluster
    cluster.stop()


def wait_for(predicate, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if value := predicate():
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def test_slurm_job_requeued_mid_run_resumes_and_matches(tmp_path, data, slurm):
    steps = 30
    overrides = ["parallel.zero_stage=1"]
    reference = run_cli(train_args(tmp_path / "ref", data, 2, *overrides, steps=steps)) and metrics(tmp_path / "ref")
    run = tmp_path / "run"
    submit = train_args(run, data, 2, *overrides, steps=steps)
    submit = ["submit", "--cluster", "cpu-local", "--nodes", "1"] + [a for a in submit[1:] if a not in (
        "--nproc-per-node", "2")]
    proc = subprocess.run([sys.executable, "-m", "mhf_dist", *submit], env=slurm.env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = re.search(r"submitted job (\d+)", proc.stdout).group(1)
    log = run / "metrics.jsonl"
    wait_for(lambda: log.exists() and len(log.read_text().splitlines()) >= 3, 300, "training to start")
    slurm.scontrol("requeue", job)  # SIGTERM to every rank: they save, then SLURM queues the job again
    wait_for(lambda: slurm.job_state(job)["JobState"] == "PENDING", 120, "the requeue")
    slurm.scontrol("update", f"JobId={job}", "StartTime=now")  # a requeued job otherwise waits ~2 minutes
    state = wait_for(lambda: (s := slurm.job_state(job))["JobState"] in ("COMPLETED", "FAILED") and s, 600,
                     "the job to finish")
    out = "".join(p.read_text() for p in (run / "slurm").glob("*.out"))
    assert state["JobState"] == "COMPLETED", out[-4000:] + slurm.log_tail()
    assert int(state["Restarts"]) >= 1
    assert "resumed from" in out
    markers = sorted((run / "checkpoints").glob("step-*/complete.json"))
    assert markers, "no checkpoint was written"
    assert [r["loss"] for r in metrics(run)] == [r["loss"] for r in reference]
    shown = run_cli(["status", str(run)])
    assert f"step       {steps} / {steps}" in shown and f"checkpoint step-{steps:08d}" in shown
