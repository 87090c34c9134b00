"""Faults a user runs into: bad values, refused resumes, hostile data paths, signals during start-up.

Each case ends in a clear error (exit 2, the problem and the fix named, no traceback) or in correct behaviour,
and nothing already saved is lost.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from helpers.filesystems import PAGE, small_filesystem
from helpers.runs import CliProcess, metrics, run_cli, train_args, train_run
from mhf_dist.cli import main
from mhf_dist.config import ConfigError, load_config
from mhf_dist.errors import MhfError
from mhf_dist.storage.run_dir import RunDir
from mhf_dist.train.metrics import MetricsLogger, read_metrics


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.seed=-1", "train.seed: Input should be greater than or equal to 0"),
        ("optimizer.betas=[2,-1]", "optimizer.betas[0]=2.0 is outside [0, 1)"),
        ("optimizer.betas=[0.9,-0.1]", "optimizer.betas[1]=-0.1 is outside [0, 1)"),
        ("optimizer.eps=-1e-8", "optimizer.eps: Input should be greater than 0"),
        (
            "optimizer.weight_decay=-0.1",
            "optimizer.weight_decay: Input should be greater than or equal to 0",
        ),
    ],
)
def test_out_of_range_values_name_the_field(override, message):
    with pytest.raises(
        ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")
    ):
        load_config("tiny-h4b16k", overrides=[override])


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["train", "--preset", "tiny-h4b16k", "--run-dir", "R", "--nproc-per-node", "0"],
            "must be at least 1, got 0",
        ),
        (
            ["train", "--preset", "tiny-h4b16k", "--run-dir", "R", "--nproc-per-node", "-2"],
            "must be at least 1, got -2",
        ),
        (
            [
                "submit",
                "--preset",
                "tiny-h4b16k",
                "--cluster",
                "cpu-local",
                "--run-dir",
                "R",
                "--grace",
                "-5",
            ],
            "--grace: must be at least 1, got -5",
        ),
    ],
)
def test_out_of_range_options_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_missing_data_path_is_named_before_start_up(tmp_path):
    out = run_cli(
        [
            "train",
            "--preset",
            "tiny-h4b16k",
            "--nproc-per-node",
            "2",
            "--run-dir",
            str(tmp_path / "run"),
            "--set",
            "data.path=data/nowhere",
        ],
        expect_rc=2,
        timeout=120,
    )
    assert "data.path=data/nowhere: no such directory" in out and "Traceback" not in out
    assert not (tmp_path / "run").exists()


@pytest.mark.multirank
def test_a_refused_start_leaves_a_new_run_directory_as_it_found_it(tmp_path):
    # a sequence longer than the embedded corpus's validation split is refused after the tokenizer and the signature
    # table were made; the second start, with other hash buckets, would meet the first one's table if it stayed
    message = "fewer than one sample of seq_len + 1 = 300001"
    empty = tmp_path / "empty"
    empty.mkdir()
    for run, buckets in ((tmp_path / "new", 256), (tmp_path / "new", 512), (empty, 256)):
        out = run_cli(
            [
                "train",
                "--preset",
                "tiny-h4b16k",
                "--run-dir",
                str(run),
                "--set",
                "data.seq_len=300000",
                "--set",
                "tokenizer.vocab_size=512",
                "--set",
                f"model.hash.num_buckets={buckets}",
            ],
            expect_rc=2,
        )
        assert message in out and "Traceback" not in out, out[-3000:]
    assert sorted(tmp_path.iterdir()) == [empty] and not list(empty.iterdir())


@pytest.mark.multirank
def test_refused_resume_leaves_the_run_as_it_was(tmp_path, data):
    run = tmp_path / "run"
    train_run(tmp_path, data, "run", 1, "parallel.zero_stage=1", steps=2)
    saved = (run / "config.yaml").read_text()
    out = run_cli(
        train_args(run, data, 1, "parallel.zero_stage=1", "model.ffn_dim=128", steps=4), expect_rc=2
    )
    assert "is of another model (model.ffn_dim: checkpoint 192, config 128)" in out
    assert (run / "config.yaml").read_text() == saved  # the refused config was not recorded

    # export takes the model's shapes from the checkpoint, whatever config.yaml says
    edited = yaml.safe_load(saved)
    edited["model"]["ffn_dim"] = 128
    (run / "config.yaml").write_text(yaml.safe_dump(edited))
    run_cli(["export", str(run), "--out", str(tmp_path / "export")])
    assert yaml.safe_load((tmp_path / "export/config.yaml").read_text())["model"]["ffn_dim"] == 192


@pytest.mark.multirank
def test_optimizer_changes_on_resume_are_applied_and_logged(tmp_path, data):
    from mhf_dist.train.optim import lr_factor

    run = tmp_path / "run"
    train_run(tmp_path, data, "run", 1, "parallel.zero_stage=1", "train.stop_at_step=2", steps=4)
    out = run_cli(train_args(run, data, 1, "parallel.zero_stage=1", "optimizer.lr=0.01", steps=4))
    assert "changed on resume, from step 3: optimizer.lr: 0.002 -> 0.01" in out
    cfg = load_config("tiny-h4b16k", overrides=["optimizer.lr=0.01"]).optimizer
    logged = {r["step"]: r["lr"] for r in metrics(run)}
    assert logged[3] == pytest.approx(0.01 * lr_factor(2, cfg, 4)) and logged[4] == pytest.approx(
        0.01 * lr_factor(3, cfg, 4)
    )
    assert yaml.safe_load((run / "config.yaml").read_text())["optimizer"]["lr"] == 0.01


@pytest.mark.multirank
@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGINT], ids=["SIGUSR1", "ctrl-c"])
def test_signal_during_start_up_exits_for_requeue_without_a_checkpoint(tmp_path, sig):
    # no data.path: rank 0 trains a tokenizer and prepares the embedded corpus while rank 1 waits, so the signal
    # lands in the middle of start-up
    run = tmp_path / "run"
    args = [
        "train",
        "--preset",
        "tiny-h4b16k",
        "--nproc-per-node",
        "2",
        "--run-dir",
        str(run),
        "--set",
        "model.hash.num_buckets=256",
        "--set",
        "tokenizer.vocab_size=512",
        "--set",
        "train.max_steps=3",
        "--set",
        "train.global_batch_size=4",
        "--set",
        "train.micro_batch_size=2",
    ]
    proc = CliProcess(args, tmp_path / "out.log")
    deadline = time.time() + 300
    while not (run / "tokenizer").exists() and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(sig)  # the launcher forwards it to both ranks
    rc, out = proc.wait(timeout=300), (tmp_path / "out.log").read_text()
    assert rc == 85, out[-3000:]
    assert "stopped by a signal during start-up; nothing to save" in out
    if sig == signal.SIGINT:  # no step to finish, nothing to save: said so
        assert (
            "interrupted during start-up: stopping once the model is built, before the first step"
            in out
        )
        assert "finishing this step" not in out
    assert not list(run.glob("checkpoints/step-*"))


@pytest.mark.multirank
def test_a_diverged_run_stops_and_saves_no_nonfinite_checkpoint(tmp_path, data):
    run = tmp_path / "run"
    args = train_args(
        run,
        data,
        1,
        "parallel.zero_stage=1",
        "optimizer.lr=1e12",
        "train.checkpoint_interval=1",
        steps=8,
    )
    out = run_cli(args, expect_rc=2)
    assert "was not finite for 3 steps in a row (steps 2-4)" in out and "Traceback" not in out
    records = metrics(run)
    assert [r["step"] for r in records] == [1, 2, 3, 4] and records[-1]["nonfinite_steps"] == 3
    assert all("skipped_steps" in r for r in records)
    saved = sorted(p.parent.name for p in run.glob("checkpoints/step-*/complete.json"))
    assert saved == ["step-00000001"]  # the only step whose loss and weights were finite

    # warn: the run goes on to the end, and still saves nothing that is not finite
    out = run_cli(
        train_args(
            tmp_path / "warn",
            data,
            1,
            "parallel.zero_stage=1",
            "optimizer.lr=1e12",
            "train.on_nonfinite=warn",
            steps=4,
        )
    )
    assert "warning: step 2: loss" in out and "warning: not saving step 4 (end)" in out
    assert not list((tmp_path / "warn").glob("checkpoints/step-*"))


@pytest.mark.multirank
def test_a_run_stopping_on_an_error_still_finishes_its_async_save(tmp_path, data, monkeypatch):
    # step 1 is saved in the background (stalled 10 s before complete.json) while steps 2-4 diverge and stop the run
    monkeypatch.setenv("MHF_DIST_TEST_SAVE_PAUSE", "10")
    run = tmp_path / "run"
    out = run_cli(
        train_args(
            run,
            data,
            1,
            "parallel.zero_stage=1",
            "optimizer.lr=1e12",
            "train.checkpoint_interval=1",
            "train.checkpoint_async=true",
            steps=8,
        ),
        expect_rc=2,
    )
    assert "was not finite for 3 steps in a row (steps 2-4)" in out and "Traceback" not in out
    assert (run / "checkpoints/step-00000001/complete.json").is_file()
    assert (run / "checkpoints/latest").read_text() == "step-00000001"


@pytest.mark.multirank
def test_a_second_job_on_a_run_directory_is_refused(tmp_path, data):
    import json
    import os
    import socket

    run = tmp_path / "run"
    run.mkdir()
    live = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "slurm_job_id": None,
        "started": "earlier",
    }
    (run / "lock.json").write_text(json.dumps(live))  # this test process stands in for a live job
    out = run_cli(train_args(run, data, 2, steps=2), expect_rc=2)
    assert (
        f"is in use by process {os.getpid()} on {socket.gethostname()}" in out
        and "Traceback" not in out
    )
    assert not (run / "config.yaml").exists() and not (run / "checkpoints").exists()

    gone = subprocess.Popen(["true"])
    gone.wait()
    # a job that died without releasing it
    (run / "lock.json").write_text(json.dumps(live | {"pid": gone.pid}))
    out = run_cli(train_args(run, data, 2, steps=2))
    assert f"taking over the lock of {run}: process {gone.pid}" in out
    assert not (run / "lock.json").exists()  # released at the end


def test_unreadable_inputs_are_named_not_traced(tmp_path, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert main(["train", "--preset", "tiny-h4b16k", "--run-dir", str(a_file)]) == 2
    assert f"--run-dir {a_file} is a file" in capsys.readouterr().err
    (tmp_path / "bad.yaml").write_text("model: [unclosed")
    assert main(["config", "--config", str(tmp_path / "bad.yaml")]) == 2
    assert "cannot read config file" in capsys.readouterr().err
    assert (
        main(
            [
                "tokenizer",
                "train",
                "--input",
                str(tmp_path / "missing.txt"),
                "--vocab-size",
                "300",
                "--out",
                str(tmp_path / "tok"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "missing.txt" in err and "--debug shows where" in err
    with pytest.raises(OSError):
        main(
            [
                "--debug",
                "tokenizer",
                "train",
                "--input",
                str(tmp_path / "missing.txt"),
                "--vocab-size",
                "300",
                "--out",
                str(tmp_path / "tok"),
            ]
        )


@pytest.mark.parametrize(
    "argv",
    [
        ["export-hf", "/", "OUT"],
        ["export", "/", "--out", "OUT"],
        ["generate", "--model", "/", "--prompt", "In the beginning"],
        ["eval", "--model", "/", "--lambada", "OUT/lambada.jsonl"],
    ],
)
def test_a_path_that_holds_no_model_is_named_before_the_output(argv, tmp_path, capsys):
    """`/` contains every output directory, yet the problem is that it is no model: said first, with what to pass."""
    out = tmp_path / "out"
    assert main([arg.replace("OUT", str(out)) for arg in argv]) == 2
    err = capsys.readouterr().err
    assert "/ holds no model (no complete.json, no config.yaml): pass " in err, err
    assert "a run directory (the --run-dir of train or import-hf)" in err and "source" not in err
    assert ("an export-hf directory" in err) == (argv[0] in ("generate", "eval"))
    assert not out.exists()


def test_a_run_without_a_checkpoint_or_initial_weights_says_to_train_it(tmp_path, capsys):
    run = RunDir(tmp_path / "run")
    run.save_config(load_config("tiny-h4b16k"))  # as train writes it before the first step
    assert main(["export-hf", str(run.path), str(tmp_path / "out")]) == 2
    assert (
        f"{run.path} has no complete checkpoint yet, nor initial weights (train.init_from): train it until it "
        "saves one"
    ) in capsys.readouterr().err


@pytest.mark.multirank
def test_a_cut_short_metrics_line_does_not_block_resume_or_status(tmp_path, data):
    run = tmp_path / "run"
    train_run(tmp_path, data, "run", 1, "parallel.zero_stage=1", "train.stop_at_step=2", steps=3)
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "loss": 1')  # a crash mid-write
    assert "step       2 / 3" in run_cli(["status", str(run)])
    run_cli(train_args(run, data, 1, "parallel.zero_stage=1", steps=3))
    assert [r["step"] for r in metrics(run)] == [1, 2, 3]


def _fill(path: Path) -> None:
    """A file taking all the space its filesystem has left."""
    with path.open("wb", buffering=0) as f:
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * PAGE)


def test_a_full_disk_while_logging_names_the_file_and_leaves_complete_lines(tmp_path):
    # The run directory on a filesystem that fills while records of 1 KB are logged: the record that does not fit
    # fails naming metrics.jsonl, the cause and the fix, and leaves nothing of itself (no cut line for the next
    # record to be glued to); once space is freed, logging goes on.
    run = RunDir(tmp_path / "run")
    with small_filesystem(run.path, 64 * PAGE):
        logger = MetricsLogger(run)
        logger.log(1, {"loss": 1.0, "note": "x" * 1000})
        _fill(run.path / "filler")  # what is left is the rest of metrics.jsonl's last page
        with pytest.raises(MhfError) as failed:
            for step in range(2, 1000):
                logger.log(step, {"loss": 1.0, "note": "x" * 1000})
        assert str(failed.value) == (
            f"could not log step {step} to {run.metrics_path} (No space left on device): free space on its "
            "filesystem, then rerun to resume (--resume auto); the file keeps its complete records"
        )
        assert run.metrics_path.read_text().endswith("}\n")
        assert [r["step"] for r in read_metrics(run.path)] == list(range(1, step))
        (run.path / "filler").unlink()
        logger.log(step, {"loss": 1.0})
        logger.close()
        assert [r["step"] for r in read_metrics(run.path)] == list(range(1, step + 1))


def test_a_line_cut_short_is_dropped_at_the_next_start(tmp_path, caplog):
    # A crash mid-write (a full disk, kill -9) leaves a last line without its newline; the next start, even one that
    # resumes nothing, must not append its first record onto it (the record would be lost with the cut line).
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    cut = '{"step": 2, "lo'
    run.metrics_path.write_text('{"step": 1, "loss": 2.0}\n' + cut)
    logger = MetricsLogger(run)
    logger.log(1, {"loss": 2.5})
    logger.close()
    assert [(r["step"], r["loss"]) for r in read_metrics(run.path)] == [(1, 2.0), (1, 2.5)]
    assert (
        f"{run.metrics_path} ended in a line cut short ({len(cut)} bytes: a write that never finished); dropped "
        "it" in caplog.text
    )


@pytest.mark.multirank
def test_commands_that_write_a_directory_never_lose_a_run(tmp_path, data):
    run = tmp_path / "run"
    train_run(tmp_path, data, "run", 1, "parallel.zero_stage=1", steps=2)
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    for argv in (
        ["export-hf", str(run), str(run)],
        ["export-hf", str(run), str(tmp_path), "--overwrite"],
        ["export", str(run), "--out", str(run / "checkpoints"), "--overwrite"],
    ):
        out = run_cli(argv, expect_rc=2)
        assert ("source" in out or "holds a run directory" in out) and "Traceback" not in out, out
    # nothing of the run touched
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before

    target = tmp_path / "exported"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    assert "is not empty; choose a new directory, or pass --overwrite" in run_cli(
        ["export", str(run), "--out", str(target)], expect_rc=2
    )
    run_cli(["export", str(run), "--out", str(target), "--overwrite"])
    assert (target / "model.safetensors").is_file() and not (target / "notes.txt").exists()
    assert not list(tmp_path.glob(".exported.*"))  # no staging left behind


@pytest.mark.slow
def test_a_failed_prepare_data_leaves_nothing_behind(tmp_path, data):
    good, binary = tmp_path / "good.txt", tmp_path / "binary.txt"
    good.write_text("In the beginning was the word.\n\nAnd the word was short.\n")
    binary.write_bytes(b"\xff\xfe\x00binary\x80")
    out = tmp_path / "shards"
    args = [
        "prepare-data",
        str(good),
        "--tokenizer",
        str(data["tokenizer"]),
        "--out",
        str(out),
        "--seq-len",
        "8",
        "--samples-per-shard",
        "1",
        "--workers",
        "1",
        "--no-progress",
    ]
    assert "not readable UTF-8 text" in run_cli([*args[:2], str(binary), *args[2:]], expect_rc=2)
    assert not out.exists() and not list(tmp_path.glob(".shards.*"))
    run_cli(args)  # the rerun is not refused
    assert (out / "manifest.json").is_file()


@pytest.mark.multirank
def test_one_rank_killed_mid_save_loses_nothing_saved(tmp_path, data):
    import os

    reference = train_run(tmp_path, data, "ref", 2, "parallel.zero_stage=1", steps=6)
    args = train_args(
        tmp_path / "run", data, 2, "parallel.zero_stage=1", "train.checkpoint_interval=2", steps=6
    )
    # every save stalls before it is marked complete
    env = os.environ | {"MHF_DIST_TEST_SAVE_PAUSE": "3"}
    proc = CliProcess(args, tmp_path / "out.log", env)
    ckpts = tmp_path / "run" / "checkpoints"
    deadline = time.time() + 300
    while not (ckpts / "step-00000004").exists() and time.time() < deadline:
        time.sleep(0.05)
    os.kill(proc.rank_pids()[1], signal.SIGKILL)  # rank 1 alone, mid-save of step 4
    rc = proc.wait(timeout=300)
    # the launcher stopped rank 0, which waited for rank 1
    assert rc != 0, (tmp_path / "out.log").read_text()[-3000:]
    assert (ckpts / "step-00000002" / "complete.json").is_file()
    assert not (ckpts / "step-00000004" / "complete.json").exists()
    out = run_cli(args)  # the relaunch cleans the interrupted save and continues from step 2
    assert "resumed from" in out and "step-00000002" in out
    assert [r["loss"] for r in metrics(tmp_path / "run")] == [r["loss"] for r in reference]
