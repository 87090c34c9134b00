"""Checkpoints and resume: bit-identical continuation, preemption, crash safety, named errors."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest
import torch

from helpers.runs import CliProcess, metrics, run_cli, train_args, train_run
from mhf_dist.backend.deepspeed.universal import consolidate
from mhf_dist.train.fault_injection import CONVERT_PAUSE_ENV

# every test trains under `mhf-dist train`
pytestmark = pytest.mark.multirank


def assert_same_weights(a, b, pipeline):
    """Consolidated fp32 weights (all shards merged) are bitwise equal."""
    wa, wb = consolidate(a, pipeline), consolidate(b, pipeline)
    assert wa.keys() == wb.keys() and "vocab.tables.weight" in wa
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key


@pytest.mark.parametrize(
    "nproc, overrides",
    [(2, []), (4, ["parallel.tp=2", "parallel.pp=2"])],
    ids=["dp2-zero3", "tp2-pp2-zero1"],
)
def test_stop_and_resume_is_bit_identical(tmp_path, data, nproc, overrides):
    full = train_run(tmp_path, data, "full", nproc, *overrides, steps=6)
    first = train_run(tmp_path, data, "split", nproc, *overrides, "train.stop_at_step=3", steps=6)
    assert [r["step"] for r in first] == [1, 2, 3]
    assert first[2]["lr"] == full[2]["lr"]  # stopping early does not change the schedule
    resumed = train_run(tmp_path, data, "split", nproc, *overrides, steps=6)  # --resume auto
    assert [r["step"] for r in resumed] == list(range(1, 7))  # appended to the same metrics.jsonl
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full]
    assert [r["head_losses"] for r in resumed] == [r["head_losses"] for r in full]
    assert_same_weights(
        tmp_path / "split/checkpoints/step-00000006",
        tmp_path / "full/checkpoints/step-00000006",
        pipeline=nproc == 4,
    )


def test_signal_saves_and_exits_for_requeue(tmp_path, data):
    steps = 40
    reference = train_run(tmp_path, data, "ref", 2, "parallel.zero_stage=1", steps=steps)
    args = train_args(tmp_path / "run", data, 2, "parallel.zero_stage=1", steps=steps)
    proc = CliProcess(args, tmp_path / "out.log")
    log = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 300
    while not (log.exists() and len(log.read_text().splitlines()) >= 2) and time.time() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGUSR1)  # the launcher forwards it to both ranks
    assert proc.wait(timeout=300) == 85, (tmp_path / "out.log").read_text()[-3000:]
    marker = json.loads(
        next((tmp_path / "run/checkpoints").glob("step-*/complete.json")).read_text()
    )
    assert marker["reason"] == "signal" and 2 <= marker["step"] < steps
    run_cli(args)  # the relaunch (--resume auto) finishes the run
    assert [r["loss"] for r in metrics(tmp_path / "run")] == [r["loss"] for r in reference]


def test_time_based_saves_are_agreed_by_all_ranks(tmp_path, data, monkeypatch):
    # 6 ms: every step outlasts it, so each rank's clock says "due" after every step; one all-reduce makes it one
    # decision (ranks that disagreed would wait on each other inside the save forever)
    # as a job script sets it: no step and save fit in that
    monkeypatch.setenv("MHF_DIST_GRACE_SECONDS", "0.01")
    out = run_cli(
        train_args(
            tmp_path / "run",
            data,
            2,
            "train.checkpoint_minutes=0.0001",
            "train.keep_checkpoints=9",
            steps=3,
        )
    )
    markers = [
        json.loads(p.read_text())
        for p in sorted((tmp_path / "run/checkpoints").glob("step-*/complete.json"))
    ]
    assert [(m["step"], m["reason"]) for m in markers] == [(1, "time"), (2, "time"), (3, "end")]
    # size, duration, rate
    assert re.search(r"\(time, [\d.]+ MB in [\d.]+ s, [\d.e-]+ GB/s per node\)", out)
    assert "needs a grace of about 120 s, and this job has 0 s: submit with --grace 120" in out


def test_kill_during_save_keeps_previous_checkpoint(tmp_path, data):
    reference = train_run(tmp_path, data, "ref", 2, "parallel.zero_stage=1", steps=6)
    args = train_args(
        tmp_path / "run", data, 2, "parallel.zero_stage=1", "train.checkpoint_interval=2", steps=6
    )
    # every save stalls before it is marked complete
    env = os.environ | {"MHF_DIST_TEST_SAVE_PAUSE": "3"}
    proc = CliProcess(args, tmp_path / "out.log", env, new_session=True)
    ckpts = tmp_path / "run" / "checkpoints"
    deadline = time.time() + 300
    while not (ckpts / "step-00000004").exists() and time.time() < deadline:
        time.sleep(0.05)
    assert (ckpts / "step-00000002" / "complete.json").exists()
    os.killpg(proc.pid, signal.SIGKILL)  # every rank, mid-save of step 4
    proc.wait()
    assert not (ckpts / "step-00000004" / "complete.json").exists()
    out = run_cli(args)
    assert (
        "ignoring incomplete checkpoint" in out and "resumed from" in out and "step-00000002" in out
    ), out
    assert [r["loss"] for r in metrics(tmp_path / "run")] == [r["loss"] for r in reference]


ASYNC = "train.checkpoint_async=true"


def _wait_for_step(run, step: int, proc) -> None:
    """Until the running ``proc`` logged ``step`` (one line of metrics.jsonl per step)."""
    log, deadline = run / "metrics.jsonl", time.time() + 300
    while not (log.exists() and len(log.read_text().splitlines()) >= step):
        assert proc.poll() is None and time.time() < deadline, (
            f"the run ended or stalled before step {step}"
        )
        time.sleep(0.05)


def test_async_saves_train_and_resume_as_synchronous_ones(tmp_path, data):
    # step 2 is saved in the background while steps 3 and 4 train (and change the weights it holds); resumed from it,
    # the run continues as the synchronous one, bit for bit. ZeRO-1: its partitions' padding is zeros (ZeRO-3 leaves
    # it uninitialised, so no two saves' files are byte for byte alike)
    layout = ["parallel.zero_stage=1", "train.checkpoint_interval=2"]
    sync = train_run(tmp_path, data, "sync", 2, *layout, steps=6)
    first = train_run(tmp_path, data, "async", 2, *layout, ASYNC, "train.stop_at_step=4", steps=6)
    assert [r["loss"] for r in first] == [r["loss"] for r in sync[:4]]
    ckpts = tmp_path / "async/checkpoints"
    for step in ("step-00000002", "step-00000004"):  # DeepSpeed's optimizer shards, byte for byte
        ours, theirs = (
            json.loads((d / step / "complete.json").read_text())["digests"]
            for d in (ckpts, tmp_path / "sync/checkpoints")
        )
        shards = [n for n in theirs if "optim_states" in n]
        assert len(shards) == 2 and all(ours[n] == theirs[n] for n in shards)
    assert (ckpts / "latest").read_text() == "step-00000004"
    out = run_cli(
        train_args(tmp_path / "async", data, 2, *layout, ASYNC, steps=6)
        + ["--resume", str(ckpts / "step-00000002")]
    )
    assert f"resumed from {ckpts / 'step-00000002'} at step 2" in out
    assert "s stall, " in out and " s in the background, " in out
    resumed = metrics(tmp_path / "async")
    assert [r["loss"] for r in resumed] == [r["loss"] for r in sync]
    assert [r["head_losses"] for r in resumed] == [r["head_losses"] for r in sync]
    assert_same_weights(
        ckpts / "step-00000006", tmp_path / "sync/checkpoints/step-00000006", pipeline=False
    )


def test_training_goes_on_during_an_async_save_and_a_kill_then_keeps_the_previous_checkpoint(
    tmp_path, data
):
    run, ckpts = tmp_path / "run", tmp_path / "run/checkpoints"
    args = train_args(
        run, data, 1, "parallel.zero_stage=1", ASYNC, "train.checkpoint_interval=2", steps=6
    )
    # each background write stalls before complete.json
    env = os.environ | {"MHF_DIST_TEST_SAVE_PAUSE": "10"}
    proc = CliProcess(args, tmp_path / "out.log", env, new_session=True)
    # step 5 trained and logged while step 4's save is still being written
    _wait_for_step(run, 5, proc)
    assert (ckpts / "step-00000004").is_dir() and not (
        ckpts / "step-00000004/complete.json"
    ).exists()
    assert (ckpts / "step-00000002/complete.json").is_file()  # step 4's save waited for step 2's
    os.killpg(proc.pid, signal.SIGKILL)  # mid-way through the background write of step 4
    proc.wait()
    assert not (ckpts / "step-00000004/complete.json").exists()
    assert (ckpts / "latest").read_text() == "step-00000002"
    before = [r["loss"] for r in metrics(run)]
    out = run_cli(args)
    assert f"ignoring incomplete checkpoint {ckpts / 'step-00000004'}" in out
    assert f"resumed from {ckpts / 'step-00000002'} at step 2" in out
    assert [r["loss"] for r in metrics(run)][:5] == before[:5]


def test_a_signal_during_an_async_save_waits_for_it_and_exits_for_requeue(tmp_path, data):
    run, ckpts = tmp_path / "run", tmp_path / "run/checkpoints"
    args = train_args(
        run, data, 1, "parallel.zero_stage=1", ASYNC, "train.checkpoint_interval=2", steps=40
    )
    env = os.environ | {"MHF_DIST_TEST_SAVE_PAUSE": "10", "PYTHONUNBUFFERED": "1"}
    proc = CliProcess(args, tmp_path / "out.log", env)
    _wait_for_step(run, 3, proc)
    assert not (ckpts / "step-00000002/complete.json").exists()  # its save is in flight
    proc.send_signal(signal.SIGUSR1)
    rc, out = proc.wait(timeout=300), (tmp_path / "out.log").read_text()
    assert rc == 85, out[-3000:]
    markers = [json.loads(p.read_text()) for p in sorted(ckpts.glob("step-*/complete.json"))]
    assert [m["reason"] for m in markers] == ["interval", "signal"] and markers[1]["step"] < 40
    assert (ckpts / "latest").read_text() == f"step-{markers[1]['step']:08d}"
    assert f"saved {ckpts / 'step-00000002'} (interval, " in out and "(signal, " in out


def test_mismatched_or_damaged_checkpoints_are_named(tmp_path, data):
    train_run(tmp_path, data, "run", 1, "parallel.zero_stage=1", steps=2)
    ckpt = tmp_path / "run/checkpoints/step-00000002"
    out = run_cli(
        train_args(
            tmp_path / "run", data, 1, "parallel.zero_stage=1", "model.hash.gate_dim=32", steps=4
        ),
        expect_rc=2,
    )
    assert "is of another model (model.hash: checkpoint" in out
    from mhf_dist.vocab.signatures import SignatureTable

    sig_dir = tmp_path / "run/signatures"
    original = SignatureTable.load(sig_dir)
    SignatureTable.build(original.tokens, 4, 256, pad_id=original.pad_id, unique=False).save(
        sig_dir
    )
    out = run_cli(
        train_args(tmp_path / "run", data, 1, "parallel.zero_stage=1", steps=4), expect_rc=2
    )
    assert "was trained with signature table" in out and "use the run's own signatures/" in out
    original.save(sig_dir)
    shard = next(ckpt.glob("*optim_states.pt"))
    shard.write_bytes(shard.read_bytes()[:100])
    out = run_cli(
        train_args(tmp_path / "run", data, 1, "parallel.zero_stage=1", steps=4), expect_rc=2
    )
    assert f"{shard.name} has 100 bytes" in out and "truncated or corrupt" in out
    shard.unlink()
    out = run_cli(
        train_args(tmp_path / "run", data, 1, "parallel.zero_stage=1", steps=4), expect_rc=2
    )
    assert f"is missing {shard.name}" in out


@pytest.mark.parametrize(
    "nproc, overrides, nproc2, overrides2",
    [
        (1, [], 2, []),  # dp 1 -> 2 (ZeRO-3)
        (2, ["parallel.tp=2"], 1, []),  # tp 2 -> 1
        (4, ["parallel.tp=2", "parallel.pp=2"], 2, ["parallel.zero_stage=1"]),  # tp2 x pp2 -> dp 2
        # ZeRO-3 under tp = 2 (each tp rank loads its own shards): dp 1 -> 2, and from one unsplit process
        (2, ["parallel.tp=2"], 4, ["parallel.tp=2"]),
        (1, [], 2, ["parallel.tp=2"]),
    ],
    ids=["dp1-to-dp2", "tp2-to-tp1", "tp2pp2-to-dp2", "tp2-dp1-to-dp2", "tp1-to-tp2"],
)
def test_resume_under_another_layout(
    tmp_path, data, nproc, overrides, nproc2, overrides2, monkeypatch
):
    full = train_run(tmp_path, data, "full", nproc, *overrides, steps=6)
    train_run(tmp_path, data, "split", nproc, *overrides, "train.stop_at_step=3", steps=6)
    # the conversion outlasts the process group's timeout (6 s), as a large one outlasts any: no rank may wait for
    # it in a collective
    monkeypatch.setenv(CONVERT_PAUSE_ENV, "10")
    out = run_cli(
        train_args(
            tmp_path / "split", data, nproc2, *overrides2, "train.dist_timeout_minutes=0.1", steps=6
        )
    )
    assert "converted to this layout" in out
    for got, want in zip(metrics(tmp_path / "split"), full):
        assert abs(got["loss"] - want["loss"]) <= 1e-5 * want["loss"], (
            got["step"],
            got["loss"],
            want["loss"],
        )


def test_export_of_zero3_checkpoint_equals_unsharded_weights(tmp_path, data):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    train_run(tmp_path, data, "run", 2, steps=2)  # dp 2, ZeRO-3
    run_cli(["export", str(tmp_path / "run"), "--out", str(tmp_path / "export")])
    exported = load_file(str(tmp_path / "export/model.safetensors"))
    reference = get_fp32_state_dict_from_zero_checkpoint(
        str(tmp_path / "run/checkpoints"), tag="step-00000002"
    )
    assert exported.keys() == reference.keys()
    for k in reference:
        assert torch.equal(exported[k], reference[k]), k
    assert exported["vocab.tables.weight"].shape == (4, 256, 64)
    assert {"config.yaml", "signatures", "tokenizer"} <= {
        p.name for p in (tmp_path / "export").iterdir()
    }


def test_deepspeeds_zero_to_fp32_beside_the_checkpoints_writes_the_exported_weights(tmp_path, data):
    """docs/models.md: ``python RUN/checkpoints/zero_to_fp32.py RUN/checkpoints OUT -t step-N`` (DeepSpeed's script,
    copied there at every save) merges a ZeRO-3 checkpoint into the names and values ``export`` writes."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    # dp 2, ZeRO-3: each rank's file holds half of every parameter
    train_run(tmp_path, data, "run", 2, steps=2)
    checkpoints = tmp_path / "run" / "checkpoints"
    subprocess.run(
        [
            sys.executable,
            str(checkpoints / "zero_to_fp32.py"),
            str(checkpoints),
            str(tmp_path / "fp32"),
            "-t",
            "step-00000002",
            "--safe_serialization",
        ],
        check=True,
        capture_output=True,
        env=os.environ | {"DS_ACCELERATOR": "cpu"},
    )
    run_cli(["export", str(tmp_path / "run"), "--out", str(tmp_path / "export")])
    merged, exported = (
        load_file(str(tmp_path / d / "model.safetensors")) for d in ("fp32", "export")
    )
    assert merged.keys() == exported.keys() and "vocab.tables.weight" in merged
    for k in merged:
        assert torch.equal(merged[k], exported[k]), k


def test_a_checkpoint_of_another_pipeline_cut_resumes_through_a_conversion(tmp_path, data):
    # same tp, pp and dp, but stages that held other layers (a checkpoint written before the cut was recorded, or
    # under another sequence length): its files cannot be loaded as they are
    layout = ["parallel.pp=2", "parallel.zero_stage=1"]
    train_run(tmp_path, data, "run", 2, *layout, "train.stop_at_step=2", steps=4)
    marker_path = next((tmp_path / "run" / "checkpoints").glob("step-*")) / "complete.json"
    marker = json.loads(marker_path.read_text())
    # vocabulary in, 2 blocks, norm, vocabulary out
    assert marker["layout"]["stages"][-1] == 2 + 2 + 1
    del marker["layout"]["stages"]
    marker_path.write_text(json.dumps(marker))
    out = run_cli(train_args(tmp_path / "run", data, 2, *layout, steps=4))
    assert "resumed from" in out and "converted to this layout" in out


def test_a_pipeline_checkpoint_under_zero3_is_refused_with_the_layout_that_resumes_it(
    tmp_path, data
):
    train_run(
        tmp_path,
        data,
        "run",
        2,
        "parallel.pp=2",
        "parallel.zero_stage=1",
        "train.stop_at_step=2",
        steps=4,
    )
    out = run_cli(train_args(tmp_path / "run", data, 2, steps=4), expect_rc=2)  # dp=2, ZeRO-3
    assert (
        "cannot load it under ZeRO-3: resume with --set parallel.zero_stage=1" in out
        and "Traceback" not in out
    )
    out = run_cli(train_args(tmp_path / "run", data, 2, "parallel.zero_stage=1", steps=4))
    assert "converted to this layout" in out
