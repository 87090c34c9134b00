"""The inputs of ``prepare-data`` and their documents.

``expand_inputs``: files, directories (their input files, ``directory_inputs``) and globs, in sorted order.
``documents``: a ``.txt`` file's blank-line separated paragraphs and a ``.jsonl`` file's ``text_field`` per line
(either optionally ``.gz`` or ``.zst`` compressed), a Parquet file's ``text_field`` column per row (read a row group
at a time; ``.zst`` and Parquet need the ``data`` extra); whitespace-only documents are ignored. A document that is
not a string stops the preparation, or is left out and counted (``BadDocuments``). The formats and rules:
docs/data.md, "Data: ``prepare-data``".
"""

from __future__ import annotations

import glob
import gzip
import importlib
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from mhf_dist.data.formats import DataError

_TEXT_SUFFIXES = (".txt", ".jsonl")
_COMPRESSED = (".gz", ".zst")
PARQUET = ".parquet"
ON_BAD_DOCUMENT = ("error", "skip")
DATA_EXTRA = "pip install 'mhf-dist[data]'"


def expand_inputs(patterns: Sequence[str | os.PathLike]) -> list[Path]:
    """Input files in order: each pattern is a file, a directory (its text files, ``directory_inputs``) or a
    glob (its matches sorted; directories among them are passed over, the glob names the files it wants)."""
    files: list[Path] = []
    for pattern in map(str, patterns):
        if glob.has_magic(pattern):
            matches = [
                m for m in map(Path, sorted(glob.glob(pattern, recursive=True))) if not m.is_dir()
            ]
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
                raise DataError(
                    f"input {match}: unsupported file type; use .txt or .jsonl (optionally compressed: "
                    ".gz, .zst) or .parquet"
                )
            files.append(match)
    return files


def _uncompressed_name(path: Path) -> str:
    return path.name.removesuffix(path.suffix) if path.suffix in _COMPRESSED else path.name


def _readable_kind(path: Path) -> bool:
    return path.suffix == PARQUET or _uncompressed_name(path).endswith(_TEXT_SUFFIXES)


def directory_inputs(directory: Path) -> list[Path]:
    """The input files directly in ``directory`` (the kinds ``expand_inputs`` reads), sorted by name; other
    files and subdirectories are not read."""
    files = sorted(p for p in directory.iterdir() if p.is_file() and _readable_kind(p))
    if not files:
        raise DataError(
            f"input {directory}: a directory without .txt, .jsonl (optionally compressed) or .parquet "
            f"files directly in it; name the files, or a glob such as '{directory / '**' / '*.txt'}' "
            "for subdirectories"
        )
    return files


class BadDocuments:
    """What to do with a document that is not a string (``on_bad_document``), and how many were left out."""

    def __init__(self, action: str = "error"):
        if action not in ON_BAD_DOCUMENT:
            raise DataError(f"on_bad_document={action!r}: use one of {', '.join(ON_BAD_DOCUMENT)}")
        self.action, self.skipped = action, 0
        self.first: str | None = None  # the first skipped document's place, problem and fix

    def found(self, where: str, problem: str, fix: str) -> None:
        """A bad document at ``where``: raised, or counted when skipping."""
        if self.action == "error":
            raise DataError(
                f"{where}: {problem}; {fix}, or leave such documents out with --on-bad-document skip"
            )
        self.skipped += 1
        self.first = self.first or f"{where}: {problem}; {fix}"

    def check_kept(self, kept: int) -> None:
        """Refuse inputs whose every document was skipped, with the first one's reason (else the error would be
        about too few tokens)."""
        if kept == 0 and self.skipped:
            raise DataError(
                f"every document was skipped (--on-bad-document skip): {self.skipped} not text and none "
                f"kept; the first, {self.first}"
            )


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
        raise DataError(
            f"input {path} needs {module}, which is not installed: {DATA_EXTRA}"
        ) from None


def documents(
    files: Sequence[Path], text_field: str = "text", bad: BadDocuments | None = None
) -> Iterator[str]:
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
                f"input {path} is not readable UTF-8 text ({e}); convert or repair it, or leave it out"
            ) from None
        except Exception as e:  # zstandard's ZstdError, which is no OSError, for a damaged .zst
            if path.suffix != ".zst" or isinstance(e, DataError):
                raise
            raise DataError(
                f"input {path} is not a readable zstd stream ({e}); repair it, or leave it out"
            ) from None


def _jsonl_documents(lines, path: Path, text_field: str, bad: BadDocuments) -> Iterator[str]:
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            text = json.loads(line)[text_field]
        except (json.JSONDecodeError, TypeError, KeyError) as e:
            bad.found(
                f"{path}:{number}",
                f"not a JSON object with a string field {text_field!r} ({e!r})",
                "fix the line or name the right field with --text-field",
            )
            continue
        if not isinstance(text, str):
            bad.found(
                f"{path}:{number}",
                f"field {text_field!r} is not a string",
                "name the text field with --text-field",
            )
        elif text.strip():
            yield text


def _parquet_documents(path: Path, text_field: str, bad: BadDocuments) -> Iterator[str]:
    """Each row's ``text_field``, one row group at a time."""
    parquet = _optional("pyarrow.parquet", path)
    try:
        table = parquet.ParquetFile(path)
    except (
        Exception
    ) as e:  # pyarrow's ArrowInvalid and OSError for a file that is not Parquet, or is truncated
        raise DataError(
            f"input {path} is not a readable Parquet file ({e}); repair it, or leave it out"
        ) from None
    columns = table.schema_arrow.names
    if text_field not in columns:
        raise DataError(
            f"input {path} has no column {text_field!r} (it has {', '.join(columns)}); name the text "
            "column with --text-field"
        )
    kind = str(table.schema_arrow.field(text_field).type)
    # a column of another type (numbers, say) is the wrong column, not a few bad rows
    wrong = (
        ""
        if kind in ("string", "large_string", "string_view")
        else (f" (the column holds {kind}, not strings; the file's columns: {', '.join(columns)})")
    )
    row = 0
    for group in range(table.num_row_groups):
        for text in table.read_row_group(group, columns=[text_field]).column(0).to_pylist():
            if not isinstance(text, str):
                bad.found(
                    f"{path}: row {row}",
                    f"column {text_field!r} holds {text!r}, not a string{wrong}",
                    "fix the row or name the text column with --text-field",
                )
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
