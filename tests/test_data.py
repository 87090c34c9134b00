"""Data layer (docs/spec.md §7): prepare-data shards, and the rank-disjoint, resumable shard reader."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import logging
import os
import pickle
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import time
from collections import Counter
from importlib import resources
from pathlib import Path

import numpy as np
import pytest

from mhf_dist.cli import main
from mhf_dist.config import ConfigError, DataSource, check_data_source, load_config
from mhf_dist.data.formats import DataError
from mhf_dist.data.inputs import documents, expand_inputs
from mhf_dist.data.mixture import BLOCK, MixtureReader, MixtureSchedule, apportion
from mhf_dist.data.parts import merge, part_dir_name, part_files
from mhf_dist.data.prepare import prepare
from mhf_dist.data.reader import ShardReader
from mhf_dist.data.tokenizing import ChunkTokenizer, is_validation
from mhf_dist.vocab.token_list import tokens_fingerprint, vocabulary
from mhf_dist.vocab.tokenizers import embedded_corpus, load_tokenizer, train_bpe

SEQ, PER_SHARD, SEED, WINDOW = 32, 100, 7, 3


@pytest.fixture(scope="module")
def docs():
    return [d.strip() for d in list(embedded_corpus())[:50]]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory, docs):
    return train_bpe(docs, 512, tmp_path_factory.mktemp("bpe"))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, docs):
    """docs[:20] as blank-line separated .txt, docs[20:35] as .jsonl.gz, docs[35:] as .jsonl (field "body")."""
    d = tmp_path_factory.mktemp("text")
    (d / "a.txt").write_text("\n\n\n".join(docs[:20]) + "\n")
    with gzip.open(d / "b.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"body": t, "id": i}) + "\n" for i, t in enumerate(docs[20:35]))
    (d / "c.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in docs[35:]))
    return [str(d / "a.txt"), str(d / "*.jsonl*")]


def _prepare(inputs, tok_dir, out, **kw):
    return prepare(
        inputs,
        tok_dir,
        out,
        seq_len=SEQ,
        samples_per_shard=PER_SHARD,
        text_field="body",
        progress=False,
        **kw,
    )


@pytest.fixture(scope="module")
def shards(tmp_path_factory, inputs, tok_dir):
    out = tmp_path_factory.mktemp("shards") / "out"
    _prepare(inputs, tok_dir, out, workers=1)
    return out


def _tar_samples(path: Path) -> list[np.ndarray]:
    """A shard's samples in file order, read with the standard library only."""
    with tarfile.open(path) as tar:
        return [np.load(io.BytesIO(tar.extractfile(m).read())) for m in tar.getmembers()]


@pytest.fixture(scope="module")
def written(shards):
    """(sample as a tuple, name of its shard) of every train sample, in file order."""
    manifest = json.loads((shards / "manifest.json").read_text())
    return [
        (tuple(s.tolist()), e["name"])
        for e in manifest["splits"]["train"]["shards"]
        for s in _tar_samples(shards / e["name"])
    ]


def _reader(source, rank=0, size=1, **kw):
    return ShardReader(source, seed=SEED, dp_rank=rank, dp_size=size, shuffle_window=WINDOW, **kw)


def _global_stream(source, ranks: int, per_rank: int, micro: int = 1, state=None, **kw):
    """Interleave the ranks' batches back into global order (rank r's k-th sample is position r + k*ranks)."""
    readers = [_reader(source, r, ranks, **kw) for r in range(ranks)]
    if state is not None:
        for reader in readers:
            reader.load_state_dict(json.loads(json.dumps(state)))
    per = [[] for _ in readers]
    for _ in range(per_rank // micro):
        for r, reader in enumerate(readers):
            per[r].extend(tuple(row) for row in reader.next_batch(micro).tolist())
    states = [reader.state_dict() for reader in readers]
    for reader in readers:
        reader.close()
    return [per[k % ranks][k // ranks] for k in range(ranks * len(per[0]))], states


@pytest.fixture(scope="module")
def reference(shards):
    """The single-rank stream over two epochs and a bit: the global order every rank count must reproduce."""
    n = _reader(shards).samples_per_epoch
    return _global_stream(shards, 1, 2 * n + 40)[0]


# ---------------------------------------------------------------- prepare
def test_documents_come_in_input_order(inputs, docs):
    files = expand_inputs(inputs)
    assert [f.name for f in files] == ["a.txt", "b.jsonl.gz", "c.jsonl"]
    assert list(documents(files, "body")) == docs


@pytest.mark.slow
def test_prepare_is_byte_identical_across_runs_and_worker_counts(shards, inputs, tok_dir, tmp_path):
    _prepare(inputs, tok_dir, tmp_path / "again", workers=2)
    names = sorted(str(p.relative_to(shards)) for p in shards.rglob("*") if p.is_file())
    again = sorted(
        str(p.relative_to(tmp_path / "again"))
        for p in (tmp_path / "again").rglob("*")
        if p.is_file()
    )
    assert len(names) > 3 and names == again and "tokenizer/tokenizer.json" in names
    for name in names:
        assert (shards / name).read_bytes() == (tmp_path / "again" / name).read_bytes(), name


GOLDEN = Path(__file__).parent / "golden" / "checkpoint-a105062"  # made by its make.sh


def test_shards_are_byte_for_byte_those_of_an_earlier_preparation(tmp_path):
    """The preparation in tests/golden/checkpoint-a105062/make.sh (the embedded corpus's first 9,000 characters,
    its tokenizer, seq_len 16, 32 samples per shard, 20 % held out) gives its shards again, byte for byte: the tar
    and .npy bytes of the format stay as they were written."""
    text = tmp_path / "text.txt"
    with resources.files("mhf_dist.data").joinpath("corpus/kjv.txt.gz").open("rb") as raw:
        text.write_text(gzip.decompress(raw.read()).decode("utf-8")[:9000])
    manifest = prepare(
        [text],
        GOLDEN / "tokenizer",
        tmp_path / "shards",
        seq_len=16,
        samples_per_shard=32,
        val_fraction=0.2,
        workers=1,
        progress=False,
    )
    golden = json.loads((GOLDEN / "shards" / "manifest.json").read_text())
    assert manifest["splits"] == golden["splits"]
    names = [e["name"] for split in golden["splits"].values() for e in split["shards"]]
    assert len(names) > 3
    for name in names:
        assert (tmp_path / "shards" / name).read_bytes() == (GOLDEN / "shards" / name).read_bytes()


@pytest.mark.parametrize("split_special_tokens", [False, True])
def test_chunks_are_tokenized_as_the_tokenizer_call_tokenizes_each_text(
    tok_dir, split_special_tokens
):
    """A chunk's ids (in this process, and in a worker, which gets the ChunkTokenizer pickled) are each text's
    ``tokenizer(text, add_special_tokens=False)`` ids and the EOS id, for text that spells special tokens too
    (taken as those tokens, or split as text with ``split_special_tokens``)."""
    tok = load_tokenizer(tok_dir)
    tok.split_special_tokens = split_special_tokens
    texts = [
        "In the beginning <|endoftext|> was the word<|pad|>",
        "<|endoftext|>",
        "ünïcödé 😀 日本語のテキスト",
        "  \t spaced\n\n lines  ",
        "x" * 5000,
    ]
    chunk_tokenizer = ChunkTokenizer(tok, 0.0)
    results = [chunk_tokenizer(texts), pickle.loads(pickle.dumps(chunk_tokenizer))(texts)]
    # the Hugging Face call afterwards: it sets up the Rust tokenizer it shares with tok
    expected = [
        t
        for text in texts
        for t in tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ]
    spelled_eos = tok("<|endoftext|>", add_special_tokens=False)["input_ids"]
    assert (spelled_eos == [tok.eos_token_id]) != split_special_tokens
    for train, val, n_train, n_val in results:
        assert train.tolist() == expected and (val.size, n_train, n_val) == (0, len(texts), 0)


def test_a_tokenizer_class_that_rewrites_text_in_its_call_is_called(tok_dir):
    """A tokenizer class whose call changes the text before its Rust tokenizer sees it (as some Hugging Face classes
    do) is called as ``tokenizer(texts, add_special_tokens=False)``, not bypassed."""
    base = type(load_tokenizer(tok_dir))

    class Lowering(base):
        def _encode_plus(self, text, *args, **kwargs):
            return super()._encode_plus([t.lower() for t in text], *args, **kwargs)

    tok = Lowering.from_pretrained(str(tok_dir))
    train, _, _, _ = ChunkTokenizer(tok, 0.0)(["AND GOD SAID"])
    expected = tok(["and god said"], add_special_tokens=False)["input_ids"][0]
    assert train.tolist() == expected + [tok.eos_token_id]


def _packed_per_file(docs, tok, held_out: bool | None = None) -> tuple[list[int], list[int], int]:
    """The tokens that packing each input file of the fixture on its own keeps, in order, the shard sizes and the
    tokens it drops (each file's trailing partial sample); of the documents ``held_out`` (at val_fraction 0.3) or
    not, or of all."""
    kept, shard_sizes, dropped = [], [], 0
    for file_docs in (docs[:20], docs[20:35], docs[35:]):  # a.txt, b.jsonl.gz, c.jsonl
        if held_out is not None:
            file_docs = [d for d in file_docs if is_validation(d, 0.3) == held_out]
        stream = [
            t
            for d in file_docs
            for t in tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ]
        samples = len(stream) // (SEQ + 1)
        kept += stream[: samples * (SEQ + 1)]
        dropped += len(stream) - samples * (SEQ + 1)
        shard_sizes += [PER_SHARD] * (samples // PER_SHARD) + (
            [samples % PER_SHARD] if samples % PER_SHARD else []
        )
    return kept, shard_sizes, dropped


def test_manifest_counts_equal_the_tokens_written(shards, docs, tok_dir):
    manifest = json.loads((shards / "manifest.json").read_text())
    tok = load_tokenizer(tok_dir)
    expected = [
        t for d in docs for t in tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ]
    kept, shard_sizes, dropped = _packed_per_file(docs, tok)
    split = manifest["splits"]["train"]
    written = []
    for entry in split["shards"]:
        data = (shards / entry["name"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == entry["sha256"] and len(data) == entry["bytes"]
        samples = _tar_samples(shards / entry["name"])
        assert len(samples) == entry["samples"] <= PER_SHARD
        assert all(s.dtype == np.dtype("<u2") and s.shape == (SEQ + 1,) for s in samples)
        written.extend(t for s in samples for t in s.tolist())
    assert (
        manifest["seq_len"] == SEQ
        and manifest["dtype"] == "uint16"
        and manifest["vocab_size"] == len(tok)
    )
    assert manifest["tokenizer_fingerprint"] == tokens_fingerprint(vocabulary(tok))
    assert split["documents"] == len(docs) and split["input_tokens"] == len(expected)
    assert split["tokens"] == len(written) == split["samples"] * (SEQ + 1)
    # packed file by file (no sample or shard spans two files), in document order, EOS after each document
    assert written == kept and [e["samples"] for e in split["shards"]] == shard_sizes
    assert split["dropped_tokens"] == len(expected) - len(written) == dropped < 3 * (SEQ + 1)
    assert [e["name"] for e in split["shards"]] == [
        f"train-{i:06d}.tar" for i in range(len(shard_sizes))
    ]
    assert set(manifest["splits"]) == {"train"}


def test_shards_read_with_plain_webdataset_as_docs_data_md_says(shards, val_shards):
    """docs/data.md, "Reading shards without mhf-dist": the manifest's shard names, ``webdataset`` and ``.decode()``
    give every sample as a 1-D array of ``seq_len + 1`` ids of the manifest's dtype, in the shards' order."""
    import webdataset as wds

    for directory, split in ((shards, "train"), (val_shards, "train"), (val_shards, "val")):
        manifest = json.loads((directory / "manifest.json").read_text())
        assert (manifest["sample_member"], manifest["sample_tokens"]) == ("tokens.npy", SEQ + 1)
        urls = [f"{directory}/{shard['name']}" for shard in manifest["splits"][split]["shards"]]
        samples = list(wds.WebDataset(urls, shardshuffle=False).decode())
        assert len(samples) == manifest["splits"][split]["samples"] > 0
        assert [s["__key__"] for s in samples] == [f"{i:010d}" for i in range(len(samples))]
        for sample in samples:
            ids = sample["tokens.npy"]
            assert (
                isinstance(ids, np.ndarray)
                and ids.shape == (SEQ + 1,)
                and ids.dtype == np.dtype(manifest["dtype"])
            )
        # the standard library's reading
        read = [s for url in urls for s in _tar_samples(Path(url))]
        assert [s["tokens.npy"].tolist() for s in samples] == [s.tolist() for s in read]
        # undecoded: the file's bytes
        raw = next(iter(wds.WebDataset(urls[:1], shardshuffle=False)))["tokens.npy"]
        assert np.load(io.BytesIO(raw)).tolist() == read[0].tolist()


@pytest.fixture(scope="module")
def val_shards(tmp_path_factory, inputs, tok_dir):
    """A one-process preparation of the fixture with 30 % of the documents held out."""
    out = tmp_path_factory.mktemp("val_shards") / "out"
    _prepare(inputs, tok_dir, out, workers=1, val_fraction=0.3)
    return out


def test_validation_split_holds_out_documents_by_text_hash(val_shards, tok_dir, docs):
    manifest = json.loads((val_shards / "manifest.json").read_text())
    held_out = [d for d in docs if is_validation(d, 0.3)]
    val, train = manifest["splits"]["val"], manifest["splits"]["train"]
    assert 0 < len(held_out) < len(docs)
    assert val["documents"] == len(held_out) and train["documents"] == len(docs) - len(held_out)
    assert [e["name"] for e in val["shards"]][0] == "val-000000.tar"
    tok = load_tokenizer(tok_dir)
    val_tokens, _, _ = _packed_per_file(docs, tok, held_out=True)
    with _reader(val_shards, split="val") as reader:
        rows = reader.next_batch(val["samples"]).tolist()
    assert sorted(rows) == sorted(np.array(val_tokens).reshape(-1, SEQ + 1).tolist())


# ---------------------------------------------------------------- parts and merge
def _prepare_args(inputs, tok_dir, out, *more):
    return [
        "prepare-data",
        *inputs,
        "--tokenizer",
        str(tok_dir),
        "--out",
        str(out),
        "--seq-len",
        str(SEQ),
        "--samples-per-shard",
        str(PER_SHARD),
        "--text-field",
        "body",
        "--val-fraction",
        "0.3",
        "--workers",
        "1",
        "--no-progress",
        *more,
    ]


@pytest.fixture(scope="module")
def parts(tmp_path_factory, inputs, tok_dir):
    """The fixture prepared as parts 2/2 and 1/2 (in that order, as array tasks may finish), not merged yet."""
    out = tmp_path_factory.mktemp("parts") / "dataset"
    for part in ("2/2", "1/2"):
        assert main(_prepare_args(inputs, tok_dir, out, "--part", part)) == 0
    return out


@pytest.fixture
def unmerged(parts, tmp_path):
    """A fresh copy of the parts."""
    return Path(shutil.copytree(parts, tmp_path / "dataset"))


def _samples_in_shard_order(directory: Path, split: str) -> list[tuple[int, list]]:
    manifest = json.loads((directory / "manifest.json").read_text())
    return [
        (e["samples"], [s.tolist() for s in _tar_samples(directory / e["name"])])
        for e in manifest["splits"][split]["shards"]
    ]


def test_part_files_are_contiguous_runs_of_near_equal_size():
    files = [Path(f"f{i}.txt") for i in range(7)]
    runs = [part_files(files, i, 3) for i in (1, 2, 3)]
    assert [len(r) for r in runs] == [3, 2, 2] and sum(runs, []) == files
    assert part_files(files, 1, 1) == files and part_dir_name(3, 12) == "part-03-of-12"
    with pytest.raises(DataError, match=r"part 4/3: the part number must be in 1..3"):
        part_files(files, 4, 3)
    with pytest.raises(
        DataError, match="the inputs are 7 files, fewer than 8 parts .* use at most 7 parts"
    ):
        part_files(files, 1, 8)


def test_merged_parts_train_as_one_preparation_of_the_same_inputs(unmerged, val_shards, capsys):
    one = json.loads((val_shards / "manifest.json").read_text())
    part_dirs = sorted(unmerged.glob("part-*-of-2"))
    assert [d.name for d in part_dirs] == ["part-1-of-2", "part-2-of-2"]
    assert [json.loads((d / "manifest.json").read_text())["inputs"] for d in part_dirs] == [
        one["inputs"][:2],
        one["inputs"][2:],
    ]  # 3 files: the first part holds the extra one
    capsys.readouterr()
    assert main(["prepare-data", "--merge", str(unmerged), *map(str, reversed(part_dirs))]) == 0
    assert (
        f"merged 2 parts\ntrain: {one['splits']['train']['documents']} documents"
        in capsys.readouterr().out
    )
    merged = json.loads((unmerged / "manifest.json").read_text())
    assert merged["splits"]["train"]["shards"][0]["name"] == "part-1-of-2/train-000000.tar"
    assert merged["parts"] == ["part-1-of-2", "part-2-of-2"] and merged["inputs"] == one["inputs"]
    for split in ("train", "val"):
        assert _samples_in_shard_order(unmerged, split) == _samples_in_shard_order(
            val_shards, split
        )
        counts = ("documents", "input_tokens", "samples", "tokens", "dropped_tokens")
        assert [merged["splits"][split][k] for k in counts] == [
            one["splits"][split][k] for k in counts
        ]
        # the reader's stream into 3 ranks over 1.5 epochs, SHA-256 verified, as over the one preparation
        n = one["splits"][split]["samples"] // 2
        merged_stream, _ = _global_stream(unmerged, 3, n, split=split)
        assert merged_stream == _global_stream(val_shards, 3, n, split=split)[0]
    # shard URLs, matched by name
    urls = [str(unmerged / e["name"]) for e in merged["splits"]["train"]["shards"]]
    with (
        _reader(urls, manifest=unmerged / "manifest.json") as by_url,
        _reader(val_shards) as one_process,
    ):
        assert by_url.next_batch(8).tolist() == one_process.next_batch(8).tolist()
    assert (unmerged / "tokenizer" / "tokenizer.json").read_bytes() == (
        val_shards / "tokenizer" / "tokenizer.json"
    ).read_bytes()


@pytest.mark.parametrize(
    "key, value", [("seq_len", 16), ("dtype", "uint32"), ("tokenizer_fingerprint", "0" * 64)]
)
def test_merge_names_a_part_of_other_settings(unmerged, key, value):
    manifest_path = unmerged / "part-2-of-2" / "manifest.json"
    manifest_path.write_text(json.dumps(json.loads(manifest_path.read_text()) | {key: value}))
    with pytest.raises(
        DataError,
        match=rf"part {unmerged}/part-2-of-2 has {key} '?{value}'?, the other parts .*"
        r"prepare it again with the others'",
    ):
        merge(unmerged, [unmerged / "part-1-of-2", unmerged / "part-2-of-2"])
    assert not (unmerged / "manifest.json").exists() and not (unmerged / "tokenizer").exists()


def test_merge_names_a_missing_repeated_or_unfinished_part(unmerged, tmp_path):
    first, second = unmerged / "part-1-of-2", unmerged / "part-2-of-2"
    with pytest.raises(
        DataError, match=r"part 2 of 2 is missing: prepare it \(prepare-data --part I/2\)"
    ):
        merge(unmerged, [first])
    with pytest.raises(
        DataError, match=rf"{first} and {first} are both part 1/2: pass each part once"
    ):
        merge(unmerged, [first, second, first])
    shutil.copytree(first, unmerged / "copy")
    with pytest.raises(DataError, match=rf"{first} and {unmerged / 'copy'} are both part 1/2"):
        merge(unmerged, [first, unmerged / "copy", second])
    (unmerged / "unfinished").mkdir()
    with pytest.raises(
        DataError, match=r"unfinished has no manifest.json: its preparation did not finish"
    ):
        merge(unmerged, [first, second, unmerged / "unfinished"])
    with pytest.raises(
        DataError, match=rf"part directory {second} is not inside {tmp_path / 'elsewhere'}"
    ):
        merge(tmp_path / "elsewhere", [second])
    shard = (
        second
        / json.loads((second / "manifest.json").read_text())["splits"]["train"]["shards"][-1][
            "name"
        ]
    )
    shard.write_bytes(shard.read_bytes()[:-512])
    with pytest.raises(
        DataError, match=rf"shard {shard} is missing or not \d+ bytes as .* says; prepare that part"
    ):
        merge(unmerged, [first, second])
    assert not (unmerged / "manifest.json").exists()


def test_merge_keeps_an_existing_manifest_unless_told(unmerged, capsys):
    part_dirs = [str(unmerged / "part-1-of-2"), str(unmerged / "part-2-of-2")]
    assert main(["prepare-data", "--merge", str(unmerged), *part_dirs]) == 0
    written = (unmerged / "manifest.json").read_text()
    (unmerged / "manifest.json").write_text("kept")
    assert main(["prepare-data", "--merge", str(unmerged), *part_dirs]) == 2
    assert (
        "already holds a manifest.json or tokenizer/; pass --overwrite" in capsys.readouterr().err
    )
    assert (unmerged / "manifest.json").read_text() == "kept"
    assert main(["prepare-data", "--merge", str(unmerged), *part_dirs, "--overwrite"]) == 0
    assert (unmerged / "manifest.json").read_text() == written
    assert main(["prepare-data", "--merge", str(unmerged), *part_dirs, "--seq-len", "8"]) == 2
    assert "--seq-len belong to preparing the parts: leave them out" in capsys.readouterr().err
    assert main(["prepare-data", part_dirs[0], "--out", str(unmerged / "x")]) == 2
    assert (
        "prepare-data needs --tokenizer, --seq-len (or --merge OUT PART_DIRS..."
        in capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        main(
            [
                "prepare-data",
                part_dirs[0],
                "--part",
                "2",
                "--out",
                "x",
                "--tokenizer",
                "t",
                "--seq-len",
                "8",
            ]
        )
    assert "--part: expected I/N (part I of N, e.g. 3/8), got '2'" in capsys.readouterr().err


def test_prepare_names_bad_inputs(tmp_path, tok_dir, shards):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: .*--text-field"):
        prepare([bad], tok_dir, tmp_path / "o1", seq_len=SEQ, progress=False)
    with pytest.raises(DataError, match="matches no file"):
        prepare(
            [str(tmp_path / "none*.txt")], tok_dir, tmp_path / "o2", seq_len=SEQ, progress=False
        )
    with pytest.raises(DataError, match="not empty"):
        prepare([bad], tok_dir, shards, seq_len=SEQ, progress=False)


def _shard_digests(manifest: dict) -> list[str]:
    return [e["sha256"] for split in manifest["splits"].values() for e in split["shards"]]


def test_parquet_and_zstd_inputs_give_the_shards_of_the_same_documents_in_jsonl(
    inputs, docs, tok_dir, shards, tmp_path
):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    # docs[:20] as .txt.zst, docs[20:35] as a Parquet file of several row groups, docs[35:] as .jsonl.zst
    (tmp_path / "a.txt.zst").write_bytes(
        zstandard.compress(("\n\n\n".join(docs[:20]) + "\n").encode())
    )
    pq.write_table(
        pa.table({"id": list(range(15)), "body": docs[20:35]}),
        tmp_path / "b.parquet",
        row_group_size=4,
    )
    assert pq.ParquetFile(tmp_path / "b.parquet").num_row_groups == 4
    (tmp_path / "c.jsonl.zst").write_bytes(
        zstandard.compress("".join(json.dumps({"body": t}) + "\n" for t in docs[35:]).encode())
    )
    files = [tmp_path / "a.txt.zst", tmp_path / "b.parquet", tmp_path / "c.jsonl.zst"]
    assert list(documents(files, "body")) == docs
    manifest = _prepare([str(f) for f in files], tok_dir, tmp_path / "out", workers=1)
    reference = json.loads((shards / "manifest.json").read_text())
    assert (
        _shard_digests(manifest) == _shard_digests(reference) and manifest["skipped_documents"] == 0
    )


def test_documents_that_are_not_strings_are_named_or_skipped_and_counted(
    docs, tok_dir, tmp_path, capsys
):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table({"text": [docs[0], None, docs[1]]}), tmp_path / "rows.parquet", row_group_size=2
    )
    (tmp_path / "lines.jsonl").write_text(
        f'{json.dumps({"text": docs[2]})}\n{{"text": 7}}\nnot json\n'
    )
    with pytest.raises(
        DataError,
        match=r"rows.parquet: row 1: column 'text' holds None, not a string.*"
        r"--on-bad-document skip",
    ):
        list(documents([tmp_path / "rows.parquet"]))
    with pytest.raises(DataError, match=r"lines.jsonl:2: field 'text' is not a string"):
        list(documents([tmp_path / "lines.jsonl"]))
    with pytest.raises(
        DataError, match=r"has no column 'body' \(it has text\); name the text column"
    ):
        list(documents([tmp_path / "rows.parquet"], "body"))
    assert (
        main(
            [
                "prepare-data",
                str(tmp_path / "rows.parquet"),
                str(tmp_path / "lines.jsonl"),
                "--tokenizer",
                str(tok_dir),
                "--out",
                str(tmp_path / "out"),
                "--seq-len",
                "8",
                "--on-bad-document",
                "skip",
                "--no-progress",
            ]
        )
        == 0
    )
    assert "skipped 3 documents that were not strings" in capsys.readouterr().out
    manifest = json.loads((tmp_path / "out/manifest.json").read_text())
    assert manifest["skipped_documents"] == 3 and manifest["splits"]["train"]["documents"] == 3
    (tmp_path / "broken.jsonl.zst").write_bytes(b"not zstd at all")
    with pytest.raises(DataError, match="broken.jsonl.zst is not a readable zstd stream"):
        list(documents([tmp_path / "broken.jsonl.zst"]))
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 truncated")
    with pytest.raises(DataError, match="broken.parquet is not a readable Parquet file"):
        list(documents([tmp_path / "broken.parquet"]))


def test_inputs_whose_every_document_was_skipped_say_so_and_why(docs, tok_dir, tmp_path, capsys):
    """Not "0 tokens ... add text": the count skipped and the first one's reason, which names the wrong column."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [0, 1, 2], "body": docs[:3]}), tmp_path / "ids.parquet")
    args = [
        "prepare-data",
        str(tmp_path / "ids.parquet"),
        "--tokenizer",
        str(tok_dir),
        "--seq-len",
        "8",
        "--on-bad-document",
        "skip",
        "--no-progress",
    ]
    assert main([*args, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert (
        "every document was skipped (--on-bad-document skip): 3 not text and none kept; the first, "
        f"{tmp_path / 'ids.parquet'}: row 0: column 'text' holds 0, not a string (the column holds int64, not "
        "strings; the file's columns: text, body); fix the row or name the text column with --text-field"
    ) in err
    assert "add text" not in err and not (tmp_path / "out").exists()
    assert main([*args, "--out", str(tmp_path / "body"), "--text-field", "body"]) == 0


def test_a_directory_input_is_its_input_files_in_name_order(inputs, tok_dir, shards, tmp_path):
    """A directory stands for the input files directly in it, sorted: here the same files, in the same
    order, as the `shards` fixture's inputs, so the same shards. Other files and subdirectories are not read, and a
    glob passes over the directories it matches."""
    folder = Path(inputs[0]).parent
    assert expand_inputs([folder]) == [folder / "a.txt", folder / "b.jsonl.gz", folder / "c.jsonl"]
    manifest = _prepare([folder], tok_dir, tmp_path / "out")
    assert manifest["splits"] == json.loads((shards / "manifest.json").read_text())["splits"]

    mixed = tmp_path / "mixed"
    (mixed / "sub").mkdir(parents=True)
    for name in ("b.txt", "a.jsonl", "notes.md", "sub/notes.md"):
        (mixed / name).write_text("text\n")
    assert expand_inputs([mixed]) == [mixed / "a.jsonl", mixed / "b.txt"]
    assert expand_inputs([str(mixed / "[bs]*")]) == [mixed / "b.txt"]
    with pytest.raises(
        DataError,
        match=r"sub: a directory without .txt, .jsonl \(optionally compressed\) or "
        r".parquet files .* a glob such as",
    ):
        expand_inputs([mixed / "sub"])


# ---------------------------------------------------------------- reader: order, ranks, resume
def test_each_epoch_is_a_fresh_permutation_of_all_samples(reference, written):
    n = len(written)
    assert Counter(reference[:n]) == Counter(reference[n : 2 * n]) == Counter(s for s, _ in written)
    assert reference[:n] != reference[n : 2 * n]


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_ranks_read_disjoint_shares_of_one_global_order(shards, reference, written, ranks):
    micro, global_batch = (
        2,
        8,
    )  # accum = 8 / (2 * ranks) micro-batches per step for ranks in (1, 2, 4)
    per_rank = -(-len(written) // global_batch) * global_batch // ranks  # just over one epoch
    stream, states = _global_stream(shards, ranks, per_rank, micro=micro)
    assert stream == reference[: len(stream)]
    # one epoch: every sample once over all ranks
    assert Counter(stream[: len(written)]) == Counter(s for s, _ in written)
    assert all(s == states[0] for s in states)


def test_one_step_over_ranks_is_one_global_batch(shards, reference):
    micro, global_batch, ranks = 2, 8, 2
    readers = [_reader(shards, r, ranks) for r in range(ranks)]
    for step in range(3):
        batch = [
            tuple(row)
            for _ in range(global_batch // (micro * ranks))
            for reader in readers
            for row in reader.next_batch(micro).tolist()
        ]
        assert sorted(batch) == sorted(reference[step * global_batch : (step + 1) * global_batch])
    for reader in readers:
        reader.close()


@pytest.mark.parametrize("consumed", [37, "epoch_end"])
def test_resume_continues_the_uninterrupted_stream(shards, reference, consumed):
    n = _reader(shards).samples_per_epoch
    k = n - 5 if consumed == "epoch_end" else consumed
    first, (state,) = _global_stream(shards, 1, k)
    rest, _ = _global_stream(shards, 1, 60, state=state)
    assert first + rest == reference[: k + 60]


@pytest.mark.parametrize("before,after", [(2, 1), (1, 2), (4, 2)])
def test_resume_with_another_rank_count_loses_and_repeats_nothing(shards, reference, before, after):
    first, states = _global_stream(shards, before, 124 // before, micro=2)
    assert all(s == states[0] for s in states)
    rest, _ = _global_stream(shards, after, 200 // after, micro=2, state=states[0])
    assert first + rest == reference[: len(first) + len(rest)]


def test_reader_state_refuses_another_seed_or_dataset(shards):
    state = _reader(shards).state_dict()
    with pytest.raises(DataError, match="seed"):
        ShardReader(shards, seed=SEED + 1, shuffle_window=WINDOW).load_state_dict(state)
    with pytest.raises(
        DataError, match=r"dataset='0+' .*start this data's order .* --set data\.restart=true"
    ):
        _reader(shards).load_state_dict(state | {"dataset": "0" * 64})
    assert _reader(shards).state_mismatch(state) is None


def test_manifest_mismatches_name_the_manifest_and_the_fix(shards, tok_dir):
    with pytest.raises(
        DataError, match=rf"manifest.json holds samples for seq_len={SEQ} .*--seq-len {SEQ + 1}"
    ):
        _reader(shards, seq_len=SEQ + 1)
    with pytest.raises(DataError, match="another tokenizer"):
        _reader(shards, tokenizer_fingerprint="0" * 64)
    fingerprint = tokens_fingerprint(vocabulary(load_tokenizer(tok_dir)))
    assert _reader(shards, seq_len=SEQ, tokenizer_fingerprint=fingerprint).seq_len == SEQ


def test_pipe_and_brace_urls_read_the_same_stream(shards, reference):
    last = len(json.loads((shards / "manifest.json").read_text())["splits"]["train"]["shards"]) - 1
    urls = f"pipe:cat {shards}/train-{{000000..{last:06d}}}.tar"
    stream, _ = _global_stream(urls, 2, 150, manifest=shards / "manifest.json", allow_pipe=True)
    assert stream == reference[:300]


def test_pipe_urls_run_only_when_allowed(shards, tmp_path, monkeypatch):
    with pytest.raises(DataError, match="runs a shell command; set data.allow_pipe=true"):
        _reader(f"pipe:cat {shards}/train-000000.tar", manifest=shards / "manifest.json")
    # a directory whose relative name reads as a pipe: URL is read as the directory it is; nothing runs
    shutil.copytree(shards, tmp_path / "pipe:touch ran;x")
    monkeypatch.chdir(tmp_path)
    _reader("pipe:touch ran;x").next_batch(2)
    assert not (tmp_path / "ran").exists()


# ---------------------------------------------------------------- reader: bad shards
def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: 512 * 41])  # cut inside the 21st sample's member


def _tamper(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[512 + 128] ^= 1  # first token of the first sample (after its tar and .npy headers)
    path.write_bytes(bytes(data))


@pytest.fixture
def copy(shards, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(shards, out)
    return out


def _read_epoch(source, **kw):
    with _reader(source, **kw) as reader:
        return [
            tuple(row) for row in reader.next_batch(reader.samples_per_epoch).tolist()
        ], reader.skipped_shards


@pytest.mark.parametrize("verify", [True, False])
def test_truncated_shard_is_a_named_error(copy, verify):
    _truncate(copy / "train-000001.tar")
    with pytest.raises(
        DataError, match=r"shard \S*train-000001.tar is unreadable: truncated.*on_bad_shard=skip"
    ):
        _read_epoch(copy, verify_checksums=verify)


def test_tampered_shard_fails_its_checksum(copy):
    _tamper(copy / "train-000002.tar")
    with pytest.raises(
        DataError, match=r"train-000002.tar fails its SHA-256 check against \S*manifest.json"
    ):
        _read_epoch(copy)
    assert len(_read_epoch(copy, verify_checksums=False)[0]) > 0  # only the checksum tells


def test_missing_shard_is_a_named_error(copy):
    (copy / "train-000003.tar").unlink()
    with pytest.raises(DataError, match=r"train-000003.tar is missing .*on_bad_shard=skip"):
        _read_epoch(copy)


# ---------------------------------------------------------------- data that runs read, prepared again
def test_prepare_data_does_not_replace_a_directory_that_runs_read(
    copy, inputs, tok_dir, tmp_path, monkeypatch, capsys
):
    """A run marks the directory it reads; --overwrite is refused while the mark lives, naming the run and the fix; a
    run that starts during the preparation keeps the directory, the new preparation is kept beside it; the mark of
    an exited process or a stale one does not count."""
    import mhf_dist.commands.prepare_data as command
    from mhf_dist.storage.reading_marks import READERS_DIR, mark_reading
    from mhf_dist.storage.run_lock import STALE_S

    run, manifest, host = (
        tmp_path / "run",
        (copy / "manifest.json").read_text(),
        socket.gethostname(),
    )
    args = _prepare_args(inputs, tok_dir, copy, "--samples-per-shard", "60", "--overwrite")
    read = load_config("tiny-h4b16k", overrides=[f"data.path={copy}"]).data
    marks = mark_reading(read, run)  # as a training run's first rank does before it starts
    try:
        assert main(args) == 2
        err = capsys.readouterr().err
        assert (
            f"{copy} is read by 1 training run: run {run.resolve()} (process {os.getpid()} on {host}, "
            "started "
        ) in err, err
        assert (
            "prepare into another directory (--out NEW) and resume them on it with --set data.path=NEW --set "
            "data.restart=true" in err
        )
        assert (copy / "manifest.json").read_text() == manifest and not list(
            tmp_path.glob(".copy.*")
        )
    finally:
        marks.release()
    assert not list((copy / READERS_DIR).iterdir())

    started = []

    def prepare_while_a_run_starts(*a, **kw):
        prepared = prepare(*a, **kw)
        started.append(mark_reading(read, run))
        return prepared

    monkeypatch.setattr(command, "prepare", prepare_while_a_run_starts)
    assert main(args) == 2
    err = capsys.readouterr().err
    started[0].release()
    kept = copy.with_name("copy.new")
    assert (
        f"The new preparation is complete in {kept}: resume those runs on it with --set data.path={kept}"
        in err
    )
    assert (copy / "manifest.json").read_text() == manifest
    assert json.loads((kept / "manifest.json").read_text())["samples_per_shard"] == 60
    monkeypatch.undo()

    exited = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    (copy / READERS_DIR / f"{host}-{exited.stdout.strip()}.json").write_text(
        json.dumps({"run_dir": "exited", "host": host, "pid": int(exited.stdout)})
    )
    elsewhere = copy / READERS_DIR / "elsewhere-1.json"
    elsewhere.write_text(json.dumps({"run_dir": "stale", "host": "elsewhere", "pid": 1}))
    os.utime(elsewhere, (time.time() - STALE_S - 60,) * 2)
    assert main(args) == 0
    assert json.loads((copy / "manifest.json").read_text())["samples_per_shard"] == 60


def test_a_reader_whose_data_was_prepared_again_says_so(copy, inputs, tok_dir):
    """Shards replaced under a reader are no bad shards: the error says the manifest changed, in either mode."""
    readers = [_reader(copy), _reader(copy, on_bad_shard="skip")]
    assert (
        main(_prepare_args(inputs, tok_dir, copy, "--samples-per-shard", "60", "--overwrite")) == 0
    )
    for reader in readers:
        with reader, pytest.raises(DataError) as error:
            reader.next_batch(reader.samples_per_epoch)
        message = str(error.value)
        assert re.match(
            rf"shard \S+ is not the one this run's manifest lists: {re.escape(str(copy))}/manifest.json "
            "changed since the run started reading it, so the data was prepared again",
            message,
        ), message
        assert "--set data.restart=true" in message and "on_bad_shard=skip" not in message
        assert reader.skipped_shards == 0


@pytest.mark.multirank
def test_a_training_run_marks_the_data_it_reads_until_it_ends(tmp_path, data):
    from helpers.runs import CliProcess, train_args
    from mhf_dist.storage.reading_marks import live_readers

    run, output = tmp_path / "run", tmp_path / "output"
    proc = CliProcess(train_args(run, data, 1, steps=1), output)
    seen: list[dict] = []
    while not seen and proc.poll() is None:
        seen = live_readers(data["shards"])
        time.sleep(0.1)
    assert proc.wait(600) == 0, output.read_text()[-3000:]
    assert [(m["run_dir"], m["host"]) for m in seen] == [(str(run.resolve()), socket.gethostname())]
    assert live_readers(data["shards"]) == []


def test_skip_mode_counts_bad_shards_and_keeps_positions(copy, reference, written, caplog):
    n = len(written)
    _truncate(copy / "train-000001.tar")
    _tamper(copy / "train-000002.tar")
    with caplog.at_level(logging.WARNING, logger="mhf_dist.data.reader"):
        stream, skipped = _read_epoch(copy, on_bad_shard="skip")
    assert skipped == 2 and len(stream) == n
    # each bad shard is named (the prefetch thread may already be skipping them again for the next epoch)
    warned = {
        m.group(1)
        for r in caplog.records
        if (m := re.search(r"skipping shard .*?(train-\d+\.tar)", r.message))
    }
    assert warned == {"train-000001.tar", "train-000002.tar"}
    shard_of = dict(written)
    bad = {"train-000001.tar", "train-000002.tar"}
    assert not any(shard_of[s] in bad for s in stream)
    kept = [k for k in range(n) if shard_of[reference[k]] not in bad]
    assert [stream[k] for k in kept] == [reference[k] for k in kept]  # good positions are untouched


# ---------------------------------------------------------------- weighted mixtures
@pytest.fixture(scope="module")
def sources(tmp_path_factory, docs, tok_dir):
    """Three shard directories of one tokenizer and of different sizes, weighted 0.5 / 0.3 / 0.2; a (part of one
    document) is the smallest."""
    root = tmp_path_factory.mktemp("mixture")
    found = []
    for name, part, weight in (
        ("a", [docs[0][:2000]], 0.5),
        ("b", docs[1:4], 0.3),
        ("c", docs[4:8], 0.2),
    ):
        (root / f"{name}.txt").write_text("\n\n".join(part) + "\n")
        prepare(
            [root / f"{name}.txt"],
            tok_dir,
            root / name,
            seq_len=SEQ,
            samples_per_shard=10,
            progress=False,
        )
        found.append(DataSource(path=str(root / name), weight=weight))
    return found


def _mixture_stream(sources, ranks: int, per_rank: int, state=None):
    """Like ``_global_stream``, over a mixture."""
    readers = [
        MixtureReader(sources, seed=SEED, dp_rank=r, dp_size=ranks, shuffle_window=WINDOW)
        for r in range(ranks)
    ]
    if state is not None:
        for reader in readers:
            reader.load_state_dict(json.loads(json.dumps(state)))
    per = [[tuple(row) for row in reader.next_batch(per_rank).tolist()] for reader in readers]
    states = [reader.state_dict() for reader in readers]
    for reader in readers:
        reader.close()
    return [per[k % ranks][k // ranks] for k in range(ranks * per_rank)], states


def test_every_mixture_block_holds_each_source_at_its_weight():
    schedule = MixtureSchedule([0.5, 0.3, 0.2], seed=SEED)
    assert schedule.counts.tolist() == [2048, 1229, 819] and schedule.counts.sum() == BLOCK
    for b in range(3):
        source, occurrence = schedule.block(b)
        assert np.bincount(source).tolist() == schedule.counts.tolist()
        assert all(
            sorted(occurrence[source == k]) == list(range(c)) for k, c in enumerate(schedule.counts)
        )
    # each block in its own order
    assert not np.array_equal(schedule.block(0)[0], schedule.block(1)[0])
    assert apportion([1.0, 1e-9], BLOCK).tolist() == [4095, 1]  # every source is read


def test_a_mixture_reads_each_source_in_its_own_order(sources):
    stream, _ = _mixture_stream(sources, 1, 300)
    schedule = MixtureSchedule([s.weight for s in sources], seed=SEED)
    ((source, position),) = [next(schedule.positions(0, 0, 1))]
    for k, s in enumerate(sources):
        own = _global_stream(s.path, 1, int((source[:300] == k).sum()))[0]
        assert [row for row, kk in zip(stream, source[:300]) if kk == k] == own
        assert position[:300][source[:300] == k].tolist() == list(range(len(own)))
    smallest = ShardReader(sources[0].path, seed=SEED).samples_per_epoch
    assert (source[:300] == 0).sum() > smallest  # source a is smaller than its share: it repeats


def test_a_mixture_resumes_at_every_sources_next_sample_on_any_dp(sources):
    reference, _ = _mixture_stream(sources, 1, 144)
    first, states = _mixture_stream(sources, 1, 48)
    second, states2 = _mixture_stream(sources, 2, 24, states[0])
    assert states2[0] == states2[1] and states2[0]["mixture_position"] == 96
    third, _ = _mixture_stream(sources, 4, 12, states2[0])
    assert first + second + third == reference
    with MixtureReader(sources, seed=SEED, shuffle_window=WINDOW) as reader:
        reader.load_state_dict(states2[0])
        consumed = reader.consumed()
    schedule = MixtureSchedule([s.weight for s in sources], seed=SEED)
    assert list(consumed.values()) == np.bincount(schedule.block(0)[0][:96], minlength=3).tolist()
    assert list(consumed) == ["a", "b", "c"]


def test_a_mixture_refuses_another_mixture_state_and_names_a_source_of_another_tokenizer(
    sources, tmp_path, tok_dir
):
    _, states = _mixture_stream(sources, 1, 4)
    reweighted = [sources[0].model_copy(update={"weight": 0.9}), *sources[1:]]
    with (
        MixtureReader(reweighted, seed=SEED) as reader,
        pytest.raises(DataError, match="data.restart=true"),
    ):
        reader.load_state_dict(states[0])
    fingerprint = ShardReader(sources[0].path).manifest["tokenizer_fingerprint"]
    other = train_bpe(list(embedded_corpus())[:20], 300, tmp_path / "bpe")
    (tmp_path / "d.txt").write_text("\n\n".join(list(embedded_corpus())[:10]))
    prepare([tmp_path / "d.txt"], other, tmp_path / "d", seq_len=SEQ, progress=False)
    odd = [*sources, DataSource(path=str(tmp_path / "d"), weight=1.0)]
    with pytest.raises(DataError, match=rf"{tmp_path / 'd'}.* was tokenized by another tokenizer"):
        MixtureReader(odd, tokenizer_fingerprint=fingerprint)


def test_a_blend_string_is_read_into_sources():
    cfg = load_config("tiny-h4b16k", overrides=["data.path=0.7 shards/a 0.3 shards/b"])
    assert cfg.data.path is None and [(s.path, s.weight, s.label) for s in cfg.data.sources] == [
        ("shards/a", 0.7, "a"),
        ("shards/b", 0.3, "b"),
    ]
    with pytest.raises(ConfigError, match="a blend is pairs of weight and directory"):
        load_config("tiny-h4b16k", overrides=["data.path=0.7 shards/a 0.3"])
    with pytest.raises(ConfigError, match="the same name twice"):
        load_config("tiny-h4b16k", overrides=["data.path=0.7 x/a 0.3 y/a"])


# ---------------------------------------------------------------- object storage (fsspec)
@pytest.fixture
def in_memory(shards):
    """The test shards copied to fsspec's in-memory filesystem (as they would lie in a bucket)."""
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.put(str(shards), "/bucket/shards", recursive=True)
    yield fs
    fs.rm("/bucket", recursive=True)


def test_shards_in_object_storage_read_and_resume_as_local_ones(in_memory, shards, reference):
    remote = "memory://bucket/shards"
    assert _global_stream(remote, 2, 60)[0] == reference[:120]
    # read remotely, resumed from local files and back: one stream
    _, states = _global_stream(remote, 2, 30)
    local, states = _global_stream(shards, 1, 40, state=states[0])
    assert local == reference[60:100]
    assert _global_stream(remote, 4, 5, state=states[0])[0] == reference[100:120]


def test_a_changed_shard_in_object_storage_fails_its_checksum(in_memory, shards):
    name = json.loads((shards / "manifest.json").read_text())["splits"]["train"]["shards"][0][
        "name"
    ]
    data = bytearray(in_memory.cat(f"/bucket/shards/{name}"))
    data[-2000] ^= 1
    in_memory.pipe(f"/bucket/shards/{name}", bytes(data))
    with pytest.raises(DataError, match=rf"memory://bucket/shards/{name} fails its SHA-256 check"):
        # every shard once
        _global_stream("memory://bucket/shards", 1, _reader(shards).samples_per_epoch)


def test_a_storage_scheme_without_its_package_is_named(monkeypatch):
    import fsspec  # noqa: F401 (loads fsspec.registry, whose name the package's `registry` mapping shadows)

    # a scheme fsspec knows whose package is not installed, as s3:// is without s3fs
    monkeypatch.setitem(
        sys.modules["fsspec.registry"].known_implementations,
        "bucketfs",
        {
            "class": "bucketfs_not_installed.BucketFileSystem",
            "err": "Install bucketfs for bucketfs://",
        },
    )
    with pytest.raises(
        DataError,
        match=r"bucketfs://shards/manifest.json: reading bucketfs:// needs a package that "
        r"is not installed \(Install bucketfs for bucketfs://\)",
    ):
        ShardReader("bucketfs://shards")
    with pytest.raises(
        ConfigError, match="is a URL, whose tokenizer/ a run does not load: set tokenizer.path"
    ):
        check_data_source(
            load_config(
                "1b-h4b16k", overrides=["data.path=s3://bucket/shards", "tokenizer.path=null"]
            )
        )
