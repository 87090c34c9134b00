"""Checkpoint faults: resuming an older checkpoint, saves that fail, corrupt or malformed files, crafted RNG files.

Each case ends in correct behaviour or a named error (exit 2, the problem and the fix named, no traceback), and
nothing already saved is lost.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import resource
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from helpers.runs import metrics, run_cli, train_args, train_run
from mhf_dist.train.checkpoint import (
    HostSnapshot,
    read_legacy_rng_state,
    read_rng_state,
    rng_state_bytes,
    set_rng_state,
)

ZERO1 = "parallel.zero_stage=1"


@pytest.mark.multirank
def test_resuming_an_older_checkpoint_sets_the_newer_ones_aside(tmp_path, data):
    # Steps 1-3 on disk, resumed from step 1 with keep_checkpoints=1: retention ordering by name would delete the step
    # just saved (2) and keep the abandoned step 3, leaving `latest` naming a directory that no longer exists.
    run, ckpts = tmp_path / "run", tmp_path / "run/checkpoints"
    first = train_run(tmp_path, data, "run", 1, ZERO1, "train.checkpoint_interval=1", "train.keep_checkpoints=3")
    out = run_cli(train_args(run, data, 1, ZERO1, "train.checkpoint_interval=1", "train.keep_checkpoints=1",
                             "train.stop_at_step=2") + ["--resume", str(ckpts / "step-00000001")])
    assert [p.name for p in ckpts.glob("step-*")] == ["step-00000002"]
    assert (ckpts / "step-00000002/complete.json").is_file()
    assert (ckpts / "latest").read_text() == "step-00000002"
    (aside,) = (ckpts / "abandoned").iterdir()  # the abandoned line, complete, out of retention's way
    assert sorted(p.name for p in aside.iterdir()) == ["step-00000002", "step-00000003"]
    assert all((p / "complete.json").is_file() for p in aside.iterdir())
    assert f"moved step-00000002, step-00000003 to {aside}" in out
    out = run_cli(train_args(run, data, 1, ZERO1, "train.checkpoint_interval=1", "train.keep_checkpoints=1"))
    assert f"resumed from {ckpts / 'step-00000002'} at step 2" in out  # --resume auto follows `latest`
    assert [r["loss"] for r in metrics(run)] == [r["loss"] for r in first]  # the same training, bit for bit


def _file_size_limit(limit: int):
    """A subprocess ``preexec_fn``: files larger than ``limit`` bytes cannot be written (as on a full disk)."""
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    return apply


@pytest.mark.multirank
def test_a_failed_save_is_named_and_the_previous_checkpoint_stays(tmp_path, data):
    # A save that cannot write its files (here: past the file size limit, as on a full disk) must end in a named
    # error, not a traceback and a half-written step directory; what an interrupted save left is removed at the
    # next start, not skipped forever.
    run, ckpts = tmp_path / "run", tmp_path / "run/checkpoints"
    train_run(tmp_path, data, "run", 1, ZERO1, "train.stop_at_step=2", steps=4)
    largest = max(f.stat().st_size for f in (ckpts / "step-00000002").iterdir())
    args = train_args(run, data, 1, ZERO1, steps=4)
    proc = subprocess.run([sys.executable, "-m", "mhf_dist", *args], capture_output=True, text=True, timeout=600,
                          preexec_fn=_file_size_limit(largest // 2))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in out, out[-5000:]
    assert f"could not save checkpoint {ckpts / 'step-00000004'}: rank 0: writing " in out
    assert "the size of step-00000002" in out and "(ulimit -f)" in out and "free space" in out
    assert not (ckpts / "step-00000004").exists() and (ckpts / "latest").read_text() == "step-00000002"
    logged = [r["loss"] for r in metrics(run)]  # steps 3 and 4 were trained before the save failed
    partial = ckpts / "step-00000003"  # what a rank killed during its first write leaves
    partial.mkdir()
    (partial / "mp_rank_00_model_states.pt").write_bytes(b"PK\x03\x04")
    out = run_cli(args)
    assert f"ignoring incomplete checkpoint {partial} (no complete.json: the save was interrupted); removing it" in out
    assert not partial.exists() and not (ckpts / "abandoned").exists()
    assert f"resumed from {ckpts / 'step-00000002'} at step 2" in out
    assert [r["loss"] for r in metrics(run)] == logged


@pytest.mark.multirank
def test_a_save_failing_on_one_rank_fails_on_every_rank(tmp_path, data, monkeypatch):
    # Rank 1 cannot write its optimizer shard while rank 0 can: every rank must end with the same named error,
    # none waiting for the others in a collective, and the half-written checkpoint must not stay behind.
    monkeypatch.setenv("MHF_DIST_TEST_SAVE_FAIL_RANK", "1")
    out = run_cli(train_args(tmp_path / "run", data, 2, ZERO1, "train.checkpoint_interval=1", steps=2),
                  expect_rc=2, timeout=300)
    path = tmp_path / "run/checkpoints/step-00000001"
    assert f"could not save checkpoint {path}: rank 1: writing zero_pp_rank_1_mp_rank_00_optim_states.pt failed " \
           "([Errno 28] No space left on device" in out
    assert f"could not save checkpoint {path}: rank 1 could not write its part" in out  # rank 0's message
    assert "Traceback" not in out and not path.exists()


@pytest.mark.multirank
def test_an_async_save_failing_on_one_rank_fails_on_every_rank(tmp_path, data, monkeypatch):
    # Rank 1's background write of step 2 fails while training goes on: at the next save every rank stops with the
    # same named error, the incomplete step 2 is removed and step 1 stays the newest checkpoint.
    run, ckpts = tmp_path / "run", tmp_path / "run/checkpoints"
    args = train_args(run, data, 2, ZERO1, "train.checkpoint_async=true", "train.checkpoint_interval=1", steps=3)
    run_cli(args + ["--set", "train.stop_at_step=1"])
    monkeypatch.setenv("MHF_DIST_TEST_SAVE_FAIL_RANK", "1")
    out = run_cli(args, expect_rc=2, timeout=300)
    path = ckpts / "step-00000002"
    assert f"could not save checkpoint {path}: rank 1: writing zero_pp_rank_1_mp_rank_00_optim_states.pt failed " \
           "([Errno 28] No space left on device" in out
    assert f"could not save checkpoint {path}: rank 1 could not write its part" in out  # rank 0's message
    assert f"{ckpts / 'step-00000001'} stays the newest checkpoint" in out
    assert "Traceback" not in out and not path.exists()
    assert metrics(run)[-1]["step"] == 3  # trained on while step 2 was written
    assert (ckpts / "latest").read_text() == "step-00000001" and (ckpts / "step-00000001/complete.json").is_file()


@pytest.mark.multirank
def test_corrupt_or_malformed_checkpoints_are_refused_by_name(tmp_path, data):
    # 4 KB overwritten in the middle of an optimizer shard (same size) must not load (it would train on garbage);
    # a complete.json that is not JSON, or lacks fields, must count as incomplete rather than end in a traceback.
    run, ckpts = tmp_path / "run", tmp_path / "run/checkpoints"
    train_run(tmp_path, data, "run", 1, ZERO1, "train.checkpoint_interval=1", steps=2)
    shard = next((ckpts / "step-00000002").glob("*optim_states.pt"))
    intact = shard.read_bytes()
    middle = len(intact) // 2
    shard.write_bytes(intact[:middle] + b"\xff" * 4096 + intact[middle + 4096:])
    args = train_args(run, data, 1, ZERO1, steps=4)
    out = run_cli(args, expect_rc=2)
    assert f"checkpoint {shard.parent}: {shard.name} does not match its sha256 digest" in out
    assert "Traceback" not in out
    shard.write_bytes(intact)
    marker = ckpts / "step-00000002/complete.json"
    marker.write_text(json.dumps({"step": 2}))
    out = run_cli(args + ["--resume", str(shard.parent)], expect_rc=2)
    assert f"{shard.parent} is not a complete checkpoint (malformed complete.json: 'tokens' is missing" in out
    marker.write_text("{")
    older = ckpts / "step-00000001/complete.json"  # as saved before digests were recorded
    older.write_text(json.dumps({k: v for k, v in json.loads(older.read_text()).items() if "digest" not in k}))
    out = run_cli(args)  # --resume auto skips step 2 and loads step 1 on sizes alone
    assert f"ignoring incomplete checkpoint {shard.parent} (malformed complete.json:" in out
    assert f"checkpoint {older.parent} has no content digests" in out
    assert f"resumed from {older.parent} at step 1" in out and "Traceback" not in out
    assert [p.name for p in (ckpts / "abandoned").glob("*/*")] == ["step-00000002"]  # kept: its files are intact


class RunsCommand:
    """Pickles to a call of ``os.system``: unpickling it runs ``command``."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def _relist(ckpt) -> None:
    """Rewrite a checkpoint's complete.json to match its files, as whoever altered them could."""
    marker = json.loads((ckpt / "complete.json").read_text())
    files = sorted(f for f in ckpt.iterdir() if f.name != "complete.json")
    marker["files"] = {f.name: f.stat().st_size for f in files}
    if "digests" in marker:
        marker["digests"] = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files}
    (ckpt / "complete.json").write_text(json.dumps(marker))


@pytest.mark.multirank
def test_a_crafted_rng_file_does_not_run_on_resume(tmp_path, data):
    # A pickle in rng-rank00000.pt that runs a shell command when unpickled (complete.json rewritten to match) must
    # be refused on resume, never unpickled without restrictions.
    train_run(tmp_path, data, "run", 1, ZERO1, steps=2)
    ckpt, witness = tmp_path / "run/checkpoints/step-00000002", tmp_path / "command-ran"
    for f in ckpt.glob("rng-rank*"):
        f.unlink()
    torch.save({"python": RunsCommand(f"touch {witness}"), "numpy": None, "torch": None}, ckpt / "rng-rank00000.pt")
    _relist(ckpt)
    out = run_cli(train_args(tmp_path / "run", data, 1, ZERO1, steps=4), expect_rc=2)
    assert not witness.exists()
    refusal = "is not a plain RNG state (Trying to load unsupported GLOBAL posix.system"
    assert f"{ckpt / 'rng-rank00000.pt'} {refusal}" in out and "Traceback" not in out


def _draws() -> tuple:
    return random.random(), random.gauss(0, 1), np.random.randn(3).tolist(), torch.rand(3).tolist()


def test_rng_states_round_trip_without_pickle_and_older_files_still_load(tmp_path):
    # RNG states are safetensors + JSON (no pickle); the rng-rank*.pt files of earlier checkpoints still load, with
    # weights_only=True. Both restore the same draws.
    before = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    try:
        random.seed(1)
        np.random.seed(2)
        torch.manual_seed(3)
        (tmp_path / "rng.safetensors").write_bytes(rng_state_bytes())
        torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
                   tmp_path / "rng.pt")  # the format of earlier checkpoints
        expected = _draws()
        for read, name in ((read_rng_state, "rng.safetensors"), (read_legacy_rng_state, "rng.pt")):
            random.seed(9)
            np.random.seed(9)
            torch.manual_seed(9)
            set_rng_state(read(tmp_path / name))
            assert _draws() == expected, name
    finally:
        set_rng_state(before)


def test_a_host_snapshot_saves_the_state_as_it_was_with_shared_storage_kept(tmp_path):
    # an asynchronous save serialises a snapshot after training changed the tensors in place: the file must be the
    # one torch.save wrote at the time of the snapshot, byte for byte (views of one storage saved as one storage)
    weights = torch.randn(64, 8)
    state = {"module": {"w": weights, "rows": weights[8:16], "t": weights.t()}, "step": 3, "lr": [1e-3, (0.9, 0.95)]}
    (tmp_path / "then").mkdir()
    torch.save(state, tmp_path / "then/states.pt")
    snapshot = HostSnapshot(state)
    weights.mul_(2)
    state["step"], state["lr"][0] = 4, 5e-4
    (tmp_path / "later").mkdir()
    torch.save(snapshot.restore(), tmp_path / "later/states.pt")
    assert (tmp_path / "later/states.pt").read_bytes() == (tmp_path / "then/states.pt").read_bytes()
    restored = snapshot.restore()["module"]
    assert restored["rows"].untyped_storage().data_ptr() == restored["w"].untyped_storage().data_ptr()
