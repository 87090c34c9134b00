"""``mhf-dist status``: hand-built run directories, the text and JSON reports, errors, SLURM state, and no torch."""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

import mhf_dist.cluster.scheduler.slurm as slurm
import mhf_dist.cluster.status as status_module
from mhf_dist.cli import main
from mhf_dist.config import load_config

HOUR = 3600
CFG = load_config("tiny-h4b16k").model_dump(mode="json")
TOKENS_PER_STEP = CFG["train"]["global_batch_size"] * CFG["data"]["seq_len"]
MAX_STEPS = CFG["train"]["max_steps"]


def record(step: int, loss: float = 7.0, tokens_per_s: float = 2048.0, **extra) -> dict:
    return {
        "step": step,
        "loss": loss,
        "head_losses": [loss - 1, loss + 1],
        "lr": 1e-3,
        "tokens_per_s": tokens_per_s,
        "mfu": 0.02,
        "nonfinite_steps": 0,
        "skipped_steps": 1,
        **extra,
    }


def write_metrics(run: Path, records: list[dict], age_s: float = 0.0) -> None:
    path = run / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    os.utime(path, (time.time() - age_s,) * 2)


def write_checkpoint(run: Path, step: int, age_s: float, reason: str = "interval") -> None:
    path = run / "checkpoints" / f"step-{step:08d}"
    path.mkdir(parents=True)
    (path / "model.pt").write_bytes(b"x")
    marker = path / "complete.json"
    marker.write_text(
        json.dumps(
            {
                "step": step,
                "tokens": step * TOKENS_PER_STEP,
                "reason": reason,
                "files": {"model.pt": 1},
                "model": {},
                "layout": {"tp": 1, "pp": 1, "dp": 1},
                "signatures_hash": None,
            }
        )
    )
    os.utime(marker, (time.time() - age_s,) * 2)


def write_job(run: Path, job_id: str = "1234") -> None:
    (run / "jobs").mkdir(exist_ok=True)
    with (run / "jobs" / "jobs.jsonl").open("a") as f:
        f.write(
            json.dumps(
                {
                    "job_id": job_id,
                    "submitted": "2026-12-01 03:00:00",
                    "cluster": "a100-80g",
                    "nodes": 4,
                }
            )
            + "\n"
        )


@pytest.fixture
def bin_dir(tmp_path, monkeypatch):
    """The only directory on PATH: no SLURM commands unless a test puts fakes here."""
    path = tmp_path / "bin"
    path.mkdir()
    monkeypatch.setenv("PATH", str(path))
    return path


def fake_command(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


@pytest.fixture
def run(tmp_path, bin_dir):
    """A run at step 6 of the tiny preset: validation at step 4, a complete checkpoint at step 4 (two hours old)
    and an interrupted save at step 6."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(CFG))
    write_metrics(
        run,
        [
            record(1, 8.0),
            record(2, 7.5),
            record(4, 7.0, val_loss=7.2, val_ppl=1300.5),
            record(6, 6.5),
        ],
    )
    write_checkpoint(run, 4, age_s=2 * HOUR)
    (run / "checkpoints" / "step-00000006").mkdir()  # no marker: not complete
    return run


def status_json(capsys, run: Path, *args: str) -> dict:
    assert main(["status", str(run), "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def status_text(capsys, run: Path, *args: str) -> str:
    assert main(["status", str(run), *args]) == 0
    return capsys.readouterr().out


def test_text_report_of_a_running_run(run, capsys):
    out = status_text(capsys, run)
    assert f"run        {run.resolve()} (tiny-h4b16k)" in out
    assert (
        f"step       6 / {MAX_STEPS} ({6 / MAX_STEPS:.1%}), {6 * TOKENS_PER_STEP:,} tokens" in out
    )
    assert (
        "loss       6.5000 last, 7.2500 mean of the last 4 logged steps (heads 5.5000, 7.5000)"
        in out
    )
    assert "throughput 2,048 tokens/s, MFU 2.0% (mean of the last 4 logged steps)" in out
    assert "last log   0 s ago\n" in out and "STALE" not in out
    eta_s = (MAX_STEPS - 6) * TOKENS_PER_STEP / 2048
    assert f"ETA        {status_module.duration(eta_s)} ({MAX_STEPS - 6} steps at" in out
    assert "checkpoint step-00000004 (step 4, interval, 2 h 00 min ago)" in out
    assert "validation step 4: val_loss 7.2000, val_ppl 1300.50" in out
    assert "counters   nonfinite_steps 0, skipped_steps 1\n" in out
    assert "\njob " not in out and "lock" not in out


def test_json_report_has_every_field(run, capsys):
    got = status_json(capsys, run)
    assert got["run_dir"] == str(run.resolve()) and got["preset"] == "tiny-h4b16k"
    assert (got["step"], got["max_steps"], got["tokens"]) == (6, MAX_STEPS, 6 * TOKENS_PER_STEP)
    assert got["progress"] == pytest.approx(6 / MAX_STEPS) and got["finished"] is False
    assert (got["loss"], got["head_losses"], got["loss_recent_mean"]) == (6.5, [5.5, 7.5], 7.25)
    assert (got["tokens_per_s"], got["mfu"], got["recent_records"]) == (2048.0, 0.02, 4)
    assert got["seconds_per_step"] == pytest.approx(TOKENS_PER_STEP / 2048)
    assert got["eta_s"] == pytest.approx((MAX_STEPS - 6) * TOKENS_PER_STEP / 2048)
    assert got["last_step_age_s"] < 60 and got["stale"] is False and got["stale_after_s"] == 600
    ck = got["checkpoint"]
    assert (ck["name"], ck["step"], ck["tokens"], ck["reason"]) == (
        "step-00000004",
        4,
        4 * TOKENS_PER_STEP,
        "interval",
    )
    assert (
        ck["path"] == str(run / "checkpoints" / "step-00000004")
        and abs(ck["age_s"] - 2 * HOUR) < 60
    )
    assert got["validation"] == {"step": 4, "val_loss": 7.2, "val_ppl": 1300.5}
    assert (got["nonfinite_steps"], got["skipped_steps"], got["loss_spikes"]) == (0, 1, None)
    assert got["job"] is None and got["slurm"] is None and got["lock"] is None
    assert abs(got["checked_at"] - time.time()) < 60


def test_a_run_without_new_steps_is_flagged_stale(run, capsys):
    os.utime(run / "metrics.jsonl", (time.time() - 3 * HOUR,) * 2)
    out = status_text(capsys, run)
    assert "last log   3 h 00 min ago  STALE: nothing logged for over 10 min" in out
    assert status_json(capsys, run)["stale"] is True
    assert status_json(capsys, run, "--stale-minutes", "240")["stale"] is False
    got = status_json(capsys, run, "--stale-minutes", "90")
    assert got["stale"] is True and got["stale_after_s"] == 90 * 60


def test_the_default_stale_threshold_follows_the_logging_interval(run, capsys):
    """At 100 s/step with a record every 10 steps, 5 logging intervals are 5,000 s: 1 h is not stale yet, 2 h is."""
    records = [
        record(10, tokens_per_s=TOKENS_PER_STEP / 100),
        record(20, tokens_per_s=TOKENS_PER_STEP / 100),
    ]
    write_metrics(run, records, age_s=HOUR)
    got = status_json(capsys, run)
    assert got["stale_after_s"] == pytest.approx(5 * 10 * 100) and got["stale"] is False
    write_metrics(run, records, age_s=2 * HOUR)
    assert status_json(capsys, run)["stale"] is True


def test_a_finished_run_is_not_stale(run, capsys):
    write_metrics(run, [record(MAX_STEPS - 1), record(MAX_STEPS)], age_s=24 * HOUR)
    got = status_json(capsys, run)
    assert (got["finished"], got["stale"], got["eta_s"], got["progress"]) == (True, False, 0.0, 1.0)
    out = status_text(capsys, run)
    assert "ETA        finished" in out and "STALE" not in out and "24 h 00 min ago" in out


def test_every_validation_field_and_counter_is_shown(run, capsys):
    write_metrics(
        run,
        [
            record(2),
            record(4, loss_spikes=3, nonfinite_steps=2),
            {
                "step": 5,
                "val_loss": 6.9,
                "val_p_inf_nll": 7.0,
                "val_ppl": 1096.6,
                "val_ppl_calibrated": 990.25,
                "val_top1": 0.125,
                "val_head_losses": [5.5, 5.25],
            },
        ],
    )
    got = status_json(capsys, run)
    # a validation-only record: the loss is the newest logged one
    assert got["step"] == 5 and got["loss"] == 7.0
    assert got["validation"] == {
        "step": 5,
        "val_loss": 6.9,
        "val_p_inf_nll": 7.0,
        "val_ppl": 1096.6,
        "val_ppl_calibrated": 990.25,
        "val_top1": 0.125,
        "val_head_losses": [5.5, 5.25],
    }
    assert (got["nonfinite_steps"], got["skipped_steps"], got["loss_spikes"]) == (2, 1, 3)
    out = status_text(capsys, run)
    assert (
        "validation step 5: val_loss 6.9000, val_p_inf_nll 7.0000, val_ppl 1096.60, val_ppl_calibrated 990.25, "
        "val_top1 0.1250, val_head_losses [5.5000 5.2500]"
    ) in out
    assert "counters   nonfinite_steps 2, skipped_steps 1, loss_spikes 3" in out


def test_the_newest_downstream_scores_are_shown(run, capsys):
    scores = {"eval/mhf_choice_local/acc": 0.4, "eval/mhf_lambada_local/perplexity": 812.25}
    write_metrics(run, [record(2), record(4) | scores, record(6)])
    assert status_json(capsys, run)["downstream"] == {"step": 4, **scores}
    out = status_text(capsys, run)
    assert (
        "downstream step 4: mhf_choice_local acc 0.4000, mhf_lambada_local perplexity 812.25" in out
    )


def test_the_last_logged_gradient_norms_per_family_are_shown(run, capsys):
    norms = {"grad_norm/tables": 2.5, "grad_norm/gate": 0.125, "grad_norm/block0": 1.0}
    write_metrics(
        run,
        [
            record(2, **{"grad_norm/tables": 9.0}),
            record(4, grad_norm=2.6, **norms),
            {"step": 5, "val_loss": 6.9},
        ],
    )
    assert status_json(capsys, run)["grad_norms"] == {
        "tables": 2.5,
        "gate": 0.125,
    }  # families, not blocks
    assert "grad norms tables 2.5000, gate 0.1250\n" in status_text(capsys, run)


def test_the_rollbacks_are_listed(run, capsys):
    write_metrics(run, [record(2), record(4)])
    rollback = {
        "step": 9,
        "spikes": [7, 9],
        "checkpoint": "step-00000006",
        "checkpoint_step": 6,
        "skipped": [48, 72],
        "time": "2026-12-03T08:00:00+00:00",
    }
    (run / "rollbacks.json").write_text(json.dumps([rollback]))
    assert status_json(capsys, run)["rollbacks"] == [rollback]
    assert (
        "rollback   1: at step 9 (spikes at 7, 9) back to step-00000006, global samples 48-71 skipped"
        in status_text(capsys, run)
    )


def test_a_non_finite_loss_is_null_in_json_and_left_out_of_the_mean(run, capsys):
    write_metrics(run, [record(1, 8.0), record(2, 6.0), record(3, float("nan"), nonfinite_steps=1)])
    assert main(["status", str(run), "--json"]) == 0
    got = json.loads(
        capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"{c} is not JSON")
    )
    assert (got["loss"], got["loss_recent_mean"], got["nonfinite_steps"]) == (None, 7.0, 1)
    assert got["head_losses"] == [None, None]
    assert "loss       nan last, 7.0000 mean of the last 3 logged steps" in status_text(capsys, run)


@pytest.mark.parametrize(
    "make",
    [
        lambda tmp: tmp / "missing",
        lambda tmp: tmp,  # an empty directory
        lambda tmp: (tmp / "notes.txt").write_text("x") and (tmp / "data").mkdir() or tmp,
        lambda tmp: (tmp / "file").write_text("x") and tmp / "file",
    ],
    ids=["missing", "empty", "foreign", "file"],
)
def test_what_is_not_a_run_directory_is_an_error(tmp_path, bin_dir, capsys, make):
    base = tmp_path / "t"
    base.mkdir()
    target = make(base)
    assert main(["status", str(target), "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and str(target) in captured.err
    assert (
        "give the --run-dir that `mhf-dist train` or `mhf-dist submit` was started with"
        in captured.err
    )


def test_a_queued_run_shows_what_is_known(tmp_path, bin_dir, capsys):
    run = tmp_path / "queued"
    run.mkdir()
    write_job(run)  # submitted, the job has not started: only jobs/ exists
    out = status_text(capsys, run)
    assert "(no config.yaml yet)" in out and "step       no steps logged yet" in out
    assert "checkpoint none yet" in out and "job        1234 state unknown" in out
    (run / "config.yaml").write_text(yaml.safe_dump(CFG))
    out = status_text(capsys, run)
    assert "(tiny-h4b16k)" in out and f"no steps logged yet (of {MAX_STEPS})" in out
    got = status_json(capsys, run)
    assert (got["step"], got["tokens"], got["eta_s"], got["stale"], got["checkpoint"]) == (
        None,
        None,
        None,
        False,
        None,
    )
    assert got["slurm"] == {
        "job_id": "1234",
        "state": None,
        "restarts": None,
        "source": None,
        "submitted": "2026-12-01 03:00:00",
        "cluster": "a100-80g",
        "nodes": 4,
        "submissions": 1,
    }


def test_slurm_state_and_restarts_from_scontrol(run, bin_dir, capsys):
    write_job(run, "1200")
    write_job(run, "1234")  # a resubmission: the last line is the current job
    fake_command(
        bin_dir,
        "scontrol",
        '[ "$*" = "show job -o 1234" ] || exit 1\n'
        'echo "JobId=1234 JobName=mhf-run UserId=me(1000) JobState=RUNNING Reason=None Dependency=(null) '
        'Requeue=1 Restarts=2 BatchFlag=1 Command=/runs/x/jobs/job.sbatch"',
    )
    got = status_json(capsys, run)["slurm"]
    assert (got["job_id"], got["state"], got["restarts"], got["source"], got["submissions"]) == (
        "1234",
        "RUNNING",
        2,
        "scontrol",
        2,
    )
    assert (
        "job        1234 RUNNING, 2 restarts (submitted 2026-12-01 03:00:00, a100-80g, 4 nodes, "
        "2 submissions)"
    ) in status_text(capsys, run)


def test_sacct_answers_once_scontrol_forgot_the_job(run, bin_dir, capsys):
    write_job(run)
    fake_command(
        bin_dir, "scontrol", 'echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1'
    )
    fake_command(
        bin_dir,
        "sacct",
        '[ "$*" = "-j 1234 -X -n -P -o State" ] || exit 1\necho "CANCELLED by 1000"',
    )
    got = status_json(capsys, run)["slurm"]
    assert (got["state"], got["restarts"], got["source"]) == ("CANCELLED", None, "sacct")


def test_an_unresponsive_scontrol_does_not_hang_status(run, bin_dir, capsys, monkeypatch):
    monkeypatch.setattr(slurm, "QUERY_TIMEOUT_S", 0.5)
    write_job(run)
    fake_command(bin_dir, "scontrol", "exec sleep 30")
    assert status_json(capsys, run)["slurm"]["state"] is None


def test_the_lock_names_the_job_and_its_heartbeat(run, bin_dir, capsys):
    lock = run / "lock.json"
    lock.write_text(
        json.dumps(
            {"host": "node07", "pid": 4242, "slurm_job_id": "777", "started": "2026-12-01 03:01:00"}
        )
    )
    fake_command(bin_dir, "scontrol", 'echo "JobId=$4 JobState=RUNNING Restarts=0"')
    got = status_json(capsys, run)
    assert (
        got["slurm"]["job_id"] == "777"
        and got["slurm"]["state"] == "RUNNING"
        and got["slurm"]["submissions"] == 0
    )
    assert (
        got["lock"]["host"] == "node07"
        and got["lock"]["pid"] == 4242
        and got["lock"]["heartbeat_stopped"] is False
    )
    os.utime(lock, (time.time() - HOUR,) * 2)
    out = status_text(capsys, run)
    assert (
        "lock       node07 pid 4242, started 2026-12-01 03:01:00, heartbeat 60 min ago  (holder gone: its "
        "heartbeat missed over 3 refreshes (a live job refreshes it every 30 s); the next train takes the lock "
        "over)"
    ) in out


def test_a_dead_lock_holder_is_named_gone(run, capsys):
    # After a kill -9 the lock stays behind with a fresh heartbeat: its process not running on this host, or its
    # heartbeat missing for 3 refreshes on another host, must read as a holder that is gone, not as a live job.
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    pid, host = int(dead.stdout), socket.gethostname()
    lock = run / "lock.json"
    lock.write_text(
        json.dumps(
            {"host": host, "pid": pid, "slurm_job_id": None, "started": "2026-12-01 03:01:00"}
        )
    )
    got = status_json(capsys, run)["lock"]
    assert (
        got["holder_gone"] == f"process {pid} on {host} has exited"
        and got["next_train_takes_over"] is True
    )
    assert got["heartbeat_stopped"] is False
    assert (
        f"heartbeat 0 s ago  (holder gone: process {pid} on {host} has exited; the next train takes the lock "
        "over)"
    ) in status_text(capsys, run)

    lock.write_text(
        json.dumps(
            {"host": "node07", "pid": pid, "slurm_job_id": None, "started": "2026-12-01 03:01:00"}
        )
    )
    # another host, heartbeat fresh: may be alive
    assert status_json(capsys, run)["lock"]["holder_gone"] is None
    os.utime(lock, (time.time() - 120,) * 2)
    got = status_json(capsys, run)["lock"]
    assert (
        got["holder_gone"]
        == "its heartbeat missed over 3 refreshes (a live job refreshes it every 30 s)"
    )
    # a train takes it over 5 minutes after the last heartbeat
    assert got["next_train_takes_over"] is False
    assert "the lock over once its heartbeat is 5 min old)" in status_text(capsys, run)


def test_a_lock_holder_that_exited_unreaped_is_named_gone(run, capsys):
    # A killed job's ranks fall to the init process, which may reap them late: a zombie has exited all the same
    zombie = subprocess.Popen([sys.executable, "-c", ""])
    stat = Path(f"/proc/{zombie.pid}/stat")
    deadline = time.time() + 30
    while stat.read_text().rsplit(")", 1)[1].split()[0] != "Z":  # exited, not waited for
        assert time.time() < deadline
        time.sleep(0.01)
    host = socket.gethostname()
    (run / "lock.json").write_text(
        json.dumps(
            {
                "host": host,
                "pid": zombie.pid,
                "slurm_job_id": None,
                "started": "2026-12-01 03:01:00",
            }
        )
    )
    try:
        assert (
            status_json(capsys, run)["lock"]["holder_gone"]
            == f"process {zombie.pid} on {host} has exited"
        )
    finally:
        zombie.wait()


def test_a_damaged_checkpoint_is_marked_and_not_the_newest(run, capsys):
    # A checkpoint whose file is cut short must not be listed as the newest (a resume would not continue from it);
    # one whose content changed at the same size is found by --verify, which checks the SHA-256 digests.
    write_checkpoint(run, 5, age_s=60)
    ckpt = run / "checkpoints" / "step-00000005"
    (ckpt / "model.pt").write_bytes(b"xy")
    got = status_json(capsys, run)
    assert got["checkpoint"]["name"] == "step-00000004" and got["checkpoint_check"] == "sizes"
    assert got["damaged_checkpoints"] == [
        {
            "name": "step-00000005",
            "path": str(ckpt),
            "step": 5,
            "problem": f"checkpoint {ckpt}: model.pt has 2 bytes, 1 were written (truncated or "
            "corrupt); resume from an older checkpoint",
        }
    ]
    out = status_text(capsys, run)
    assert f"damaged    step-00000005 (step 5): checkpoint {ckpt}: model.pt has 2 bytes" in out
    assert "moves the damaged ones to checkpoints/corrupt/ and continues from step-00000004" in out

    (ckpt / "model.pt").write_bytes(b"y")  # the size it was saved with, another content
    marker = json.loads((ckpt / "complete.json").read_text())
    digests = {
        "digest_algorithm": "sha256",
        "digests": {"model.pt": hashlib.sha256(b"x").hexdigest()},
    }
    (ckpt / "complete.json").write_text(json.dumps(marker | digests))
    got = status_json(capsys, run)
    # sizes only
    assert got["checkpoint"]["name"] == "step-00000005" and got["damaged_checkpoints"] == []
    got = status_json(capsys, run, "--verify")
    # it has no digests
    assert got["checkpoint"]["name"] == "step-00000004" and got["checkpoint_check"] == "sizes"
    assert [d["name"] for d in got["damaged_checkpoints"]] == ["step-00000005"]
    assert "model.pt does not match its sha256 digest" in got["damaged_checkpoints"][0]["problem"]
    (ckpt / "model.pt").write_bytes(b"x")
    got = status_json(capsys, run, "--verify")
    assert got["checkpoint"]["name"] == "step-00000005" and got["checkpoint_check"] == "digests"
    os.utime(ckpt / "complete.json", (time.time() - HOUR,) * 2)
    out = status_text(capsys, run, "--verify")
    assert "checkpoint step-00000005 (step 5, interval, 60 min ago), digests verified" in out


def test_watch_refreshes_until_ctrl_c(run, capsys, monkeypatch):
    pauses = []

    def sleep(seconds):
        pauses.append(seconds)
        if len(pauses) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(status_module.time, "sleep", sleep)
    assert main(["status", str(run), "--watch"]) == 0
    assert pauses == [10.0, 10.0] and capsys.readouterr().out.count("step       6 /") == 2
    pauses.clear()
    assert main(["status", "--watch", "2.5", str(run), "--json"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert pauses == [2.5, 2.5] and [json.loads(line)["step"] for line in lines] == [6, 6]
    pauses.clear()
    # `--watch RUN_DIR` reads as `RUN_DIR --watch`
    assert main(["status", "--watch", str(run)]) == 0
    assert pauses == [10.0, 10.0]
    assert (
        main(["status", "--watch", "0", str(run)]) == 2 and "--watch 0" in capsys.readouterr().err
    )


def test_status_imports_no_torch(run, bin_dir):
    code = (
        "import sys, mhf_dist.cli; assert mhf_dist.cli.main(['status', sys.argv[1], '--json']) == 0; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'deepspeed', 'transformers', 'numpy', 'safetensors', 'webdataset')))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(run)],
        capture_output=True,
        text=True,
        env=os.environ | {"PATH": str(bin_dir)},
        cwd=Path(__file__).parent.parent,
    )
    assert proc.returncode == 0, proc.stderr
    report, heavy = proc.stdout.splitlines()
    assert json.loads(report)["step"] == 6 and heavy == "[]"


def test_a_mixture_shows_the_tokens_read_from_each_source(run, capsys):
    write_metrics(run, [record(1), record(2, source_tokens={"web": 1536, "code": 512})])
    assert "sources    web 1,536 tokens, code 512 tokens\n" in status_text(capsys, run)
    assert status_json(capsys, run)["source_tokens"] == {"web": 1536, "code": 512}


@pytest.mark.parametrize(
    "content, problem",
    [
        (
            yaml.safe_dump(
                CFG | {"train": CFG["train"] | {"max_steps": "many"}, "optimiser": {}}
            ).encode(),
            r"invalid run config \(RUN\):\n  train.max_steps: Input should be a valid integer.*\n"
            r"  optimiser: unknown field",
        ),
        (
            b"preset: tiny-h4b16k\ntrain: {max_steps: \xff}\n",
            r"cannot read config file RUN: it is not UTF-8 text \(byte 0xff at offset 39\)",
        ),
        (
            b"preset: tiny-h4b16k\ntrain: {max_steps: [1,\n",
            r"cannot read config file RUN: it is not valid YAML:\n(.*\n)*  in \"RUN\", line 3, column 1",
        ),
    ],
    ids=["schema", "bytes", "yaml"],
)
def test_an_invalid_config_yaml_is_named_with_its_problem(run, capsys, content, problem):
    """status and a resuming train both refuse it (exit 2), naming the file and what is wrong, without a traceback."""
    (run / "config.yaml").write_bytes(content)
    expected = problem.replace("RUN", re.escape(str(run / "config.yaml")))
    for argv in (
        ["status", str(run)],
        ["status", str(run), "--json"],
        ["train", "--run-dir", str(run)],
    ):
        assert main(argv) == 2, argv
        captured = capsys.readouterr()
        assert captured.out == "" and re.search(expected, captured.err), (argv, captured.err)
        assert "<unicode string>" not in captured.err and "Error:" not in captured.err


@pytest.mark.parametrize("args", [["--json"], []])
def test_status_into_a_closed_pipe_ends_quietly(run, bin_dir, args):
    """`status --json | head -1`: the reader closing the pipe early is a normal end (exit 0, nothing on stderr)."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before status writes anything
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "mhf_dist", "status", str(run), *args],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            env=os.environ | {"PATH": str(bin_dir)},
            cwd=Path(__file__).parent.parent,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert (proc.returncode, proc.stderr) == (0, "")
