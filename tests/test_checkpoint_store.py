"""Checkpoints in object storage (``train.checkpoint_dir=s3://...``), against a real S3 endpoint on loopback
(moto's server, ``helpers.s3``): a save uploads every rank's files before the marker, a resume on fresh nodes
(the staging directory gone) downloads and verifies the newest complete checkpoint and continues bit for bit, the
tools that read a run's newest checkpoint download it too, a flipped byte in the bucket is caught (and set aside by
``--resume auto``), retention deletes from the bucket, a save whose endpoint is gone fails leaving the previous
checkpoint the newest, ``status`` lists the stored checkpoints, and bad settings or storage are named before
training."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from helpers.runs import CliProcess, metrics, run_cli, train_args, train_run
from helpers.s3 import closed_port, module_endpoint
from mhf_dist.backend.deepspeed.universal import consolidate
from mhf_dist.cli import main
from mhf_dist.config import ConfigError, load_config
from mhf_dist.storage.run_dir import RunDir
from mhf_dist.train.checkpoint.index import CheckpointError
from mhf_dist.train.checkpoint.store import checkpoint_store
from mhf_dist.train.fault_injection import SAVE_PAUSE_ENV

BUCKET = "mhf-ckpt"
ZERO3 = ("parallel.zero_stage=3",)
ASYNC = "train.checkpoint_async=true"
ZERO1 = "parallel.zero_stage=1"


s3 = module_endpoint(BUCKET)  # the endpoint URL of an S3 server holding the empty bucket BUCKET


@pytest.fixture(scope="module")
def bucket(s3):
    import fsspec

    fs = fsspec.filesystem("s3")
    fs.ls(
        BUCKET
    )  # connected now, to the module's endpoint (a test may point the environment elsewhere)
    return fs


def stored(root, name: str) -> tuple[str, ...]:
    return (
        f"train.checkpoint_dir=s3://{BUCKET}/{name}",
        f"train.checkpoint_staging={root / (name + '-staging')}",
    )


@pytest.fixture(scope="module")
def resumed(s3, bucket, data, tmp_path_factory):
    """An uninterrupted 2-rank ZeRO-3 run, and the same run saved to the bucket in the background
    (``train.checkpoint_async``), stopped after step 2, its staging directory deleted (fresh nodes) and resumed
    from the bucket to the end."""
    root = tmp_path_factory.mktemp("stored")
    full = train_run(root, data, "full", 2, *ZERO3, steps=4)
    args = train_args(root / "run", data, 2, *ZERO3, ASYNC, *stored(root, "run"), steps=4)
    args += ["--set", "train.checkpoint_interval=2"]
    run_cli(args + ["--set", "train.stop_at_step=2"])
    bucket.invalidate_cache()
    first = {
        "latest": bucket.cat_file(f"{BUCKET}/run/latest").decode(),
        "marker": bucket.exists(f"{BUCKET}/run/step-00000002/complete.json"),
        "local": list((root / "run").glob("checkpoints/step-*")),
    }
    shutil.rmtree(root / "run-staging")
    out = run_cli(args)
    bucket.invalidate_cache()
    return {"root": root, "full": full, "first": first, "args": args, "out": out}


def full_weights(resumed: dict) -> dict:
    """The uninterrupted run's final weights, merged once for the module."""
    if "weights" not in resumed:
        resumed["weights"] = consolidate(resumed["root"] / "full/checkpoints/step-00000004", False)
    return resumed["weights"]


@pytest.mark.multirank
def test_a_run_resumed_from_the_bucket_on_fresh_nodes_is_bit_identical(resumed, bucket):
    root, first = resumed["root"], resumed["first"]
    assert first == {"latest": "step-00000002", "marker": True, "local": []}
    records = metrics(root / "run")
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]
    assert [r["loss"] for r in records if "loss" in r] == [
        r["loss"] for r in resumed["full"] if "loss" in r
    ]
    assert bucket.cat_file(f"{BUCKET}/run/latest").decode() == "step-00000004"
    assert not bucket.glob(f"{BUCKET}/run/*/report-rank*")  # the ranks' reports, merged and deleted
    saved = f"saved s3://{BUCKET}/run/step-00000004 (end, "
    assert saved in resumed["out"] and " s stall, " in resumed["out"].split(saved)[1]
    ours = consolidate(root / "run-staging/step-00000004", False)
    theirs = full_weights(resumed)
    assert ours.keys() == theirs.keys() and "vocab.tables.weight" in ours
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.multirank
def test_the_tools_read_the_newest_checkpoint_of_the_run_from_the_bucket(resumed, capsys):
    # export, export-hf, eval and generate read a run through trained_weights: on a fresh machine (no staging
    # directory) it downloads the newest complete checkpoint from the bucket and verifies it
    from mhf_dist.train.trained_weights import trained_weights

    root, staging = resumed["root"], resumed["root"] / "run-staging"
    shutil.rmtree(staging, ignore_errors=True)
    tw = trained_weights(root / "run")
    assert f"fetching s3://{BUCKET}/run/step-00000004 into" in capsys.readouterr().err
    assert (tw.step, tw.run.path, tw.checkpoint) == (4, root / "run", staging / "step-00000004")
    theirs = full_weights(resumed)
    assert tw.state.keys() == theirs.keys()
    assert all(torch.equal(tw.state[k], theirs[k]) for k in theirs)
    assert [p.name for p in staging.iterdir()] == ["step-00000004"]  # the newest alone
    files = json.loads((tw.checkpoint / "complete.json").read_text())["files"]
    assert sorted(
        p.relative_to(tw.checkpoint).as_posix() for p in tw.checkpoint.rglob("*") if p.is_file()
    ) == sorted([*files, "complete.json"])
    shutil.rmtree(staging)  # export-hf on another fresh machine
    assert main(["export-hf", str(root / "run"), str(root / "hf")]) == 0
    assert {"config.json", "model.safetensors"} <= {p.name for p in (root / "hf").iterdir()}
    assert (staging / "step-00000004/complete.json").is_file()


@pytest.mark.multirank
def test_status_lists_the_stored_checkpoints(resumed, bucket, capsys):
    bucket.pipe_file(f"{BUCKET}/run/step-00000009/part", b"interrupted")
    try:
        assert main(["status", str(resumed["root"] / "run")]) == 0
    finally:
        bucket.rm(f"{BUCKET}/run/step-00000009", recursive=True)
    out = capsys.readouterr().out
    assert f"s3://{BUCKET}/run" in out
    assert "step-00000002 (complete)" in out and "step-00000004 (complete)" in out
    assert "step-00000009 (incomplete: no complete.json" in out


@pytest.mark.multirank
def test_a_resume_from_config_yaml_is_checked_against_the_stored_checkpoint(resumed):
    from mhf_dist.train.resume import resume_config

    run = resumed["root"] / "run"
    assert resume_config(run, [], "auto").train.checkpoint_dir == f"s3://{BUCKET}/run"
    with pytest.raises(
        ConfigError, match=rf"s3://{BUCKET}/run/step-00000004 was trained with other"
    ):
        resume_config(run, ["model.hash.num_buckets=512"], "auto")


@pytest.mark.multirank
def test_a_flipped_byte_in_the_bucket_is_caught_on_resume(resumed, bucket):
    root = resumed["root"]
    prefix = f"{BUCKET}/run/step-00000004"
    name = max((p for p in bucket.find(prefix) if not p.endswith("complete.json")), key=bucket.size)
    flipped = bytearray(bucket.cat_file(name))
    flipped[len(flipped) // 2] ^= 1
    bucket.pipe_file(name, bytes(flipped))
    shutil.rmtree(root / "run-staging")
    out = run_cli(
        resumed["args"] + ["--resume", f"s3://{prefix}"], expect_rc=2
    )  # named: no fallback
    assert "does not match its sha256 digest" in out and name.rsplit("/", 1)[-1] in out
    assert f"checkpoint s3://{prefix}: " in out
    assert f"give s3://{BUCKET}/run/step-00000002 instead" in out  # the newest that verifies


@pytest.fixture(scope="module")
def kept(s3, bucket, data, tmp_path_factory):
    """A 1-rank run that saved steps 1 to 3 into the bucket, keeping the newest two."""
    root = tmp_path_factory.mktemp("kept")
    args = train_args(root / "run", data, 1, ZERO1, *stored(root, "kept"), steps=3)
    args += ["--set", "train.checkpoint_interval=1", "--set", "train.keep_checkpoints=2"]
    run_cli(args)
    bucket.invalidate_cache()
    return {"root": root, "args": args}


def _listing(bucket, prefix: str) -> list[str]:
    bucket.invalidate_cache()
    return sorted(p.rsplit("/", 1)[-1] for p in bucket.ls(f"{BUCKET}/{prefix}"))


@pytest.mark.multirank
def test_retention_deletes_the_older_checkpoints_from_the_bucket(kept, bucket):
    assert _listing(bucket, "kept") == ["latest", "step-00000002", "step-00000003"]
    assert bucket.cat_file(f"{BUCKET}/kept/latest").decode() == "step-00000003"
    assert bucket.exists(f"{BUCKET}/kept/step-00000002/complete.json")
    assert sorted(p.name for p in (kept["root"] / "kept-staging").glob("step-*")) == [
        "step-00000002",
        "step-00000003",
    ]


@pytest.mark.multirank
def test_resume_auto_sets_a_damaged_checkpoint_in_the_bucket_aside(kept, bucket, capsys):
    # The newest checkpoint's largest file flipped in the bucket, the staging directory gone: the tools that read
    # the run's newest checkpoint refuse it by its URL; --resume auto names it once, moves it to the bucket's
    # corrupt/<time>/ (kept as it was) and continues from the older one.
    root, prefix = kept["root"], f"{BUCKET}/kept/step-00000003"
    name = max((p for p in bucket.find(prefix) if not p.endswith("complete.json")), key=bucket.size)
    flipped = bytearray(bucket.cat_file(name))
    flipped[len(flipped) // 2] ^= 1
    bucket.pipe_file(name, bytes(flipped))
    file = name.removeprefix(f"{prefix}/")
    shutil.rmtree(root / "kept-staging")
    assert main(["export", str(root / "run"), "--out", str(root / "out")]) == 2
    assert f"checkpoint s3://{prefix}: {file} does not match its sha256 digest" in (
        capsys.readouterr().err
    )

    out = run_cli(kept["args"])
    assert out.count(f"{file} does not match its sha256 digest") == 1 and "Traceback" not in out
    older = root / "kept-staging/step-00000002"
    assert f"Moved step-00000003 to {root / 'kept-staging/corrupt'}" in out
    assert f"resuming from {older}, the newest checkpoint that verifies" in out
    assert re.search(r"resumed from \S+/step-00000002 at step 2\n", out)
    (aside,) = bucket.ls(f"{BUCKET}/kept/corrupt")
    assert bucket.cat_file(f"{aside}/step-00000003/{file}") == bytes(flipped)  # kept as it was
    assert _listing(bucket, "kept") == ["corrupt", "latest", "step-00000002", "step-00000003"]
    assert bucket.cat_file(f"{BUCKET}/kept/latest").decode() == "step-00000003"
    assert bucket.cat_file(name) != bytes(flipped)  # saved anew by the resumed run


@pytest.mark.multirank
def test_a_checkpoint_in_the_bucket_resumes_under_another_layout(kept, bucket, data):
    # saved by one rank, resumed by two (dp 2) on fresh nodes: each node downloads it and converts its copy
    root = kept["root"]
    shutil.rmtree(root / "kept-staging", ignore_errors=True)
    uninterrupted = [r["loss"] for r in metrics(root / "run") if "loss" in r][:3]
    args = train_args(root / "run", data, 2, ZERO1, *stored(root, "kept"), steps=3)
    out = run_cli(args + ["--resume", f"s3://{BUCKET}/kept/step-00000002"])
    assert "converted to this layout" in out
    resumed = [r for r in metrics(root / "run") if r.get("step") == 3][-1]
    assert abs(resumed["loss"] - uninterrupted[2]) <= 1e-5 * uninterrupted[2]
    assert (root / "kept-staging/universal/step-00000002").is_dir()


@pytest.mark.multirank
def test_an_upload_whose_endpoint_is_gone_fails_the_run_and_the_previous_checkpoint_stays(
    s3, bucket, data, tmp_path, monkeypatch
):
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()  # the same buckets as the module's server (moto keeps them in this process), another port
    host, port = server.get_host_and_port()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{host}:{port}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore's retries: seconds of backoff
    monkeypatch.setenv(
        SAVE_PAUSE_ENV, "8"
    )  # each background save waits between its files and their upload
    run = tmp_path / "run"
    args = train_args(run, data, 2, *ZERO3, ASYNC, *stored(tmp_path, "lost"), steps=6)
    proc = CliProcess(args + ["--set", "train.checkpoint_interval=2"], tmp_path / "out.log")
    try:
        deadline = time.time() + 300
        while not bucket.exists(f"{BUCKET}/lost/step-00000002/complete.json"):
            assert time.time() < deadline and proc.poll() is None
            time.sleep(0.2)
            bucket.invalidate_cache()
        # step 5 trains while step 4's files wait for their upload
        log = run / "metrics.jsonl"  # a line per step
        while not (log.exists() and len(log.read_text().splitlines()) >= 5):
            assert time.time() < deadline and proc.poll() is None
            time.sleep(0.1)
        assert not bucket.exists(f"{BUCKET}/lost/step-00000004/complete.json")
    finally:
        server.stop()
    rc, out = proc.wait(timeout=300), (tmp_path / "out.log").read_text()
    assert rc == 2, out[-3000:]
    assert f"could not save checkpoint s3://{BUCKET}/lost/step-00000004" in out
    assert "the storage endpoint cannot be reached" in out
    assert "trying again in 1 s (attempt 2 of 3)" in out  # retried before it failed
    assert f"s3://{BUCKET}/lost/step-00000002 stays the newest checkpoint" in out
    bucket.invalidate_cache()
    assert bucket.cat_file(f"{BUCKET}/lost/latest").decode() == "step-00000002"
    assert not bucket.exists(f"{BUCKET}/lost/step-00000004/complete.json")
    # the endpoint back (the module's server holds the same buckets): the rerun resumes and finishes
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3)
    monkeypatch.delenv(SAVE_PAUSE_ENV)
    out = run_cli(args + ["--set", "train.checkpoint_interval=2"])
    assert re.search(r"resumed from \S+/step-00000002 at step 2\n", out)
    bucket.invalidate_cache()
    assert bucket.cat_file(f"{BUCKET}/lost/latest").decode() == "step-00000006"


@pytest.mark.multirank
def test_a_missing_bucket_stops_the_run_before_training(s3, data, tmp_path):
    args = train_args(tmp_path / "run", data, 2, *ZERO3, steps=2)
    args += ["--set", "train.checkpoint_dir=s3://no-such-bucket/run"]
    args += ["--set", f"train.checkpoint_staging={tmp_path / 'staging'}"]
    out = run_cli(args, expect_rc=2)
    assert "s3://no-such-bucket/run: bucket no-such-bucket does not exist" in out
    assert not (tmp_path / "run/metrics.jsonl").exists() or not metrics(tmp_path / "run")


# ------------------------------------------------------------------------------------------ settings and storage
def _config(*overrides: str):
    return load_config("tiny-h4b16k", overrides=list(overrides))


def test_a_url_checkpoint_dir_needs_a_staging_directory():
    with pytest.raises(
        ConfigError, match=r"needs train.checkpoint_staging: a node-local directory"
    ):
        _config(f"train.checkpoint_dir=s3://{BUCKET}/x")


def test_a_relative_checkpoint_dir_and_a_staging_directory_without_a_url_are_refused():
    with pytest.raises(ConfigError, match=r"is a relative path, .* give an absolute one"):
        _config("train.checkpoint_dir=elsewhere")
    with pytest.raises(
        ConfigError, match=r"/elsewhere is written directly: drop train.checkpoint_"
    ):
        _config("train.checkpoint_dir=/elsewhere", "train.checkpoint_staging=/tmp/x")
    with pytest.raises(ConfigError, match=r"train.checkpoint_staging is only used with a URL"):
        _config("train.checkpoint_staging=/tmp/x")


@pytest.mark.multirank
def test_checkpoints_in_another_local_directory_resume_and_are_read_there(data, tmp_path, capsys):
    from mhf_dist.train.trained_weights import trained_weights

    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere" / "r1"
    args = train_args(run, data, 1, ZERO1, f"train.checkpoint_dir={elsewhere}", steps=3)
    run_cli(args + ["--set", "train.stop_at_step=2"])
    assert (elsewhere / "latest").read_text() == "step-00000002"
    assert not (run / "checkpoints").exists()
    out = run_cli(args)
    assert f"resumed from {elsewhere / 'step-00000002'} at step 2" in out
    assert main(["status", str(run)]) == 0
    assert "step-00000003" in capsys.readouterr().out
    trained = trained_weights(run)
    assert trained.checkpoint == elsewhere / "step-00000003" and trained.run.path == run


def test_without_checkpoint_dir_checkpoints_stay_in_the_run_directory(tmp_path):
    store = checkpoint_store(RunDir(tmp_path), _config().train)
    assert store.url is None and store.local == tmp_path / "checkpoints"


def _store(tmp_path, url: str = f"s3://{BUCKET}/x", clear: bool = True):
    if clear:
        import fsspec

        fsspec.filesystem("s3").clear_instance_cache()  # the environment changed
    cfg = _config(f"train.checkpoint_dir={url}", f"train.checkpoint_staging={tmp_path / 's'}")
    return checkpoint_store(RunDir(tmp_path), cfg.train)


def test_storage_that_cannot_be_used_is_named(s3, tmp_path, monkeypatch):
    with pytest.raises(CheckpointError, match=r"bucket no-such-bucket does not exist"):
        _store(tmp_path, "s3://no-such-bucket/x").check()
    with monkeypatch.context() as mp:
        mp.delenv("AWS_ACCESS_KEY_ID")
        mp.delenv("AWS_SECRET_ACCESS_KEY")
        with pytest.raises(CheckpointError, match=r"no credentials for s3://"):
            _store(tmp_path).check()
    with monkeypatch.context() as mp:
        mp.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed_port()}")
        mp.setenv("AWS_MAX_ATTEMPTS", "1")
        with pytest.raises(CheckpointError, match=r"the storage endpoint cannot be reached"):
            _store(tmp_path).check()
    _store(tmp_path).check()  # the endpoint of the module again


def test_without_s3fs_the_error_names_the_extra(tmp_path, monkeypatch):
    import fsspec  # noqa: F401 (loads fsspec.registry, whose name the package's `registry` mapping shadows)

    monkeypatch.delitem(sys.modules["fsspec.registry"]._registry, "s3", raising=False)
    monkeypatch.setitem(sys.modules, "s3fs", None)
    with pytest.raises(CheckpointError, match=r"s3://bucket/x: .*pip install 'mhf-dist\[s3\]'"):
        _store(tmp_path, "s3://bucket/x", clear=False).check()


def test_the_store_uploads_publishes_mirrors_fetches_and_removes(s3, bucket, tmp_path):
    from mhf_dist.train.checkpoint.index import file_digest

    store = _store(tmp_path, f"s3://{BUCKET}/unit")
    step = store.local / "step-00000001"
    (step / "sub").mkdir(parents=True)
    files = {"a.bin": b"first rank", "sub/b.bin": b"second rank"}
    for name, content in files.items():
        (step / name).write_bytes(content)
    assert store.upload(step, sorted(step / n for n in files)) is None
    assert store.listing() == [
        ("step-00000001", "no complete.json: the save was interrupted or failed")
    ]
    marker = {
        "files": {n: len(c) for n, c in files.items()},
        "digests": {n: file_digest(step / n) for n in files},
    }
    (step / "complete.json").write_text(json.dumps(marker))
    store.publish(step)
    assert store.listing() == [("step-00000001", None)]
    assert bucket.cat_file(f"{BUCKET}/unit/latest") == b"step-00000001"
    shutil.rmtree(store.local)
    (store.local / "step-00000007").mkdir(parents=True)  # not in the store: dropped
    store.mirror()
    assert sorted(p.name for p in store.local.iterdir()) == ["latest", "step-00000001"]
    assert [p.name for p in step.iterdir()] == ["complete.json"]
    store.fetch(step, marker)
    assert {n: (step / n).read_bytes() for n in files} == files
    assert store.resolve(f"s3://{BUCKET}/unit/step-00000001") == step
    with pytest.raises(CheckpointError, match="resumes only from this run's train.checkpoint_dir"):
        store.resolve(f"s3://{BUCKET}/other/step-00000001")
    store.remove("step-00000001")
    assert store.listing() == []


def test_a_transfer_that_fails_is_tried_again_and_named(s3, bucket, tmp_path, monkeypatch, caplog):
    import mhf_dist.train.checkpoint.store as store_module

    monkeypatch.setattr(store_module, "RETRY_SECONDS", 0.01)
    store = _store(tmp_path, f"s3://{BUCKET}/flaky")
    step = store.local / "step-00000001"
    step.mkdir(parents=True)
    (step / "a.bin").write_bytes(b"part")
    fs, put, failures = store.fs, store.fs.put_file, []

    def flaky_put(*args, **kwargs):
        if len(failures) < failing:
            failures.append(args)
            raise ConnectionError("connection reset by peer")
        return put(*args, **kwargs)

    monkeypatch.setattr(fs, "put_file", flaky_put)
    failing = 2  # the third attempt goes through
    assert store.upload(step, [step / "a.bin"]) is None
    assert bucket.cat_file(f"{BUCKET}/flaky/step-00000001/a.bin") == b"part"
    assert "uploading a.bin to s3://mhf-ckpt/flaky/step-00000001 failed" in caplog.text
    assert "(attempt 3 of 3)" in caplog.text
    failures.clear()
    failing = 3  # every attempt fails: the last failure is the save's
    error = store.upload(step, [step / "a.bin"])
    assert error.startswith("uploading a.bin to s3://mhf-ckpt/flaky/step-00000001 failed")
    assert "connection reset by peer" in error and len(failures) == 3


def test_an_upload_shows_its_progress_in_the_checkpoint_directory(s3, tmp_path):
    # the hang watch counts a save as progressing while its directory changes, as an upload's chunks go out
    from mhf_dist.train.watchdog import last_change

    store = _store(tmp_path, f"s3://{BUCKET}/progress")
    step = store.local / "step-00000001"
    step.mkdir(parents=True)
    (step / "a.bin").write_bytes(b"written an hour ago")
    for path in (step / "a.bin", step):
        os.utime(path, (time.time() - 3600,) * 2)
    before = time.time()
    assert last_change(step) < before - 3000
    assert store.upload(step, [step / "a.bin"]) is None
    assert last_change(step) >= before - 1


def test_the_other_nodes_staging_directories_follow_rank_0s_line(tmp_path, monkeypatch):
    # on a node of its own (its first rank), after rank 0 saved step 3 and retention dropped step 2, then after a
    # start that continued from step 1 set step 3 aside
    import mhf_dist.train.checkpoint.lineage as lineage
    from mhf_dist.train.checkpoint.index import step_directories

    staging = tmp_path / "staging"
    for step in (1, 2):
        (staging / f"step-{step:08d}").mkdir(parents=True)
        (staging / f"step-{step:08d}/complete.json").write_text(f'{{"step": {step}}}')
    (staging / "step-00000003").mkdir()  # this node's files of the new save, without a marker
    (staging / "step-00000003/part").write_text("rank 2's")
    line = lineage.Lineage()
    line.rank, line.dir, line.store = 2, staging, SimpleNamespace(url="s3://bucket/run")
    monkeypatch.setenv("LOCAL_RANK", "0")

    def share(head, kept):
        def broadcast(objects, src):
            assert src == 0
            objects[:] = [head, head and f'{{"step": {int(head[5:])}}}', kept]

        monkeypatch.setattr(lineage.dist, "broadcast_object_list", broadcast)
        line.share_line()
        return [p.name for p in step_directories(staging)], (staging / "latest").read_text()

    assert share("step-00000003", ["step-00000001", "step-00000003"]) == (
        ["step-00000001", "step-00000003"],
        "step-00000003",
    )
    assert (staging / "step-00000003/complete.json").read_text() == '{"step": 3}'
    assert (staging / "step-00000003/part").read_text() == "rank 2's"
    assert share("step-00000001", ["step-00000001"]) == (["step-00000001"], "step-00000001")
