"""Text files -> WebDataset tar shards of packed token ids, plus ``manifest.json``.

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
    tokenizer's EOS id. Each input file's token stream (per split) is cut into
    consecutive, non-overlapping samples of ``seq_len + 1`` ids (a training step
    uses ``sample[:-1]`` as input and ``sample[1:]`` as targets). A file's
    trailing partial sample (fewer than ``seq_len + 1`` ids) is dropped and
    counted in the manifest as ``dropped_tokens``, and its last shard is closed:
    no sample or shard spans two files. A file is thus the unit of preparation,
    and the shards of a list of files are the shards of each file in turn, which
    is what lets parts of the list be prepared apart and merged (below). A corpus
    of many files much smaller than a shard (``samples_per_shard * (seq_len + 1)``
    tokens) gives as many short shards: concatenate such files first.

Shard format
    ``{prefix}-000000.tar, ...`` (train) and ``val-000000.tar, ...`` (validation),
    numbered on across the input files; every shard holds ``samples_per_shard``
    samples except the last of each file. A sample is
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

Parts and merging (one preparation spread over many machines)
    ``part=(I, N)`` (``--part I/N``, 1-based: a SLURM array ``--array=1-N``
    passes ``$SLURM_ARRAY_TASK_ID`` as ``I``) prepares the I-th of N contiguous
    runs of the expanded input list, of ``len // N`` or ``len // N + 1`` files
    each (the first ``len % N`` runs have the extra file). Its manifest is an
    ordinary one over its own files (its ``inputs``) plus ``"part": {"index": I,
    "count": N, "inputs_sha256": SHA-256 of the whole list}``; a split of a part
    may be empty. :func:`merge` writes ``manifest.json`` and ``tokenizer/`` of
    the whole into a directory holding the parts (``prepare-data --part`` writes
    part I into ``OUT/part-I-of-N``), without copying a shard: each shard entry
    of the parts, in part order, named by its path under that directory
    (``part-1-of-4/train-000000.tar``), with its size and SHA-256. As a file is
    the unit of packing, the merged shards hold the samples of a one-process
    preparation of the same inputs and settings, shard for shard in the same
    order; so :class:`mhf_dist.data.reader.ShardReader` yields the same sample
    stream over either (its resume state names the shards, so a run resumes on
    the directory it started with). Only the shard names, the sample keys (the
    index within the part's split) and so the SHA-256 sums differ. Parts of
    another tokenizer, ``seq_len``, dtype or setting, of another input list or
    part count, and a missing or repeated part are refused, naming it.

``manifest.json`` (written last: a directory without one is incomplete)::

    {"format": "mhf-dist-packed-tokens-v1", "seq_len": L, "sample_tokens": L + 1,
     "dtype": "uint16" | "uint32", "vocab_size": V, "eos_id": E,
     "tokenizer_fingerprint": tokens_fingerprint(vocabulary(tokenizer)),
     "sample_member": "tokens.npy", "samples_per_shard": n, "val_fraction": f,
     "text_field": "text", "inputs": [input files], "skipped_documents": n,
     "splits": {"train": SPLIT, "val": SPLIT (only when val_fraction > 0)},
     "part": {...} (a part only), "parts": ["part-1-of-N", ...] (a merge only)}
    SPLIT = {"documents": d, "input_tokens": t (EOS included), "samples": s,
             "tokens": s * (L + 1), "dropped_tokens": t - s * (L + 1),
             "shards": [{"name": "train-000000.tar", "samples": k, "bytes": b,
                         "sha256": hex}, ...]}
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import importlib
import io
import json
import multiprocessing
import os
import shutil
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import webdataset as wds
from tqdm.auto import tqdm

from mhf_dist.errors import MhfError
from mhf_dist.vocab.token_list import tokens_fingerprint, vocabulary
from mhf_dist.vocab.tokenizers import load_tokenizer

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


def _file_chunks(files: Sequence[Path], text_field: str, bad: BadDocuments) -> Iterator[tuple[list[str], bool]]:
    """Chunks of documents that never span two files, each with whether it is the last of its file."""
    for path in files:
        chunks = _chunks(documents([path], text_field, bad))
        chunk = next(chunks, None)
        while chunk is not None:
            following = next(chunks, None)
            yield chunk, following is None
            chunk = following


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


def _tokenized(chunks: Iterator[tuple[list[str], bool]], tokenize: _ChunkTokenizer, tokenizer_path: str,
               workers: int):
    """(chunk size, last of its file, result) in input order; at most ``2 * workers`` chunks in flight."""
    if workers <= 1:
        for chunk, ends_file in chunks:
            yield len(chunk), ends_file, tokenize(chunk)
        return
    spawn = multiprocessing.get_context("spawn")
    with spawn.Pool(workers, _init_worker, (tokenizer_path, tokenize.val_fraction)) as pool:
        pending: deque = deque()
        for chunk, ends_file in chunks:
            pending.append((len(chunk), ends_file, pool.apply_async(_tokenize_in_worker, (chunk,))))
            if len(pending) >= 2 * workers:
                n, ends, result = pending.popleft()
                yield n, ends, result.get()
        while pending:
            n, ends, result = pending.popleft()
            yield n, ends, result.get()


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

    def end_file(self) -> None:
        """Drop the file's trailing partial sample and close its last shard: nothing spans two files."""
        self.rest = self.rest[:0]
        if self.tar is not None:
            self._close_shard()

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
        self.end_file()
        tokens = self.samples * self.sample_tokens
        return {"documents": self.documents, "input_tokens": self.input_tokens, "samples": self.samples,
                "tokens": tokens, "dropped_tokens": self.input_tokens - tokens, "shards": self.shards}


def part_files(files: Sequence[Path], index: int, count: int) -> list[Path]:
    """The ``index``-th (1-based) of ``count`` contiguous runs of ``files``, of sizes differing by at most one."""
    if not 1 <= index <= count:
        raise DataError(f"part {index}/{count}: the part number must be in 1..{count}")
    if count > len(files):
        raise DataError(f"part {index}/{count}: the inputs are {len(files)} files, fewer than {count} parts "
                        f"(a part holds whole files); use at most {len(files)} parts")
    size, extra = divmod(len(files), count)
    start = (index - 1) * size + min(index - 1, extra)
    return list(files[start:start + size + (index <= extra)])


def part_dir_name(index: int, count: int) -> str:
    """``part-I-of-N``, ``I`` zero-padded to the width of ``N`` (so the names sort in part order)."""
    return f"part-{index:0{len(str(count))}d}-of-{count}"


def part_dirs_pattern(count: int) -> str:
    """A shell glob of the names of all ``count`` parts."""
    return f"part-*-of-{count}"


def _inputs_digest(files: Sequence[Path]) -> str:
    return hashlib.sha256(json.dumps([str(f) for f in files]).encode()).hexdigest()


def _check_samples(splits: dict, files: Sequence, seq_len: int) -> None:
    """Every split holds at least one sample."""
    for name, split in splits.items():
        if split["samples"] == 0:
            raise DataError(
                f"the {name} split of {', '.join(map(str, files))} has {split['input_tokens']} tokens, fewer than one "
                f"sample of seq_len + 1 = {seq_len + 1}: add text, lower --seq-len"
                + (" or raise --val-fraction" if name == "val" else "")
            )


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
    part: tuple[int, int] | None = None,
) -> dict:
    """Tokenize ``inputs`` and write packed shards and ``manifest.json`` into ``out_dir``; returns the manifest.

    ``tokenizer`` is a tokenizer directory (or ``mistral-v0.3``, see
    :func:`mhf_dist.vocab.tokenizers.load_tokenizer`). ``out_dir`` must be new or empty. ``part=(I, N)``
    prepares only part I of N of the inputs (module docstring, "Parts and merging").
    """
    if seq_len < 1 or samples_per_shard < 1 or workers < 1:
        raise DataError(f"seq_len={seq_len}, samples_per_shard={samples_per_shard} and workers={workers} must be >= 1")
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction={val_fraction} must be in [0, 1)")
    if prefix == VAL_PREFIX or not prefix or "/" in prefix:
        raise DataError(
            f"prefix {prefix!r}: pick a plain name other than {VAL_PREFIX!r} (used by the validation shards)")
    all_files = expand_inputs(inputs)
    files = part_files(all_files, *part) if part else all_files
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

    chunks = _file_chunks(files, text_field, bad)
    results = _tokenized(chunks, _ChunkTokenizer(tok, val_fraction), str(tokenizer), workers)
    with tqdm(desc="tokenizing", unit="doc", disable=not progress) as bar:
        for n_docs, ends_file, (train_ids, val_ids, n_train, n_val) in results:
            writers[0].add(train_ids, n_train)
            if val_fraction > 0:
                writers[1].add(val_ids, n_val)
            if ends_file:
                for writer in writers:
                    writer.end_file()
            bar.update(n_docs)
            bar.set_postfix(samples=sum(w.samples for w in writers), refresh=False)
    splits = dict(zip(("train", "val"), (w.finish() for w in writers)))
    if part is None:  # a part's split may be empty: the merge checks the whole
        _check_samples(splits, files, seq_len)

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
    if part:
        manifest["part"] = {"index": part[0], "count": part[1], "inputs_sha256": _inputs_digest(all_files)}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


# what parts of one dataset share (the part entry's count and input list too)
_SHARED = ("format", "seq_len", "sample_tokens", "dtype", "vocab_size", "eos_id", "tokenizer_fingerprint",
           "sample_member", "samples_per_shard", "val_fraction", "text_field")


def _read_part(out: Path, part_dir: Path) -> dict:
    """A part's manifest, after checking that it is a finished part inside ``out``."""
    if not part_dir.resolve().is_relative_to(out.resolve()) or part_dir.resolve() == out.resolve():
        raise DataError(f"part directory {part_dir} is not inside {out}: the merged manifest names the parts' shards "
                        f"by their paths under {out}, so that it can be copied or moved whole; move the part there "
                        f"(prepare-data --part I/N --out {out} writes part I into {out}/part-I-of-N)")
    try:
        manifest = json.loads((part_dir / MANIFEST).read_text())
    except FileNotFoundError:
        raise DataError(f"part directory {part_dir} has no {MANIFEST}: its preparation did not finish; run its "
                        "prepare-data --part I/N again") from None
    if manifest.get("format") != FORMAT or "part" not in manifest:
        raise DataError(f"{part_dir / MANIFEST} is not the manifest of a part (prepared with --part I/N); merge only "
                        "the parts of one preparation")
    return manifest


def _part_settings(manifest: dict) -> dict:
    return {key: manifest[key] for key in _SHARED} | {
        "part count": manifest["part"]["count"], "input list": manifest["part"]["inputs_sha256"]}


def _check_alike(parts: list[tuple[Path, dict]]) -> None:
    """Every part has the settings most parts have; a part that differs is named."""
    settings = [(d, _part_settings(m)) for d, m in parts]
    for key in settings[0][1]:
        common, _ = Counter(json.dumps(s[key]) for _, s in settings).most_common(1)[0]
        odd = [(d, s[key]) for d, s in settings if json.dumps(s[key]) != common]
        if odd:
            raise DataError(f"part {odd[0][0]} has {key} {odd[0][1]!r}, the other parts "
                            f"{json.loads(common)!r}: parts of one dataset come from one input list, tokenizer and "
                            "settings; prepare it again with the others' (prepare-data --part I/N)")


def _in_order(parts: list[tuple[Path, dict]]) -> list[tuple[Path, dict]]:
    """The parts in part order, each exactly once."""
    count = parts[0][1]["part"]["count"]
    by_index: dict[int, tuple[Path, dict]] = {}
    for part_dir, manifest in parts:
        index = manifest["part"]["index"]
        if index in by_index:
            raise DataError(f"{by_index[index][0]} and {part_dir} are both part {index}/{count}: pass each part once")
        by_index[index] = part_dir, manifest
    missing = [str(i) for i in range(1, count + 1) if i not in by_index]
    if missing:
        raise DataError(f"part {', '.join(missing)} of {count} is missing: prepare it (prepare-data --part I/{count}) "
                        "and pass its directory too")
    return [by_index[i] for i in range(1, count + 1)]


def _check_shard_files(part_dir: Path, manifest: dict) -> None:
    """Every shard a part lists is there with its size (its SHA-256 the reader checks as it reads)."""
    for split in manifest["splits"].values():
        for entry in split["shards"]:
            path = part_dir / entry["name"]
            if not path.is_file() or path.stat().st_size != entry["bytes"]:
                raise DataError(f"shard {path} is missing or not {entry['bytes']} bytes as {part_dir / MANIFEST} "
                                "says; prepare that part again")


def merge(out: str | os.PathLike, part_dirs: Sequence[str | os.PathLike], overwrite: bool = False) -> dict:
    """One ``manifest.json`` (and ``tokenizer/``) in ``out`` over the parts in ``part_dirs`` (directories inside
    ``out``), shards left in place; returns the manifest. ``out``'s manifest and tokenizer are replaced only with
    ``overwrite``; the parts are never changed."""
    out = Path(out)
    if not part_dirs:
        raise DataError(f"nothing to merge into {out}: pass the part directories")
    parts = [(Path(d), _read_part(out, Path(d))) for d in part_dirs]
    _check_alike(parts)
    parts = _in_order(parts)
    for part_dir, manifest in parts:
        _check_shard_files(part_dir, manifest)
    if not overwrite and any((out / name).exists() for name in (MANIFEST, TOKENIZER_DIR)):
        raise DataError(f"{out} already holds a {MANIFEST} or {TOKENIZER_DIR}/; pass --overwrite to replace them "
                        "(the parts stay as they are)")
    merged = dict(parts[0][1])  # the shared settings, in a one-process manifest's key order
    del merged["part"]
    merged["inputs"] = [f for _, m in parts for f in m["inputs"]]
    merged["skipped_documents"] = sum(m["skipped_documents"] for _, m in parts)
    merged["splits"] = {name: _merged_split(out, [(d, m["splits"][name]) for d, m in parts])
                        for name in merged["splits"]}
    merged["parts"] = [_under(out, d) for d, _ in parts]
    _check_samples(merged["splits"], merged["inputs"], merged["seq_len"])
    _replace_tokenizer(parts[0][0] / merged["tokenizer"], out / TOKENIZER_DIR)
    _write_atomically(out / MANIFEST, json.dumps(merged, indent=2) + "\n")
    return merged


def _merged_split(out: Path, splits: list[tuple[Path, dict]]) -> dict:
    """The parts' splits as one: counts summed, shard entries in part order, named by their path under ``out``."""
    shards = [entry | {"name": f"{_under(out, d)}/{entry['name']}"}
              for d, split in splits for entry in split["shards"]]
    sums = {key: sum(split[key] for _, split in splits)
            for key in ("documents", "input_tokens", "samples", "tokens", "dropped_tokens")}
    return sums | {"shards": shards}


def _under(out: Path, part_dir: Path) -> str:
    """``part_dir``'s path under ``out``, with ``/`` (as manifests name shards)."""
    return part_dir.resolve().relative_to(out.resolve()).as_posix()


def _replace_tokenizer(source: Path, target: Path) -> None:
    """Copy a part's tokenizer directory to ``target`` (small; complete or absent, never half-written)."""
    tmp = target.with_name(f".{target.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
