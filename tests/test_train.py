"""`mhf-dist train` end to end on one rank: loss falls on real text; the run directory's logs."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import time
from datetime import datetime, timezone

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from helpers.runs import run_cli
from mhf_dist.cli import main


@pytest.mark.multirank
def test_tiny_mhf_loss_falls_on_real_text(tmp_path):
    run = tmp_path / "run"
    run_cli(
        [
            "train",
            "--preset",
            "tiny-h4b16k",
            "--run-dir",
            str(run),
            "--set",
            "model.hash.num_buckets=256",
            "--set",
            "tokenizer.vocab_size=1024",
            "--set",
            "data.seq_len=64",
            "--set",
            "train.max_steps=200",
            "--set",
            "train.log_interval=20",
            "--set",
            "optimizer.lr=3e-3",
            "--set",
            "parallel.zero_stage=0",
        ]
    )
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    first, last = records[0], sum(r["loss"] for r in records[-2:]) / 2
    # step 1 sits at the uniform loss H·ln(B) = 4·ln(256) = 22.18; a model that learns nothing stays there
    assert first["step"] == 1 and abs(first["loss"] - 22.18) < 0.5
    assert last < first["loss"] - 2.5, (first["loss"], last)
    # evaluation at the end on the held-out split: the training loss there, and perplexity under P_inf
    assert abs(records[-1]["val_loss"] - last) < 2.0
    assert 1 < records[-1]["val_ppl"] < float("inf")


@pytest.mark.multirank
def test_train_writes_metrics_and_tensorboard(tmp_path):
    run = tmp_path / "run"
    out = run_cli(
        [
            "train",
            "--preset",
            "tiny-h4b16k",
            "--run-dir",
            str(run),
            "--set",
            "model.hash.num_buckets=128",
            "--set",
            "train.max_steps=4",
            "--set",
            "train.log_interval=2",
            "--set",
            "train.global_batch_size=4",
            "--set",
            "train.micro_batch_size=2",
            "--set",
            "tokenizer.vocab_size=512",
        ]
    )
    assert "tokens/s" in out and "MFU" in out
    shown = [line for line in out.splitlines() if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in shown] == ["step 1/4", "step 2/4", "step 4/4"]
    assert re.fullmatch(
        r"step 2/4 \| loss [\d.]+ \| grad [\d.e+-]+ \| lr [\d.e+-]+ \| [\d,]+ tok/s \| mfu [\d.]+% \| "
        r"mem [\d.]+ GB \| [\d.e+-]+ s/step \| eta \d+ s",
        shown[1],
    ), shown[1]
    assert "val_ppl " in shown[2] and "eta 0 s" in shown[2]
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 4]
    for line in lines:
        assert line["step_s"] > 0 and datetime.fromisoformat(line["time"]).tzinfo == timezone.utc
    for line in lines:
        assert {
            "step",
            "loss",
            "head_losses",
            "lr",
            "tokens_per_s",
            "tflops",
            "mfu",
            "memory_gb",
            "grad_norm",
        } <= set(line) and len(line["head_losses"]) == 4
        assert abs(sum(line["head_losses"]) - line["loss"]) < 1e-4
        assert 0 < line["mfu"] < 1 and line["tflops"] > 0
    val = lines[-1]
    assert {
        "val_loss",
        "val_p_inf_nll",
        "val_ppl",
        "val_ppl_calibrated",
        "val_temperature",
        "val_p_inf_nll_calibrated",
        "val_top1",
        "val_top5",
        "val_head_losses",
    } <= set(val)
    assert (
        len(val["val_head_losses"]) == 4
        and abs(sum(val["val_head_losses"]) - val["val_loss"]) < 1e-4
    )
    assert val["val_ppl"] == pytest.approx(math.exp(val["val_p_inf_nll"]))
    assert val["val_ppl_calibrated"] == pytest.approx(math.exp(val["val_p_inf_nll_calibrated"]))
    assert val["val_p_inf_nll_calibrated"] <= val["val_p_inf_nll"]  # τ = 1 is among the candidates
    assert 0.02 <= val["val_temperature"] <= 4 and 0 <= val["val_top1"] <= val["val_top5"] <= 1
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    expected = {
        "loss",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "tflops",
        "mfu",
        "memory_gb",
        "val_ppl",
        "head_losses/0",
        "head_losses/3",
        "val_ppl_calibrated",
        "val_temperature",
        "val_top1",
        "val_top5",
        "val_head_losses/0",
        "val_head_losses/3",
    }
    assert expected <= set(acc.Tags()["scalars"])
    assert [e.step for e in acc.Scalars("loss")] == [1, 2, 4]
    assert (run / "signatures" / "signatures.json").is_file() and (run / "config.yaml").is_file()


def test_bad_config_exits_with_named_error(tmp_path, capsys):
    rc = main(
        [
            "train",
            "--preset",
            "tiny-h4b16k",
            "--run-dir",
            str(tmp_path),
            "--set",
            "model.d_model=65",
        ]
    )
    assert rc == 2
    assert "model.d_model=65 is not divisible by model.n_heads=4" in capsys.readouterr().err


@pytest.mark.multirank
def test_step_lines_reach_a_log_file_while_the_run_goes_on(tmp_path, data):
    """A job log is a file, not a terminal: each logged step must be in it at once, not when the run ends."""
    from helpers.runs import CliProcess, train_args

    # as a job script without it
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    log = tmp_path / "job.out"
    proc = CliProcess(train_args(tmp_path / "run", data, 2, steps=500), log, env)
    metrics = tmp_path / "run" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 300
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        # step 2 is in metrics.jsonl: its console line must follow within a second
        logged = time.monotonic()
        while "step 2/500 |" not in log.read_text() and time.monotonic() < logged + 1.5:
            time.sleep(0.1)
        seen = log.read_text()
        assert "step 1/500 |" in seen and "step 2/500 |" in seen, seen[-3000:]
        assert proc.poll() is None  # shown while the run goes on
    finally:
        proc.send_signal(signal.SIGTERM)  # saves and stops (exit 85)
        assert proc.wait(timeout=300) == 85
    assert seen.count("step 1/500 |") == 1  # from rank 0 only
    # ZeRO-3 sees the model's outputs as tensors
    assert "unknown inputs or outputs type" not in seen
    assert "DeepSpeed " not in seen  # its start-up lines are held back (train --verbose shows them)


@pytest.mark.multirank
def test_a_pipeline_run_prints_only_its_own_lines(tmp_path, data):
    from helpers.runs import train_args

    out = run_cli(
        train_args(tmp_path / "run", data, 2, "parallel.pp=2", "parallel.zero_stage=1", steps=2)
    )
    ours = ("step ", "saved ", "done: ")
    assert [line for line in out.splitlines() if not line.startswith(ours)] == [], out
    verbose = run_cli(
        train_args(tmp_path / "run2", data, 2, "parallel.pp=2", "parallel.zero_stage=1", steps=1)
        + ["--verbose"]
    )
    assert "Using topology" in verbose
