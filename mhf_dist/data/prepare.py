"""Text files -> WebDataset tar shards of packed token ids, plus ``manifest.json`` (docs/spec.md §7).

Inputs and documents
    ``.txt`` and ``.jsonl`` files, each optionally compressed (``.gz``, or
    ``.zst`` with the ``data`` extra), ``.parquet`` files (the ``data`` extra:
    pyarrow), directories (the files of those types directly in them) and glob
    patterns over them (a directory's files and a glob's matches are taken in
    sorted order; inputs in the order given). In a ``.txt`` file, documents are
    separated by blank lines; in a ``.jsonl`` file every line is one JSON object
    and its ``text_field`` is one document; in a Parquet file each row's
    ``text_field`` column is one, read one row group at a time (a corpus's files
    need not fit in memory). Whitespace-only documents are ignored. A document
    that is not a string (a JSON line that does not parse, a missing field, a
    null or a number) stops the preparation with its file and line or row, or,
    with ``on_bad_document="skip"``, is left out and counted in the manifest
    (``skipped_documents``).

Packing
    Every document is tokenized without special tokens and followed by the
    tokenizer's EOS id. The token stream of a split is cut into consecutive,
    non-overlapping samples of ``seq_len + 1`` ids (a training step uses
    ``sample[:-1]`` as input and ``sample[1:]`` as targets). The trailing partial
    sample (fewer than ``seq_len + 1`` ids) is dropped and counted in the
    manifest as ``dropped_tokens``.

Shard format
    ``{prefix}-000000.tar, ...`` (train) and ``val-000000.tar, ...`` (validation);
    every shard holds ``samples_per_shard`` samples except the last. A sample is
    one tar member ``{key}.tokens.npy``: a 1-D ``.npy`` array of ``seq_len + 1``
    little-endian ids, ``<u2`` when the vocabulary has at most 65,536 entries,
    else ``<u4``. ``key`` is the sample's index within its split, 10 digits.
    Members have mtime 0 and fixed owner and mode, so the same inputs and
    settings give byte-identical shards whatever the number of workers
    (documents are tokenized in parallel but reassembled in input order).
    Workers are spawned processes (safe next to threads, on every platform),
    each loading the tokenizer from its directory.

Validation split
    With ``val_fraction > 0`` a document is held out when the first 8 bytes of
    the BLAKE2b hash of its UTF-8 text, read as a fraction of 2**64, fall below
    ``val_fraction``: the choice depends only on the text (duplicates land in
    the same split) and is packed into separate ``val-*`` shards. The fraction
    of documents held out is therefore approximate.

``manifest.json`` (written last: a directory without one is incomplete)::

    {"format": "mhf-dist-packed-tokens-v1", "seq_len": L, "sample_tokens": L + 1,
     "dtype": "uint16" | "uint32", "vocab_size": V, "eos_id": E,
     "tokenizer_fingerprint": tokens_fingerprint(vocabulary(tokenizer)),
     "sample_member": "tokens.npy", "samples_per_shard": n, "val_fraction": f,
     "text_field": "text", "inputs": [input files], "skipped_documents": n,
     "splits": {"train": SPLIT, "val": SPLIT (only when val_fraction > 0)}}
    SPLIT = {"documents": d, "input_tokens": t (EOS included), "samples": s,
             "tokens": s * (L + 1), "dropped_tokens": t - s * (L + 1),
             "shards": [{"name": "train-000000.tar", "samples": k, "bytes": b,
                         "sha256": hex}, ...]}
"""

from __future__ import annotations

import argparse
import glob
import gzip
import hashlib
import importlib
import io
import json
import multiprocessing
import os
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import webdataset as wds
from tqdm.auto import tqdm

from mhf_dist.errors import MhfError
from mhf_dist.offline_tokenizers import load_tokenizer
from mhf_dist.output_dir import check_target, staged
from mhf_dist.token_list import tokens_fingerprint, vocabulary

FORMAT = "mhf-dist-packed-tokens-v1"
MANIFEST = "manifest.json"
TOKENIZER_DIR = "tokenizer"
SAMPLE_MEMBER = "tokens.npy"
VAL_PREFIX = "val"
_TEXT_SUFFIXES = (".txt", ".jsonl")
_COMPRESSED = (".gz", ".zst")
PARQUET = ".parquet"
ON_BAD_DOCUMENT = ("error", "skip")
DATA_EXTRA = "pip install 'mhf-dist[data]'"
_CHUNK_CHARS = 1 << 16  # text per tokenization task


class DataError(MhfError, ValueError):
    """Input text, shards or a manifest are unusable; the message names the file, the problem and the fix."""


def expand_inputs(patterns: Sequence[str | os.PathLike]) -> list[Path]:
    """Input files in order: each pattern is a file, a directory (its text files, :func:`directory_inputs`) or a
    glob (its matches sorted; directories among them are passed over, the glob names the files it wants)."""
    files: list[Path] = []
    for pattern in map(str, patterns):
        if glob.has_magic(pattern):
            matches = [m for m in map(Path, sorted(glob.glob(pattern, recursive=True))) if not m.is_dir()]
            if not matches:
                raise DataError(f"input {pattern}: the pattern matches no file; check it")
        elif Path(pattern).is_dir():
            matches = directory_inputs(Path(pattern))
        else:
            matches = [Path(pattern)]
        for match in matches:
            if not match.is_file():
                raise DataError(f"input {match}: no such file; check the path")
            if not _readable_kind(match):
                raise DataError(f"input {match}: unsupported file type; use .txt or .jsonl (optionally compressed: "
                                ".gz, .zst) or .parquet")
            files.append(match)
    return files


def _uncompressed_name(path: Path) -> str:
    return path.name.removesuffix(path.suffix) if path.suffix in _COMPRESSED else path.name


def _readable_kind(path: Path) -> bool:
    return path.suffix == PARQUET or _uncompressed_name(path).endswith(_TEXT_SUFFIXES)


def directory_inputs(directory: Path) -> list[Path]:
    """The input files directly in ``directory`` (the kinds :func:`expand_inputs` reads), sorted by name; other
    files and subdirectories are not read."""
    files = sorted(p for p in directory.iterdir() if p.is_file() and _readable_kind(p))
    if not files:
        raise DataError(f"input {directory}: a directory without .txt, .jsonl (optionally compressed) or .parquet "
                        f"files directly in it; name the files, or a glob such as '{directory / '**' / '*.txt'}' "
                        "for subdirectories")
    return files


class BadDocuments:
    """What to do with a document that is not a string (``on_bad_document``), and how many were left out."""

    def __init__(self, action: str = "error"):
        if action not in ON_BAD_DOCUMENT:
            raise DataError(f"on_bad_document={action!r}: use one of {', '.join(ON_BAD_DOCUMENT)}")
        self.action, self.skipped = action, 0

    def found(self, where: str, problem: str, fix: str) -> None:
        """A bad document at ``where``: raised, or counted when skipping."""
        if self.action == "error":
            raise DataError(f"{where}: {problem}; {fix}, or leave such documents out with --on-bad-document skip")
        self.skipped += 1


def _open_text(path: Path):
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    if path.suffix == ".zst":
        return _optional("zstandard", path).open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _optional(module: str, path: Path):
    """A module of the ``data`` extra, or an error naming the input that needs it and the install command."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"input {path} needs {module}, which is not installed: {DATA_EXTRA}") from None


def documents(files: Sequence[Path], text_field: str = "text", bad: BadDocuments | None = None) -> Iterator[str]:
    """Documents of the input files, in order (blank-line separated in .txt, one per line in .jsonl, one per row in
    .parquet); ``bad`` decides about documents that are not strings (default: stop)."""
    bad = bad or BadDocuments()
    for path in files:
        if path.suffix == PARQUET:
            yield from _parquet_documents(path, text_field, bad)
            continue
        try:
            with _open_text(path) as f:
                if _uncompressed_name(path).endswith(".jsonl"):
                    yield from _jsonl_documents(f, path, text_field, bad)
                else:
                    yield from _paragraphs(f)
        except (UnicodeDecodeError, OSError) as e:  # OSError includes a bad gzip stream
            raise DataError(
                f"input {path} is not readable UTF-8 text ({e}); convert or repair it, or leave it out") from None
        except Exception as e:  # zstandard's ZstdError, which is no OSError, for a damaged .zst
            if path.suffix != ".zst" or isinstance(e, DataError):
                raise
            raise DataError(f"input {path} is not a readable zstd stream ({e}); repair it, or leave it out") from None


def _jsonl_documents(lines, path: Path, text_field: str, bad: BadDocuments) -> Iterator[str]:
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            text = json.loads(line)[text_field]
        except (json.JSONDecodeError, TypeError, KeyError) as e:
            bad.found(f"{path}:{number}", f"not a JSON object with a string field {text_field!r} ({e!r})",
                      "fix the line or name the right field with --text-field")
            continue
        if not isinstance(text, str):
            bad.found(f"{path}:{number}", f"field {text_field!r} is not a string",
                      "name the text field with --text-field")
        elif text.strip():
            yield text


def _parquet_documents(path: Path, text_field: str, bad: BadDocuments) -> Iterator[str]:
    """Each row's ``text_field``, one row group at a time."""
    parquet = _optional("pyarrow.parquet", path)
    try:
        table = parquet.ParquetFile(path)
    except Exception as e:  # pyarrow's ArrowInvalid and OSError for a file that is not Parquet, or is truncated
        raise DataError(f"input {path} is not a readable Parquet file ({e}); repair it, or leave it out") from None
    columns = table.schema_arrow.names
    if text_field not in columns:
        raise DataError(f"input {path} has no column {text_field!r} (it has {', '.join(columns)}); name the text "
                        "column with --text-field")
    row = 0
    for group in range(table.num_row_groups):
        for text in table.read_row_group(group, columns=[text_field]).column(0).to_pylist():
            if not isinstance(text, str):
                bad.found(f"{path}: row {row}", f"column {text_field!r} holds {text!r}, not a string",
                          "fix the row or name the text column with --text-field")
            elif text.strip():
                yield text
            row += 1


def _paragraphs(lines) -> Iterator[str]:
    block: list[str] = []
    for line in lines:
        if line.strip():
            block.append(line)
        elif block:
            yield "".join(block).rstrip("\n")
            block = []
    if block:
        yield "".join(block).rstrip("\n")


def _chunks(docs: Iterator[str]) -> Iterator[list[str]]:
    chunk: list[str] = []
    size = 0
    for doc in docs:
        chunk.append(doc)
        size += len(doc)
        if size >= _CHUNK_CHARS:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def is_validation(text: str, val_fraction: float) -> bool:
    """Whether a document belongs to the held-out split (a hash of its text below ``val_fraction``)."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") < val_fraction * 2**64


class _ChunkTokenizer:
    """Texts -> (train ids, val ids, train documents, val documents), EOS after every document."""

    def __init__(self, tokenizer, val_fraction: float):
        self.tokenizer = tokenizer
        self.eos = tokenizer.eos_token_id
        self.val_fraction = val_fraction

    def __call__(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray, int, int]:
        ids = self.tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
        held_out = [is_validation(text, self.val_fraction) for text in texts]
        streams: tuple[list[int], list[int]] = ([], [])
        for val, doc in zip(held_out, ids):
            streams[val].extend(doc)
            streams[val].append(self.eos)
        n_val = sum(held_out)
        return (np.asarray(streams[0], dtype=np.uint32), np.asarray(streams[1], dtype=np.uint32),
                len(texts) - n_val, n_val)


_worker: _ChunkTokenizer | None = None


def _init_worker(tokenizer_path: str, val_fraction: float) -> None:
    global _worker
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    _worker = _ChunkTokenizer(load_tokenizer(tokenizer_path), val_fraction)


def _tokenize_in_worker(texts: list[str]):
    return _worker(texts)


def _tokenized(chunks: Iterator[list[str]], tokenize: _ChunkTokenizer, tokenizer_path: str, workers: int):
    """(chunk size, result) in input order; at most ``2 * workers`` chunks in flight."""
    if workers <= 1:
        for chunk in chunks:
            yield len(chunk), tokenize(chunk)
        return
    spawn = multiprocessing.get_context("spawn")
    with spawn.Pool(workers, _init_worker, (tokenizer_path, tokenize.val_fraction)) as pool:
        pending: deque = deque()
        for chunk in chunks:
            pending.append((len(chunk), pool.apply_async(_tokenize_in_worker, (chunk,))))
            if len(pending) >= 2 * workers:
                n, result = pending.popleft()
                yield n, result.get()
        while pending:
            n, result = pending.popleft()
            yield n, result.get()


class _SplitWriter:
    """Packs one split's token stream into ``seq_len + 1`` samples and writes them into shards."""

    def __init__(self, out_dir: Path, prefix: str, sample_tokens: int, dtype: np.dtype, samples_per_shard: int):
        self.out_dir, self.prefix = out_dir, prefix
        self.sample_tokens, self.dtype, self.samples_per_shard = sample_tokens, dtype, samples_per_shard
        self.rest = np.zeros(0, dtype=np.uint32)
        self.documents = self.input_tokens = self.samples = 0
        self.shards: list[dict] = []
        self.file = self.tar = None
        self.in_shard = 0

    def add(self, ids: np.ndarray, documents: int) -> None:
        self.documents += documents
        self.input_tokens += len(ids)
        stream = np.concatenate([self.rest, ids])
        full = len(stream) // self.sample_tokens * self.sample_tokens
        for sample in stream[:full].reshape(-1, self.sample_tokens):
            self._write(sample)
        self.rest = stream[full:]

    def _write(self, sample: np.ndarray) -> None:
        if self.tar is None:
            self.file = open(self.out_dir / self._name(len(self.shards)), "wb")
            self.tar = wds.TarWriter(self.file, encoder=False, mtime=0, user="mhf-dist", group="mhf-dist")
        buf = io.BytesIO()
        np.save(buf, sample.astype(self.dtype), allow_pickle=False)
        self.tar.write({"__key__": f"{self.samples:010d}", SAMPLE_MEMBER: buf.getvalue()})
        self.samples += 1
        self.in_shard += 1
        if self.in_shard == self.samples_per_shard:
            self._close_shard()

    def _name(self, index: int) -> str:
        return f"{self.prefix}-{index:06d}.tar"

    def _close_shard(self) -> None:
        self.tar.close()
        self.file.close()
        path = self.out_dir / self._name(len(self.shards))
        data = path.read_bytes()
        self.shards.append({"name": path.name, "samples": self.in_shard, "bytes": len(data),
                            "sha256": hashlib.sha256(data).hexdigest()})
        self.file = self.tar = None
        self.in_shard = 0

    def finish(self) -> dict:
        if self.tar is not None:
            self._close_shard()
        tokens = self.samples * self.sample_tokens
        return {"documents": self.documents, "input_tokens": self.input_tokens, "samples": self.samples,
                "tokens": tokens, "dropped_tokens": self.input_tokens - tokens, "shards": self.shards}


def prepare(
    inputs: Sequence[str | os.PathLike],
    tokenizer: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    seq_len: int,
    samples_per_shard: int = 8192,
    prefix: str = "train",
    text_field: str = "text",
    val_fraction: float = 0.0,
    workers: int = 1,
    progress: bool = True,
    on_bad_document: str = "error",
) -> dict:
    """Tokenize ``inputs`` and write packed shards and ``manifest.json`` into ``out_dir``; returns the manifest.

    ``tokenizer`` is a tokenizer directory (or ``mistral-v0.3``, see
    :func:`mhf_dist.offline_tokenizers.load_tokenizer`). ``out_dir`` must be new or empty.
    """
    if seq_len < 1 or samples_per_shard < 1 or workers < 1:
        raise DataError(f"seq_len={seq_len}, samples_per_shard={samples_per_shard} and workers={workers} must be >= 1")
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction={val_fraction} must be in [0, 1)")
    if prefix == VAL_PREFIX or not prefix or "/" in prefix:
        raise DataError(
            f"prefix {prefix!r}: pick a plain name other than {VAL_PREFIX!r} (used by the validation shards)")
    files = expand_inputs(inputs)
    bad = BadDocuments(on_bad_document)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise DataError(f"output directory {out} is not empty; remove it or choose another --out")
    out.mkdir(parents=True, exist_ok=True)

    tok = load_tokenizer(tokenizer)
    if tok.eos_token_id is None:
        raise DataError(f"tokenizer {tokenizer} has no EOS token; documents are separated by EOS, use one that has it")
    vocab_size = len(tok)
    dtype = np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")
    writers = [_SplitWriter(out, prefix, seq_len + 1, dtype, samples_per_shard)]
    if val_fraction > 0:
        writers.append(_SplitWriter(out, VAL_PREFIX, seq_len + 1, dtype, samples_per_shard))

    chunks = _chunks(documents(files, text_field, bad))
    results = _tokenized(chunks, _ChunkTokenizer(tok, val_fraction), str(tokenizer), workers)
    with tqdm(desc="tokenizing", unit="doc", disable=not progress) as bar:
        for n_docs, (train_ids, val_ids, n_train, n_val) in results:
            writers[0].add(train_ids, n_train)
            if val_fraction > 0:
                writers[1].add(val_ids, n_val)
            bar.update(n_docs)
            bar.set_postfix(samples=sum(w.samples for w in writers), refresh=False)
    splits = dict(zip(("train", "val"), (w.finish() for w in writers)))
    for name, split in splits.items():
        if split["samples"] == 0:
            raise DataError(
                f"the {name} split of {', '.join(map(str, files))} has {split['input_tokens']} tokens, fewer than one "
                f"sample of seq_len + 1 = {seq_len + 1}: add text, lower --seq-len"
                + (" or raise --val-fraction" if name == "val" else "")
            )

    tok.save_pretrained(str(out / TOKENIZER_DIR))  # shards carry their tokenizer: a run on them needs no other
    manifest = {
        "format": FORMAT,
        "tokenizer": TOKENIZER_DIR,
        "seq_len": seq_len,
        "sample_tokens": seq_len + 1,
        "dtype": dtype.name,
        "vocab_size": vocab_size,
        "eos_id": tok.eos_token_id,
        "tokenizer_fingerprint": tokens_fingerprint(vocabulary(tok)),
        "sample_member": SAMPLE_MEMBER,
        "samples_per_shard": samples_per_shard,
        "val_fraction": val_fraction,
        "text_field": text_field,
        "inputs": [str(f) for f in files],
        "skipped_documents": bad.skipped,
        "splits": splits,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def run(args: argparse.Namespace) -> int:
    """``mhf-dist prepare-data``: prepare shards into a staging directory, renamed to ``--out`` when complete, and
    print a summary."""
    sources = [*expand_inputs(args.inputs), *([args.tokenizer] if Path(args.tokenizer).exists() else [])]
    out = check_target(args.out, sources, args.overwrite)
    with staged(out) as tmp:
        manifest = prepare(
            args.inputs, args.tokenizer, tmp, seq_len=args.seq_len, samples_per_shard=args.samples_per_shard,
            prefix=args.prefix, text_field=args.text_field, val_fraction=args.val_fraction, workers=args.workers,
            progress=args.progress, on_bad_document=args.on_bad_document,
        )
    for name, split in manifest["splits"].items():
        print(f"{name}: {split['documents']} documents, {split['samples']} samples of {manifest['sample_tokens']} "
              f"tokens in {len(split['shards'])} shards ({split['dropped_tokens']} trailing tokens dropped)")
    if manifest["skipped_documents"]:
        print(f"skipped {manifest['skipped_documents']} documents that were not strings (--on-bad-document skip)")
    print(f"wrote {Path(args.out) / MANIFEST}")
    return 0
