"""Shared fixtures: a small BPE trained on the embedded corpus, tiny model configs."""

from __future__ import annotations

import itertools
import re

import pytest

from helpers import runs
from helpers.global_batch import read_rows
from mhf_dist.cli import main
from mhf_dist.config import load_config
from mhf_dist.vocab.tokenizers import embedded_corpus, load_tokenizer, train_bpe


def pytest_collection_modifyitems(items):
    """The tests marked ``longest`` first (a stable sort: the same order on every worker)."""
    items.sort(key=lambda item: item.get_closest_marker("longest") is None)


@pytest.fixture(scope="session", autouse=True)
def run_cache(tmp_path_factory):
    """Finished training runs, shared by the tests that train the same one (helpers.runs.train_run)."""
    runs.RUN_CACHE = tmp_path_factory.mktemp("run-cache")
    yield runs.RUN_CACHE
    runs.RUN_CACHE = None


@pytest.fixture(autouse=True)
def stop_commands():
    """After each test, whatever command it started and left running (it failed before the command's end)."""
    yield
    while runs.STARTED:
        runs.STARTED.pop().stop()


@pytest.fixture(scope="session")
def bpe_dir(tmp_path_factory):
    """A 1,024-token byte-level BPE trained on the embedded corpus (about a second)."""
    out = tmp_path_factory.mktemp("bpe")
    train_bpe(embedded_corpus(), 1024, out)
    return out


@pytest.fixture(scope="session")
def bpe(bpe_dir):
    return load_tokenizer(bpe_dir)


@pytest.fixture
def tiny_cfg():
    """A tiny MHF model config with small tables, for exact-arithmetic tests."""
    return load_config("tiny-h4b16k", overrides=["model.hash.num_buckets=64"]).model


@pytest.fixture(scope="session")
def data(tmp_path_factory, bpe_dir):
    """Tokenizer and shards (seq_len 64, 5 % validation) of the embedded corpus, for training runs."""
    out = tmp_path_factory.mktemp("shards") / "shards"
    assert (
        main(
            [
                "prepare-data",
                "mhf_dist/data/corpus/kjv.txt.gz",
                "--tokenizer",
                str(bpe_dir),
                "--out",
                str(out),
                "--seq-len",
                "64",
                "--samples-per-shard",
                "32",
                "--val-fraction",
                "0.05",
                "--workers",
                "1",
                "--no-progress",
            ]
        )
        == 0
    )
    return {"tokenizer": bpe_dir, "shards": out}


@pytest.fixture(scope="session")
def trained(tmp_path_factory, data):
    """Single-rank tiny runs trained for 20 steps on the test shards: ``{"mhf": run_dir, "standard": run_dir}``."""
    from helpers.runs import train_run

    root = tmp_path_factory.mktemp("trained")
    train_run(root, data, "mhf", 1, steps=20)
    train_run(root, data, "standard", 1, preset="tiny-standard", steps=20)
    return {"mhf": root / "mhf", "standard": root / "standard"}


@pytest.fixture(scope="session")
def sources(tmp_path_factory, data):
    """Three shard directories of the test tokenizer (64-token samples, each with a validation split), weighted as
    ``helpers.runs.MIXTURE_WEIGHTS``: a mixture's ``data.sources``."""
    from mhf_dist.config import DataSource
    from mhf_dist.data.prepare import prepare

    root, docs = tmp_path_factory.mktemp("mixture"), list(embedded_corpus())
    found = []
    for (name, weight), part in zip(
        runs.MIXTURE_WEIGHTS.items(), (docs[:40], docs[40:80], docs[80:140])
    ):
        (root / f"{name}.txt").write_text("\n\n".join(part) + "\n")
        prepare(
            [root / f"{name}.txt"],
            data["tokenizer"],
            root / name,
            seq_len=64,
            samples_per_shard=32,
            val_fraction=0.2,
            progress=False,
        )
        found.append(DataSource(path=str(root / name), weight=weight))
    return found


@pytest.fixture(scope="session")
def short_documents(tmp_path_factory, data):
    """The embedded text cut into one document per clause (about 20 tokens), prepared as ``data`` is: nearly every row
    of 64 tokens holds several documents, so that masking them changes every step (the chapters of ``data`` end in
    few rows). The masking tests' data: tests/test_engine.py, tests/test_bf16.py."""
    root = tmp_path_factory.mktemp("short-documents")
    chapters = itertools.islice(embedded_corpus(), 100)
    clauses = [s for c in chapters for s in re.split(r"(?<=[.?!:;]) ", c) if s.strip()]
    (root / "clauses.txt").write_text("\n\n".join(clauses))
    shards = root / "shards"
    args = ["prepare-data", str(root / "clauses.txt"), "--tokenizer", str(data["tokenizer"])]
    args += ["--out", str(shards), "--seq-len", "64", "--samples-per-shard", "32"]
    assert main([*args, "--val-fraction", "0.05", "--workers", "1", "--no-progress"]) == 0
    eos = load_tokenizer(data["tokenizer"]).eos_token_id
    rows = [r[:-1] for f in sorted(shards.glob("train-*.tar")) for r in read_rows(f)]
    assert sum(bool((r == eos).any()) for r in rows) > 0.9 * len(rows)  # EOS inside the inputs
    return {"tokenizer": data["tokenizer"], "shards": shards}
