"""Shards in object storage, through the S3 protocol of a real endpoint on loopback (moto's server,
``helpers.s3``): prepared into a bucket, trained from as from local shards, checked byte for byte, and each failure
to reach them (credentials, bucket, access, endpoint, package) named at the start."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.runs import metrics, run_cli, train_args, train_run
from helpers.s3 import closed_port, module_endpoint
from mhf_dist.cli import main
from mhf_dist.data.formats import DataError
from mhf_dist.data.locations import open_url
from mhf_dist.data.reader import ShardReader

BUCKET = "mhf-test"
REPO = Path(__file__).resolve().parents[1]
SHARDS = f"s3://{BUCKET}/shards"


s3 = module_endpoint(BUCKET)  # the endpoint URL of an S3 server holding the empty bucket BUCKET


@pytest.fixture(scope="module")
def bucket_fs(s3):
    import fsspec

    return fsspec.filesystem("s3")


@pytest.fixture(scope="module")
def uploaded(s3, data, bucket_fs):
    """``prepare-data --out s3://BUCKET/shards``, with the arguments of the local test shards (``data``)."""
    args = ["mhf_dist/data/corpus/kjv.txt.gz", "--tokenizer", str(data["tokenizer"])]
    args += ["--seq-len", "64", "--samples-per-shard", "32", "--val-fraction", "0.05"]
    assert main(["prepare-data", *args, "--out", SHARDS, "--workers", "1", "--no-progress"]) == 0
    bucket_fs.invalidate_cache()
    return SHARDS


def _objects(fs, url: str) -> dict[str, bytes]:
    root = url.removeprefix("s3://")
    return {p.removeprefix(root + "/"): fs.cat_file(p) for p in fs.find(root)}


def test_prepared_into_a_bucket_the_shards_are_the_local_ones(uploaded, data, bucket_fs):
    local = {
        p.relative_to(data["shards"]).as_posix(): p.read_bytes()
        for p in data["shards"].rglob("*")
        if p.is_file() and ".readers" not in p.parts
    }
    assert _objects(bucket_fs, uploaded) == local


def test_preparing_into_a_bucket_that_holds_data_is_refused(uploaded, data, capsys):
    args = ["mhf_dist/data/corpus/kjv.txt.gz", "--tokenizer", str(data["tokenizer"])]
    assert main(["prepare-data", *args, "--out", uploaded, "--seq-len", "64"]) == 2
    assert f"{uploaded} already holds prepared data (manifest.json); pass --overwrite" in (
        capsys.readouterr().err
    )


@pytest.mark.multirank
def test_training_from_the_bucket_gives_the_losses_of_the_local_copy(uploaded, data, tmp_path):
    local = train_run(tmp_path, data, "local", 1)
    run_cli(train_args(tmp_path / "s3", {**data, "shards": uploaded}, 1))
    remote = metrics(tmp_path / "s3")
    assert [r["loss"] for r in remote if "loss" in r] == [r["loss"] for r in local if "loss" in r]
    assert any("loss" in r for r in local)


def test_a_flipped_byte_in_an_uploaded_shard_fails_its_checksum(s3, data, bucket_fs):
    url = f"s3://{BUCKET}/flipped"
    bucket_fs.put(str(data["shards"]), url.removeprefix("s3://"), recursive=True)
    manifest = json.loads((data["shards"] / "manifest.json").read_text())
    name = manifest["splits"]["train"]["shards"][0]["name"]
    path = f"{BUCKET}/flipped/{name}"
    flipped = bytearray(bucket_fs.cat_file(path))
    flipped[-2000] ^= 1
    bucket_fs.pipe_file(path, bytes(flipped))
    reader = ShardReader(url, shuffle_window=1)
    samples = sum(s["samples"] for s in manifest["splits"]["train"]["shards"])
    with pytest.raises(DataError, match=rf"shard {url}/{name} fails its SHA-256 check"):
        reader.next_rows(samples)
    reader.close()


def test_parts_prepared_into_a_bucket_merge_there_as_they_do_on_disk(
    s3, data, bucket_fs, tmp_path, capsys
):
    """``prepare-data --part I/N --out URL`` then ``--merge URL``: the bucket holds what the same steps leave on
    disk, object for object, and its merged manifest reads (SHA-256 checked) as the local one; merging again is
    refused without --overwrite, and a part's missing shard is named."""
    with open_url("mhf_dist/data/corpus/kjv.txt.gz") as raw:
        documents = gzip.decompress(raw.read()).decode("utf-8").split("\n\n")[:600]
    texts = [tmp_path / "a.txt", tmp_path / "b.txt"]
    texts[0].write_text("\n\n".join(documents[:300]))
    texts[1].write_text("\n\n".join(documents[300:]))
    common = [*map(str, texts), "--tokenizer", str(data["tokenizer"]), "--seq-len", "64"]
    common += ["--samples-per-shard", "16", "--workers", "1", "--no-progress"]
    url, local = f"s3://{BUCKET}/parts", tmp_path / "local"
    for part in ("2/2", "1/2"):  # in the order array tasks may finish
        for out in (url, str(local)):
            assert main(["prepare-data", *common, "--part", part, "--out", out]) == 0
    part_urls = [f"{url}/part-{i}-of-2" for i in (2, 1)]
    assert main(["prepare-data", "--merge", url, *part_urls]) == 0
    assert f"wrote {url}/manifest.json" in capsys.readouterr().out
    assert main(["prepare-data", "--merge", str(local), *map(str, local.glob("part-*"))]) == 0
    bucket_fs.invalidate_cache()
    on_disk = {
        p.relative_to(local).as_posix(): p.read_bytes()
        for p in local.rglob("*")
        if p.is_file() and ".readers" not in p.parts
    }
    assert _objects(bucket_fs, url) == on_disk
    assert len(json.loads(on_disk["manifest.json"])["splits"]["train"]["shards"]) > 2
    remote, here = ShardReader(url, shuffle_window=1), ShardReader(str(local), shuffle_window=1)
    assert [r.tolist() for r in remote.next_rows(40)] == [r.tolist() for r in here.next_rows(40)]
    remote.close(), here.close()

    assert main(["prepare-data", "--merge", url, *part_urls]) == 2
    assert f"{url} already holds a manifest.json or tokenizer/; pass --overwrite" in (
        capsys.readouterr().err
    )
    bucket_fs.rm_file(f"{BUCKET}/parts/part-2-of-2/train-000000.tar")
    assert main(["prepare-data", "--merge", url, *part_urls, "--overwrite"]) == 2
    assert f"shard {url}/part-2-of-2/train-000000.tar is missing" in capsys.readouterr().err
    assert main(["prepare-data", "--merge", url, f"s3://{BUCKET}/elsewhere/part-1-of-2"]) == 2
    assert "is not inside" in capsys.readouterr().err


def test_submit_data_prepares_and_merges_into_a_bucket(s3, data, bucket_fs, tmp_path, capsys):
    """``submit-data --out s3://...``: its array tasks' and merge's scripts, run as SLURM would run them (srun
    running the command as it is), leave a merged dataset in the bucket; the logs go to ``--jobs-dir``, which such
    an ``--out`` needs."""
    from mhf_dist.cluster.profile import load_profile
    from mhf_dist.cluster.submit import render_data

    for k in range(2):
        (tmp_path / f"{k}.txt").write_text(f"document {k} " * 200 + "\n\nanother one\n")
    url = f"s3://{BUCKET}/submitted"
    args = ["submit-data", str(tmp_path / "*.txt"), "--tokenizer", str(data["tokenizer"])]
    args += ["--out", url, "--seq-len", "16", "--parts", "2", "--cluster", "cpu-local", "--dry-run"]
    assert main(args) == 2
    assert "pass --jobs-dir DIR, a directory every node sees" in capsys.readouterr().err
    jobs = tmp_path / "jobs"
    scripts = render_data(
        load_profile("cpu-local"),
        [str(tmp_path / "*.txt")],
        tokenizer=str(data["tokenizer"]),
        out=url,
        parts=2,
        options=["--seq-len", "16", "--samples-per-shard", "4"],
        workers=1,
        python=sys.executable,
        jobs_dir=jobs,
    )
    assert f"#SBATCH --chdir={jobs}" in scripts[0] and f"--out {url} " in scripts[0]
    assert f"--merge {url} {url}/part-1-of-2 {url}/part-2-of-2" in scripts[1]
    srun = tmp_path / "bin" / "srun"
    srun.parent.mkdir()
    srun.write_text('#!/bin/sh\nwhile [ "${1#-}" != "$1" ]; do shift; done\nexec "$@"\n')
    srun.chmod(0o755)
    env = os.environ | {"PATH": f"{srun.parent}:{os.environ['PATH']}", "PYTHONPATH": str(REPO)}
    jobs.mkdir()
    for script, task in ((scripts[0], "2"), (scripts[0], "1"), (scripts[1], None)):
        task_env = env | ({"SLURM_ARRAY_TASK_ID": task} if task else {})
        proc = subprocess.run(
            ["bash", "-c", script], env=task_env, cwd=jobs, capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
    bucket_fs.invalidate_cache()
    merged = json.loads(bucket_fs.cat_file(f"{BUCKET}/submitted/manifest.json"))
    assert merged["parts"] == ["part-1-of-2", "part-2-of-2"] and len(merged["inputs"]) == 2
    assert bucket_fs.exists(f"{BUCKET}/submitted/tokenizer/tokenizer.json")


def test_a_bucket_that_does_not_exist_is_named(s3, capsys):
    with pytest.raises(DataError, match=r"s3://no-such-bucket/shards/manifest.json: bucket "):
        ShardReader("s3://no-such-bucket/shards")
    args = ["x.txt", "--tokenizer", "t", "--seq-len", "8", "--out", "s3://no-such-bucket/x"]
    assert main(["prepare-data", *args]) == 2
    assert "bucket no-such-bucket does not exist" in capsys.readouterr().err


def test_access_denied_is_named(uploaded, monkeypatch):
    import moto.settings

    monkeypatch.setattr(
        moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0
    )  # the server checks keys: ours is unknown
    with pytest.raises(
        DataError, match=rf"{uploaded}/manifest.json: access denied .*AWS_ACCESS_KEY_ID"
    ):
        ShardReader(uploaded)


def _train_fails(tmp_path, data, url: str) -> str:
    out = run_cli(train_args(tmp_path / "run", {**data, "shards": url}, 1), expect_rc=2)
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not metrics(tmp_path / "run")
    return out


@pytest.mark.multirank
def test_training_without_credentials_stops_at_the_start_naming_them(
    uploaded, data, tmp_path, monkeypatch
):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    out = _train_fails(tmp_path, data, uploaded)
    assert f"{uploaded}/manifest.json: no credentials for s3://" in out
    assert "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE" in out


@pytest.mark.multirank
def test_training_from_an_unreachable_endpoint_stops_at_the_start(
    uploaded, data, tmp_path, monkeypatch
):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore's retries: seconds of backoff
    out = _train_fails(tmp_path, data, uploaded)
    assert f"{uploaded}/manifest.json: the storage endpoint cannot be reached" in out


def test_without_s3fs_the_error_names_the_extra(monkeypatch):
    import fsspec  # noqa: F401 (loads fsspec.registry, whose name the package's `registry` mapping shadows)

    monkeypatch.delitem(sys.modules["fsspec.registry"]._registry, "s3", raising=False)
    monkeypatch.setitem(sys.modules, "s3fs", None)
    with pytest.raises(
        DataError, match=r"s3://bucket/x: reading s3:// needs .*pip install 'mhf-dist\[s3\]'"
    ):
        open_url("s3://bucket/x")
