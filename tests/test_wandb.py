"""Weights & Biases logging (``train.wandb``), offline: config, the missing-package error, and a run that is resumed
into the same W&B run with its scalars in W&B's own transaction log."""

from __future__ import annotations

import importlib.util
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.runs import metrics, run_cli
from mhf_dist.config import ConfigError, load_config


def test_wandb_config_is_off_by_default_and_set_from_the_command_line(tmp_path):
    assert load_config("tiny-h4b16k").train.wandb is None
    (tmp_path / "run.yaml").write_text("preset: tiny-h4b16k\ntrain:\n  wandb: null\n")
    assert (
        load_config(
            path=tmp_path / "run.yaml", overrides=["train.wandb.project=foo"]
        ).train.wandb.project
        == "foo"
    )
    wb = load_config(
        "tiny-h4b16k", overrides=["train.wandb.project=foo", "train.wandb.mode=offline"]
    ).train.wandb
    assert (wb.project, wb.entity, wb.name, wb.mode) == ("foo", None, None, "offline")
    assert (
        load_config(
            "tiny-h4b16k", overrides=["train.wandb.project=foo", "train.wandb=null"]
        ).train.wandb
        is None
    )
    assert (
        load_config("tiny-h4b16k", overrides=["train.wandb.mode=disabled"]).train.wandb.project
        is None
    )
    with pytest.raises(ConfigError, match="train.wandb.project=NAME"):
        load_config("tiny-h4b16k", overrides=["train.wandb.mode=offline"])
    with pytest.raises(ConfigError, match="train.wandb.mode"):
        load_config("tiny-h4b16k", overrides=["train.wandb.project=foo", "train.wandb.mode=cloud"])


def test_no_module_imports_wandb_until_a_run_uses_it():
    code = "import sys, mhf_dist.cli, mhf_dist.config, mhf_dist.train.metrics; print('wandb' in sys.modules)"
    assert (
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout
        == "False\n"
    )


def test_a_missing_wandb_package_is_a_config_error_naming_the_extra(tmp_path, monkeypatch):
    from mhf_dist.train.metrics import start_wandb

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "wandb" else find_spec(name, *a),
    )
    cfg = load_config("tiny-h4b16k", overrides=["train.wandb.project=foo"])
    with pytest.raises(ConfigError, match=r"pip install 'mhf-dist\[wandb\]'"):
        start_wandb(tmp_path, cfg)
    assert start_wandb(tmp_path, load_config("tiny-h4b16k")) is None  # off: wandb is never needed


def wandb_log_records(path: Path) -> list:
    """The protobuf records of a ``.wandb`` file: W&B's header, then LevelDB's log format (32 KiB blocks of
    chunks, each with a 7-byte header: CRC, length, type 1 full / 2 first / 3 middle / 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    records, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        if kind == 0:  # zero-filled tail of the file
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def logged_history(run: Path) -> dict[int, dict]:
    """``{step: {name: value}}`` over every offline W&B run directory of ``run``."""
    history = {}
    for log in sorted(run.glob("wandb/offline-run-*/run-*.wandb")):
        for record in wandb_log_records(log):
            if record.WhichOneof("record_type") == "history":
                items = {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in record.history.item
                }
                step = items.get("_step", record.history.step.num)  # older W&B: only in the items
                history.setdefault(step, {}).update(
                    {k: v for k, v in items.items() if not k.startswith("_")}
                )
    return history


@pytest.mark.multirank
def test_a_resumed_run_logs_to_the_same_wandb_run(tmp_path, monkeypatch, data):
    for name, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_DIR": tmp_path / "wandb-default",
        "WANDB_CONFIG_DIR": tmp_path / "wandb-config",
        "WANDB_CACHE_DIR": tmp_path / "wandb-cache",
        "WANDB_DATA_DIR": tmp_path / "wandb-data",
    }.items():
        if name.endswith("_DIR"):
            value.mkdir()  # W&B writes to ./wandb instead of a directory that does not exist
        monkeypatch.setenv(name, str(value))
    run = tmp_path / "run"
    args = ["train", "--preset", "tiny-h4b16k", "--run-dir", str(run)]
    for o in (
        f"tokenizer.path={data['tokenizer']}",
        f"data.path={data['shards']}",
        "data.seq_len=64",
        "model.hash.num_buckets=128",
        "train.global_batch_size=2",
        "train.micro_batch_size=2",
        "train.eval_sequences=2",
        "train.wandb.project=mhf-test",
        "train.wandb.mode=offline",
    ):
        args += ["--set", o]
    run_cli([*args, "--set", "train.max_steps=2"])
    run_id = (run / "wandb" / "run_id").read_text().strip()
    run_cli([*args, "--set", "train.max_steps=4"])
    assert (run / "wandb" / "run_id").read_text().strip() == run_id

    starts = sorted(run.glob("wandb/offline-run-*"))
    assert len(starts) == 2 and all(d.name.endswith(f"-{run_id}") for d in starts), starts
    assert [p.name for d in starts for p in d.glob("*.wandb")] == [f"run-{run_id}.wandb"] * 2
    for d, max_steps in zip(
        starts, [2, 4]
    ):  # both starts open the one run, named after the run directory
        records = wandb_log_records(d / f"run-{run_id}.wandb")
        (run_record,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
        assert (run_record.run_id, run_record.project, run_record.display_name) == (
            run_id,
            "mhf-test",
            "run",
        )
        # each start's run config
        config = {i.key: json.loads(i.value_json) for i in run_record.config.update}
        assert (
            config["train"]["max_steps"] == max_steps
            and config["model"]["hash"]["num_buckets"] == 128
        )

    history, records = logged_history(run), metrics(run)
    assert sorted(history) == [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:  # the scalars of metrics.jsonl, lists one per element
        assert history[r["step"]]["loss"] == pytest.approx(r["loss"])
        assert history[r["step"]]["lr"] == pytest.approx(r["lr"])
        assert history[r["step"]]["head_losses/3"] == pytest.approx(r["head_losses"][3])
    assert history[4]["val_loss"] == pytest.approx(records[-1]["val_loss"])
