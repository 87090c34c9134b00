"""A training step out of memory: the reports of the ranks that ran out, rank 0's message naming the settings that
lower memory in order, the exit code no job script requeues, and nothing saved touched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers.runs import run_cli, train_args
from mhf_dist.cluster.profile import load_profile
from mhf_dist.cluster.scheduler.slurm import SLURM
from mhf_dist.cluster.submit import render
from mhf_dist.config import load_config
from mhf_dist.errors import OOM_EXIT_CODE
from mhf_dist.parallel.layout import Layout
from mhf_dist.storage.run_dir import RunDir
from mhf_dist.train import oom
from mhf_dist.train.checkpoint.index import complete_checkpoints, damage
from mhf_dist.train.fault_injection import OOM_ENV

SETTINGS = (  # in the order they help
    "train.micro_batch_size=1",
    "parallel.activation_checkpoint_interval=1",
    "parallel.zero_stage=3",
    "parallel.tp=2",
    "model.decoder_chunk_tokens=64",
)


@pytest.mark.multirank
def test_a_step_out_of_memory_on_one_rank_is_reported_and_named_by_rank_0(
    tmp_path, data, monkeypatch
):
    # rank 1 runs out of memory in step 3, after step 2 was saved
    monkeypatch.setenv(OOM_ENV, "1:3")
    run = tmp_path / "run"
    args = train_args(run, data, 2, "parallel.zero_stage=1", "train.checkpoint_interval=2", steps=4)
    out = run_cli(args, expect_rc=OOM_EXIT_CODE)

    (report,) = run.glob("oom/*/rank-1.txt")
    assert not list(run.glob("oom/*/rank-0.txt"))  # rank 0 did not run out
    text = report.read_text()
    for line in (
        "rank 1 of 2 ran out of memory at step 3",
        "step: 3, 2 micro-batch(es) per step on this rank",
        "micro-batch shape: [2, 64] (2 sequences × 64 tokens: train.micro_batch_size × data.seq_len)",
        "layout: tp=1 pp=1 dp=2, ZeRO-1, fp32",
        "allocator summary: none: a CPU rank allocates through the host's allocator",
        "error: OutOfMemoryError: injected (MHF_DIST_TEST_OOM=1:3)",
    ):
        assert line in text, text
    peak = next(x for x in text.splitlines() if x.startswith("peak reached: "))
    estimate = next(x for x in text.splitlines() if x.startswith("estimate: "))
    assert "the process's peak resident memory" in peak and float(peak.split()[2]) > 0.1
    assert "what `mhf-dist plan` estimates for pipeline stage 0 of this layout" in estimate
    assert float(estimate.split()[1]) > 0.1  # a CPU rank's runtime is most of it

    # rank 0 says it once: the rank, the step, peak against estimate, the report and the settings in order
    assert out.count("out of memory: rank 1 at step 3 (micro-batch 2 × 64 tokens): peak ") == 1, out
    assert "GB that plan estimates for this layout" in out and f"report: {report}" in out
    assert (
        f"the job stops (exit {OOM_EXIT_CODE}, not requeued: the same job would run out again); nothing saved is "
        "touched: step-00000002 stays the newest checkpoint" in out
    )
    message = out[out.index("out of memory: rank 1") :]
    places = [message.index(f"--set {setting} (now ") for setting in SETTINGS]
    assert places == sorted(places), message
    assert "mhf-dist [rank 1]: out of memory at step 3; report: " in out and "Traceback" not in out

    # nothing saved is touched: step 2 is complete, intact and latest; step 3 was never begun
    checkpoints = run / "checkpoints"
    assert [p.name for p in complete_checkpoints(checkpoints)] == ["step-00000002"]
    assert damage(checkpoints / "step-00000002") is None
    assert (checkpoints / "latest").read_text() == "step-00000002"
    assert not list(checkpoints.glob("step-00000003*")) and not list(
        checkpoints.glob("step-00000004*")
    )
    assert json.loads((run / "oom/last.json").read_text())["step"] == 3

    # status names it: the step, the rank, the reports' folder, the exit code
    from mhf_dist.cluster.run_status import gather
    from mhf_dist.cluster.status import render

    st = gather(run)
    assert (st.out_of_memory.step, st.out_of_memory.ranks) == (3, [1])
    assert st.out_of_memory.folder == str(report.parent)
    line = next(x for x in render(st).splitlines() if x.startswith("oom "))
    assert "out of memory at step 3, " in line and "1 rank (1), reports in " in line, line
    assert f"(exit {OOM_EXIT_CODE}, not requeued)" in line, line


def test_a_failed_allocation_of_the_cpu_allocator_is_out_of_memory():
    import torch

    with pytest.raises(RuntimeError) as failed:
        torch.empty(2**50, dtype=torch.uint8)  # a petabyte
    assert oom.is_out_of_memory(failed.value) and oom.is_out_of_memory(MemoryError())
    assert not oom.is_out_of_memory(RuntimeError("a collective failed"))


def test_settings_already_at_their_least_are_named_last():
    cfg = load_config(
        "tiny-h4b16k",
        overrides=[
            "train.global_batch_size=2",
            "train.micro_batch_size=1",
            "model.decoder_chunk_tokens=1",
        ],
    )
    lines = oom.lower_memory(cfg, Layout(tp=1, pp=2, dp=2, accum=1), zero=1, interval=1)
    assert [line.split(" (")[0] for line in lines] == [
        "--set parallel.tp=2",
        "already at their least: train.micro_batch_size=1, parallel.activation_checkpoint_interval=1, "
        "parallel.zero_stage=1",
    ]
    assert lines[-1].endswith("parallel.zero_stage=1 (the pipeline engine takes ZeRO-1)")


def test_rank_0_says_another_ranks_report_while_it_waits(tmp_path, capfd):
    """A GPU collective waits for the rank that left instead of failing: rank 0's watch finds the report."""
    run = RunDir(tmp_path / "run")
    watch = oom.OomWatch()
    oom._SAID.clear()
    watch.on_start(SimpleNamespace(run=run, job=SimpleNamespace(rank=0, world=2)))
    folder = run.oom_dir / "2026-12-05T00-00-00Z"
    folder.mkdir(parents=True)
    brief = {"rank": 1, "step": 7, "summary": "rank 1 at step 7 (...)", "advice": ["--set a=1"]}
    (folder / "rank-1.json").write_text(json.dumps(brief | {"report": str(folder / "rank-1.txt")}))
    deadline = time.monotonic() + 10
    while "out of memory" not in (err := capfd.readouterr().err) and time.monotonic() < deadline:
        time.sleep(0.1)
    watch.close(False)
    assert err.startswith("out of memory: rank 1 at step 7 (...)\n") and "\n  --set a=1\n" in err, (
        err
    )
    assert "no checkpoint was saved yet" in err


def _job(
    tmp_path: Path, script: str, nodes: str, srun: str
) -> tuple[subprocess.CompletedProcess, str]:
    """``script`` run with a fake ``srun`` (its shell body ``srun``) and ``scontrol``, each logging its calls."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    bodies = {
        "scontrol": 'case "$1 $2" in "show hostnames") echo "$3" | tr , "\\n" ;; esac',
        "srun": f'case "$*" in *" true") exit 0 ;; esac\n{srun}',
    }
    for name, body in bodies.items():
        (bin_dir / name).write_text(f'#!/bin/bash\necho "{name} $*" >> {calls}\n{body}\n')
        (bin_dir / name).chmod(0o755)
    (tmp_path / "job.sh").write_text(script)
    env = os.environ | {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": nodes,
    }
    proc = subprocess.run(
        ["bash", str(tmp_path / "job.sh")],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc, calls.read_text() if calls.exists() else ""


@pytest.mark.parametrize("min_nodes", [None, 1], ids=["fixed", "elastic"])
def test_the_job_script_ends_with_the_out_of_memory_code_and_does_not_requeue(tmp_path, min_nodes):
    overrides = ["train.micro_batch_size=2"]
    run = tmp_path / "run"
    script = render(
        SLURM,
        load_config("tiny-h4b16k", overrides=overrides),
        load_profile("cpu-local"),
        nodes=2,
        run_dir=run,
        preset="tiny-h4b16k",
        overrides=overrides,
        python=sys.executable,
        min_nodes=min_nodes,
    )
    record = RunDir(run).oom_record
    record.parent.mkdir(parents=True)
    record.write_text("{}")  # a record of an earlier job: the script clears it before its step
    assert f"rm -f {RunDir(run).lost_record} {record}" in script
    # a rank ran out of memory and recorded it; --kill-on-bad-exit's SIGTERM ended another first (srun: 143)
    proc, calls = _job(tmp_path, script, "n1,n2", f"echo '{{\"step\": 3}}' > {record}; exit 143")
    assert proc.returncode == OOM_EXIT_CODE, proc.stdout + proc.stderr
    assert "requeue" not in calls and calls.count(" train ") == 1, calls

    # the ranks' own code, 89, is not requeued either; without the record the script ends with srun's code
    (tmp_path / "bin").rename(tmp_path / "bin-1")
    proc, calls = _job(tmp_path, script, "n1,n2", f"rm -f {record}; exit {OOM_EXIT_CODE}")
    assert proc.returncode == OOM_EXIT_CODE and "requeue" not in calls, proc.stdout + proc.stderr
