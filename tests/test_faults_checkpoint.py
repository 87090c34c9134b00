"""Checkpoint faults: resuming an older checkpoint, saves that fail, corrupt or malformed files, crafted RNG files.

Each case ends in correct behaviour or a named error (exit 2, the problem and the fix named, no traceback), and
nothing already saved is lost.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
from importlib.metadata import version
from pathlib import Path

import numpy as np
import pytest
import torch

import mhf_dist
from helpers.filesystems import PAGE, pages, read_only, resize, small_filesystem
from helpers.runs import CliProcess, metrics, run_cli, train_args, train_run
from mhf_dist.cli import main
from mhf_dist.config import load_config
from mhf_dist.train.checkpoint import (
    BackgroundDeleter,
    Checkpointer,
    HostSnapshot,
    RecordingWriter,
    read_legacy_rng_state,
    read_rng_state,
    rng_state_bytes,
    set_rng_state,
)
from mhf_dist.train.checkpoint.index import checkpoint_bytes, complete_checkpoints
from mhf_dist.train.checkpoint.store import CheckpointStore
from mhf_dist.train.fault_injection import DISK_BYTES_ENV, free_bytes

ZERO1 = "parallel.zero_stage=1"


@pytest.mark.multirank
def test_resuming_an_older_checkpoint_sets_the_newer_ones_aside(tmp_path, data):
    # Steps 1-3 on disk, resumed from step 1 with keep_checkpoints=1: retention ordering by name would delete the step
    # just saved (2) and keep the abandoned step 3, leaving `latest` naming a directory that no longer exists.
    run, ckpts = tmp_path / "run", tmp_path / "run/checkpoints"
    first = train_run(
        tmp_path, data, "run", 1, ZERO1, "train.checkpoint_interval=1", "train.keep_checkpoints=3"
    )
    out = run_cli(
        train_args(
            run,
            data,
            1,
            ZERO1,
            "train.checkpoint_interval=1",
            "train.keep_checkpoints=1",
            "train.stop_at_step=2",
        )
        + ["--resume", str(ckpts / "step-00000001")]
    )
    assert [p.name for p in ckpts.glob("step-*")] == ["step-00000002"]
    assert (ckpts / "step-00000002/complete.json").is_file()
    assert (ckpts / "latest").read_text() == "step-00000002"
    (aside,) = (
        ckpts / "abandoned"
    ).iterdir()  # the abandoned line, complete, out of retention's way
    assert sorted(p.name for p in aside.iterdir()) == ["step-00000002", "step-00000003"]
    assert all((p / "complete.json").is_file() for p in aside.iterdir())
    assert f"moved step-00000002, step-00000003 to {aside}" in out
    out = run_cli(
        train_args(run, data, 1, ZERO1, "train.checkpoint_interval=1", "train.keep_checkpoints=1")
    )
    # --resume auto follows `latest`
    assert f"resumed from {ckpts / 'step-00000002'} at step 2" in out
    # the same training, bit for bit
    assert [r["loss"] for r in metrics(run)] == [r["loss"] for r in first]


def _overwrite_middle(path: Path) -> bytes:
    """4 KB in the middle of a file overwritten (same size: only the digest tells); returns the new content."""
    intact = path.read_bytes()
    middle = len(intact) // 2
    path.write_bytes(intact[:middle] + b"\xff" * 4096 + intact[middle + 4096 :])
    return path.read_bytes()


@pytest.mark.multirank
def test_a_failed_save_is_named_and_the_previous_checkpoint_stays(tmp_path, data):
    # A save that cannot write its files (here: past the file size limit, as on a full disk) must end in a named
    # error, not a traceback and a half-written step directory; what an interrupted save left is removed at the
    # next start, not skipped forever.
    run, ckpts = tmp_path / "run", tmp_path / "run/checkpoints"
    train_run(tmp_path, data, "run", 1, ZERO1, "train.stop_at_step=2", steps=4)
    largest = max(f.stat().st_size for f in (ckpts / "step-00000002").iterdir())
    args = train_args(run, data, 1, ZERO1, steps=4)
    rc = CliProcess(args, tmp_path / "out.log", file_size_limit=largest // 2).wait(timeout=600)
    out = (tmp_path / "out.log").read_text()
    assert rc == 2 and "Traceback" not in out, out[-5000:]
    assert f"could not save checkpoint {ckpts / 'step-00000004'}: rank 0: writing " in out
    assert "the size of step-00000002" in out and "(ulimit -f)" in out and "free space" in out
    assert (
        not (ckpts / "step-00000004").exists() and (ckpts / "latest").read_text() == "step-00000002"
    )
    logged = [r["loss"] for r in metrics(run)]  # steps 3 and 4 were trained before the save failed
    partial = ckpts / "step-00000003"  # what a rank killed during its first write leaves
    partial.mkdir()
    (partial / "mp_rank_00_model_states.pt").write_bytes(b"PK\x03\x04")
    out = run_cli(args)
    assert (
        f"ignoring incomplete checkpoint {partial} (no complete.json: the save was interrupted); removing it"
        in out
    )
    assert not partial.exists() and not (ckpts / "abandoned").exists()
    assert f"resumed from {ckpts / 'step-00000002'} at step 2" in out
    assert [r["loss"] for r in metrics(run)] == logged


@pytest.mark.multirank
def test_a_save_failing_on_one_rank_fails_on_every_rank(tmp_path, data, monkeypatch):
    # Rank 1 cannot write its optimizer shard while rank 0 can: every rank must end with the same named error,
    # none waiting for the others in a collective, and the half-written checkpoint must not stay behind.
    monkeypatch.setenv("MHF_DIST_TEST_SAVE_FAIL_RANK", "1")
    out = run_cli(
        train_args(tmp_path / "run", data, 2, ZERO1, "train.checkpoint_interval=1", steps=2),
        expect_rc=2,
        timeout=300,
    )
    path = tmp_path / "run/checkpoints/step-00000001"
    assert (
        f"could not save checkpoint {path}: rank 1: writing zero_pp_rank_1_mp_rank_00_optim_states.pt failed "
        "([Errno 28] No space left on device" in out
    )
    # rank 0's message
    assert f"could not save checkpoint {path}: rank 1 could not write its part" in out
    assert "Traceback" not in out and not path.exists()


def _state_files(checkpoint: Path) -> int:
    """The bytes a tmpfs takes for DeepSpeed's state files of ``checkpoint``."""
    return sum(pages(f.stat().st_size) for f in checkpoint.glob("*_states.pt"))


@pytest.mark.multirank
def test_a_first_save_on_a_full_filesystem_is_named_and_removed(tmp_path, data):
    # The checkpoints on a filesystem that holds the state files but not DeepSpeed's helper zero_to_fp32.py, copied
    # beside the step directories after them: the first save must fail as any other (named, with the space it
    # takes and what is free, the incomplete directory removed, no partial helper left), and the rerun once space is
    # freed must save.
    reference = tmp_path / "reference/checkpoints/step-00000001"
    train_run(tmp_path, data, "reference", 1, ZERO1, steps=1)
    size = (
        _state_files(reference)
        + pages((reference.parent / "zero_to_fp32.py").stat().st_size)
        - PAGE
    )
    run, ckpts = tmp_path / "run", tmp_path / "run/checkpoints"
    args = train_args(run, data, 1, ZERO1, steps=1)
    with small_filesystem(ckpts, size):
        out = run_cli(args, expect_rc=2)
        path = ckpts / "step-00000001"
        assert (
            f"could not save checkpoint {path}: rank 0: writing zero_to_fp32.py failed ([Errno 28] No space "
            "left on device" in out
        ), out[-3000:]
        taken = re.search(
            r"A checkpoint takes about ([\d.]+) MB \(this save's files\); ([\d.]+) MB are free", out
        )
        assert taken and abs(float(taken.group(1)) - checkpoint_bytes(reference) / 1e6) <= 0.1, out[
            -3000:
        ]
        assert float(taken.group(2)) <= float(taken.group(1))
        assert "the run has none yet: free space, then rerun" in out and "Traceback" not in out
        assert list(ckpts.iterdir()) == []  # neither the step directory nor a partial helper
        resize(ckpts, 4 * size)
        run_cli(args)
        assert (ckpts / "latest").read_text() == "step-00000001" and (
            path / "complete.json"
        ).is_file()
        assert (ckpts / "zero_to_fp32.py").read_bytes() == (
            reference.parent / "zero_to_fp32.py"
        ).read_bytes()


@pytest.mark.multirank
def test_a_save_into_a_read_only_directory_is_named(tmp_path, data):
    # A read-only checkpoints directory (a read-only mount): one message naming the directory that could not be
    # created, why, and the fix (no space to free), none of DeepSpeed's own errors before it.
    ckpts = tmp_path / "run/checkpoints"
    with read_only(ckpts):
        out = run_cli(train_args(tmp_path / "run", data, 1, ZERO1, steps=1), expect_rc=2)
    path = ckpts / "step-00000001"
    assert (
        f"could not save checkpoint {path}: rank 0: creating step-00000001 failed ([Errno 30] Read-only file "
        f"system: '{path}'). Nothing of step-00000001 stays and the run has none yet: make {ckpts} writable, "
        "then rerun to resume (--resume auto)" in out
    ), out[-3000:]
    assert (
        "Failed saving model checkpoint" not in out
        and "zero_to_fp32" not in out
        and "Traceback" not in out
    )
    assert not path.exists()


@pytest.mark.multirank
def test_a_checkpoint_records_its_versions_and_a_resume_under_others_says_so(tmp_path, data):
    # A checkpoint records the versions it was saved under; one saved under other torch and DeepSpeed versions
    # resumes with one line naming them, one saved before versions were recorded resumes without a word.
    run, ckpts = tmp_path / "run", tmp_path / "run/checkpoints"
    args = train_args(run, data, 1, ZERO1, "train.checkpoint_interval=1", steps=3)
    train_run(
        tmp_path,
        data,
        "run",
        1,
        ZERO1,
        "train.checkpoint_interval=1",
        "train.stop_at_step=1",
        steps=3,
    )
    running = {
        "mhf_dist": mhf_dist.__version__,
        "torch": torch.__version__,
        "deepspeed": version("deepspeed"),
    }
    first, second = ckpts / "step-00000001/complete.json", ckpts / "step-00000002/complete.json"
    marker = json.loads(first.read_text())
    assert marker.pop("versions") == running
    first.write_text(json.dumps(marker))  # as saved before versions were recorded
    out = run_cli(args + ["--set", "train.stop_at_step=2"])
    assert "resumed from" in out and "was saved under" not in out

    marker = json.loads(second.read_text())
    assert marker["versions"] == running
    marker["versions"] |= {
        "torch": "2.1.0",
        "deepspeed": "0.14.0",
    }  # as another environment saved it
    second.write_text(json.dumps(marker))
    out = run_cli(args)
    assert (
        out.count(
            f"note: step-00000002 was saved under torch 2.1.0, deepspeed 0.14.0; resuming under torch "
            f"{torch.__version__}, deepspeed {version('deepspeed')}\n"
        )
        == 1
    ), out[-3000:]
    assert f"resumed from {ckpts / 'step-00000002'} at step 2" in out


@pytest.mark.multirank
def test_an_async_save_failing_on_one_rank_fails_on_every_rank(tmp_path, data, monkeypatch):
    # Rank 1's background write of step 2 fails while training goes on: at the next save every rank stops with the
    # same named error, the incomplete step 2 is removed and step 1 stays the newest checkpoint.
    run, ckpts = tmp_path / "run", tmp_path / "run/checkpoints"
    args = train_args(
        run, data, 2, ZERO1, "train.checkpoint_async=true", "train.checkpoint_interval=1", steps=3
    )
    run_cli(args + ["--set", "train.stop_at_step=1"])
    monkeypatch.setenv("MHF_DIST_TEST_SAVE_FAIL_RANK", "1")
    out = run_cli(args, expect_rc=2, timeout=300)
    path = ckpts / "step-00000002"
    assert (
        f"could not save checkpoint {path}: rank 1: writing zero_pp_rank_1_mp_rank_00_optim_states.pt failed "
        "([Errno 28] No space left on device" in out
    )
    # rank 0's message
    assert f"could not save checkpoint {path}: rank 1 could not write its part" in out
    assert f"{ckpts / 'step-00000001'} stays the newest checkpoint" in out
    assert "Traceback" not in out and not path.exists()
    assert metrics(run)[-1]["step"] == 3  # trained on while step 2 was written
    assert (ckpts / "latest").read_text() == "step-00000001" and (
        ckpts / "step-00000001/complete.json"
    ).is_file()


@pytest.mark.multirank
def test_corrupt_or_malformed_checkpoints_are_refused_by_name(tmp_path, data):
    # 4 KB overwritten in the middle of an optimizer shard (same size) must not load (it would train on garbage);
    # a complete.json that is not JSON, or lacks fields, must count as incomplete rather than end in a traceback.
    run, ckpts = tmp_path / "run", tmp_path / "run/checkpoints"
    train_run(tmp_path, data, "run", 1, ZERO1, "train.checkpoint_interval=1", steps=2)
    shard = next((ckpts / "step-00000002").glob("*optim_states.pt"))
    intact = shard.read_bytes()
    _overwrite_middle(shard)
    args = train_args(run, data, 1, ZERO1, steps=4)
    # named: refused, not replaced
    out = run_cli(args + ["--resume", str(shard.parent)], expect_rc=2)
    assert f"checkpoint {shard.parent}: {shard.name} does not match its sha256 digest" in out
    assert (
        f"the newest checkpoint in {ckpts} that verifies is step-00000001: give {ckpts / 'step-00000001'} "
        "instead"
    ) in out
    assert "Traceback" not in out and not (ckpts / "corrupt").exists()
    shard.write_bytes(intact)
    marker = ckpts / "step-00000002/complete.json"
    marker.write_text(json.dumps({"step": 2}))
    out = run_cli(args + ["--resume", str(shard.parent)], expect_rc=2)
    assert (
        f"{shard.parent} is not a complete checkpoint (malformed complete.json: 'tokens' is missing"
        in out
    )
    marker.write_text("{")
    older = ckpts / "step-00000001/complete.json"  # as saved before digests were recorded
    older.write_text(
        json.dumps({k: v for k, v in json.loads(older.read_text()).items() if "digest" not in k})
    )
    out = run_cli(args)  # --resume auto skips step 2 and loads step 1 on sizes alone
    assert f"ignoring incomplete checkpoint {shard.parent} (malformed complete.json:" in out
    assert f"checkpoint {older.parent} has no content digests" in out
    assert f"resumed from {older.parent} at step 1" in out and "Traceback" not in out
    # kept: its files are intact
    assert [p.name for p in (ckpts / "abandoned").glob("*/*")] == ["step-00000002"]


@pytest.mark.multirank
def test_resume_auto_falls_back_past_a_corrupt_checkpoint(tmp_path, data, capsys):
    # The newest checkpoint's shard corrupted in place: --resume auto must continue from the newest one that
    # verifies, with one warning naming the corrupt one, which is moved aside (not deleted); the commands that read
    # a run's newest checkpoint still refuse it, naming the newest one that verifies.
    run, ckpts = tmp_path / "run", tmp_path / "run/checkpoints"
    train_run(tmp_path, data, "run", 1, ZERO1, "train.checkpoint_interval=1", steps=2)
    older, shard = ckpts / "step-00000001", next((ckpts / "step-00000002").glob("*optim_states.pt"))
    corrupt = _overwrite_middle(shard)
    for argv in (
        ["export", str(run), "--out", str(tmp_path / "out")],
        ["export-hf", str(run), str(tmp_path / "hf")],
        ["generate", "--model", str(run), "--prompt", "In the beginning"],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"{shard.name} does not match its sha256 digest" in err, argv
        assert (
            f"the newest checkpoint in {ckpts} that verifies is step-00000001: give {older} instead"
            in err
        ), argv

    args = train_args(run, data, 1, ZERO1, "train.checkpoint_interval=1", steps=3)
    older_shard = next(older.glob("*optim_states.pt"))
    intact = older_shard.read_bytes()
    _overwrite_middle(older_shard)  # no checkpoint verifies: nothing moves, nothing trains
    out = run_cli(args, expect_rc=2)
    assert f"{shard.name} does not match its sha256 digest" in out and "Traceback" not in out
    assert (
        f"no older checkpoint in {ckpts} verifies either: copy the damaged files back intact" in out
    )
    assert (
        not (ckpts / "corrupt").exists()
        and (ckpts / "step-00000002" / shard.name).read_bytes() == corrupt
    )
    older_shard.write_bytes(intact)

    out = run_cli(args)
    (aside,) = (ckpts / "corrupt").iterdir()
    assert out.count(f"{shard.name} does not match its sha256 digest") == 1
    assert (
        f"Moved step-00000002 to {aside}; resuming from {older}, the newest checkpoint that verifies"
    ) in out
    assert f"resumed from {older} at step 1" in out and "Traceback" not in out
    assert (aside / "step-00000002" / shard.name).read_bytes() == corrupt  # kept as it was
    assert sorted(p.name for p in ckpts.glob("step-*")) == [
        "step-00000001",
        "step-00000002",
        "step-00000003",
    ]
    assert (ckpts / "latest").read_text() == "step-00000003"
    assert (
        ckpts / "step-00000002" / shard.name
    ).read_bytes() != corrupt  # saved anew by the resumed run


@pytest.mark.multirank
def test_the_rerun_a_full_disk_message_suggests_succeeds(tmp_path, data, monkeypatch):
    # The disk has room for half a checkpoint more than steps 1 and 2 take: the save of step 3 fails, and the
    # rerun its message suggests (a lower train.keep_checkpoints) must succeed, deleting step 1 before the save.
    run, ckpts = tmp_path / "run", tmp_path / "run/checkpoints"
    train_run(
        tmp_path,
        data,
        "run",
        1,
        ZERO1,
        "train.checkpoint_interval=1",
        "train.stop_at_step=2",
        steps=3,
    )
    used = sum(f.stat().st_size for f in ckpts.rglob("*") if f.is_file())
    monkeypatch.setenv(
        "MHF_DIST_TEST_DISK_BYTES", str(used + checkpoint_bytes(ckpts / "step-00000002") // 2)
    )
    args = train_args(run, data, 1, ZERO1, "train.checkpoint_interval=1", steps=3)
    out = run_cli(args, expect_rc=2)
    assert "No space left on device" in out and "Traceback" not in out
    fix = re.search(
        r"or rerun with --set (train\.keep_checkpoints=\d+) \(older checkpoints are then deleted before "
        r"the save, step-00000002 kept\)",
        out,
    )
    assert fix and fix.group(1) == "train.keep_checkpoints=2", out[-3000:]
    assert sorted(p.name for p in ckpts.glob("step-*")) == ["step-00000001", "step-00000002"]

    out = run_cli(args + ["--set", fix.group(1)])
    assert (
        "deleting step-00000001 before saving step-00000003 to make room (train.keep_checkpoints=2)"
        in out
    )
    assert sorted(p.name for p in ckpts.glob("step-*")) == ["step-00000002", "step-00000003"]
    assert (ckpts / "latest").read_text() == "step-00000003"


def _sized_checkpoint(ckpts: Path, step: int, size: int) -> None:
    """A complete checkpoint of one ``size``-byte file."""
    path = ckpts / f"step-{step:08d}"
    path.mkdir(parents=True)
    (path / "model.pt").write_bytes(b"x" * size)
    (path / "complete.json").write_text(
        json.dumps(
            {
                "step": step,
                "tokens": step,
                "reason": "interval",
                "files": {"model.pt": size},
                "model": {},
                "layout": {"tp": 1, "pp": 1, "dp": 1},
                "signatures_hash": None,
            }
        )
    )


def _rank0_checkpointer(ckpts: Path, keep: int) -> Checkpointer:
    """A Checkpointer's rank-0 side without a process group: what retention before a save reads."""
    checkpointer = object.__new__(Checkpointer)
    checkpointer.dir, checkpointer.deleter = ckpts, BackgroundDeleter(ckpts)
    checkpointer.store = CheckpointStore(ckpts)
    checkpointer.cfg = load_config("tiny-h4b16k", overrides=[f"train.keep_checkpoints={keep}"])
    return checkpointer


def test_retention_before_a_save_deletes_only_what_makes_room(tmp_path, monkeypatch):
    # Room for half a checkpoint: before the save, the oldest checkpoints train.keep_checkpoints lets go are deleted
    # (and waited for) when that makes room, never the newest; when even that would not make room, nothing is.
    ckpts = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        _sized_checkpoint(ckpts, step, 1000)

    def leave_room_for(size: int) -> None:
        used = sum(f.stat().st_size for f in ckpts.rglob("*") if f.is_file())
        monkeypatch.setenv(DISK_BYTES_ENV, str(used + size))

    leave_room_for(500)
    _rank0_checkpointer(ckpts, keep=3)._retire_to_fit(ckpts / "step-00000004")
    assert [p.name for p in complete_checkpoints(ckpts)] == ["step-00000002", "step-00000003"]
    assert not (ckpts / ".deleting").exists()  # deleted, not only moved out of the way
    leave_room_for(500)
    _rank0_checkpointer(ckpts, keep=1)._retire_to_fit(ckpts / "step-00000004")
    assert [p.name for p in complete_checkpoints(ckpts)] == ["step-00000003"]  # the newest stays

    _sized_checkpoint(ckpts, 5, 4000)  # no delete can make room for another of these
    leave_room_for(500)
    checkpointer = _rank0_checkpointer(ckpts, keep=1)
    checkpointer._retire_to_fit(ckpts / "step-00000006")
    assert [p.name for p in complete_checkpoints(ckpts)] == ["step-00000003", "step-00000005"]
    assert checkpointer._space_fix(
        complete_checkpoints(ckpts), free_bytes(ckpts), limited=False
    ) == (
        "free space, then rerun to resume (--resume auto); deleting older checkpoints would not make room "
        "(step-00000005, the newest, is always kept)"
    )


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
    torch.save(
        {"python": RunsCommand(f"touch {witness}"), "numpy": None, "torch": None},
        ckpt / "rng-rank00000.pt",
    )
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
    before = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    try:
        random.seed(1)
        np.random.seed(2)
        torch.manual_seed(3)
        (tmp_path / "rng.safetensors").write_bytes(rng_state_bytes(cuda=False))
        torch.save(
            {
                "python": random.getstate(),
                "numpy": np.random.get_state(),
                "torch": torch.get_rng_state(),
            },
            tmp_path / "rng.pt",
        )  # the format of earlier checkpoints
        expected = _draws()
        for read, name in ((read_rng_state, "rng.safetensors"), (read_legacy_rng_state, "rng.pt")):
            random.seed(9)
            np.random.seed(9)
            torch.manual_seed(9)
            set_rng_state(read(tmp_path / name), cuda=False)
            assert _draws() == expected, name
    finally:
        set_rng_state(before, cuda=False)


def test_a_ranks_report_is_whole_when_it_appears_and_not_opened_again(tmp_path, monkeypatch):
    # an asynchronous save's rank 0 merges a rank's digests report and deletes it as soon as the file appears, while
    # that rank's writer thread may still be at work: the report must be complete then, and never reopened after
    taken = []
    real_replace = os.replace

    def replace_then_taken(src, dst):
        real_replace(src, dst)
        if Path(dst).name.startswith("digests-"):
            taken.append(Path(dst).read_text())
            Path(dst).unlink()

    monkeypatch.setattr(os, "replace", replace_then_taken)
    writer = RecordingWriter(rank=1)
    writer.report(tmp_path / "digests-rank00001.json", json.dumps({"a.pt": "digest"}))
    assert writer.error is None and taken == ['{"a.pt": "digest"}']


def test_a_host_snapshot_saves_the_state_as_it_was_with_shared_storage_kept(tmp_path):
    # an asynchronous save serialises a snapshot after training changed the tensors in place: the file must be the
    # one torch.save wrote at the time of the snapshot, byte for byte (views of one storage saved as one storage)
    weights = torch.randn(64, 8)
    state = {
        "module": {"w": weights, "rows": weights[8:16], "t": weights.t()},
        "step": 3,
        "lr": [1e-3, (0.9, 0.95)],
    }
    (tmp_path / "then").mkdir()
    torch.save(state, tmp_path / "then/states.pt")
    snapshot = HostSnapshot(state)
    weights.mul_(2)
    state["step"], state["lr"][0] = 4, 5e-4
    (tmp_path / "later").mkdir()
    torch.save(snapshot.restore(), tmp_path / "later/states.pt")
    assert (tmp_path / "later/states.pt").read_bytes() == (tmp_path / "then/states.pt").read_bytes()
    restored = snapshot.restore()["module"]
    assert (
        restored["rows"].untyped_storage().data_ptr() == restored["w"].untyped_storage().data_ptr()
    )
