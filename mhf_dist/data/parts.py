"""One preparation spread over many machines: the I-th of N parts of the input list (``part_files``;
``prepare-data --part I/N`` writes it into ``OUT/part-I-of-N``), and the merge of the parts into one dataset, their
shards left in place (``merge``). Why the merged shards are those of a one-process preparation, shard for shard:
docs/design-training.md, "Data preparation"; the commands: docs/data.md."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from mhf_dist.atomic import write_atomic
from mhf_dist.data.formats import FORMAT, MANIFEST, TOKENIZER_DIR, DataError, check_samples


def part_files(files: Sequence[Path], index: int, count: int) -> list[Path]:
    """The ``index``-th (1-based) of ``count`` contiguous runs of ``files``, of sizes differing by at most one."""
    if not 1 <= index <= count:
        raise DataError(f"part {index}/{count}: the part number must be in 1..{count}")
    if count > len(files):
        raise DataError(
            f"part {index}/{count}: the inputs are {len(files)} files, fewer than {count} parts "
            f"(a part holds whole files); use at most {len(files)} parts"
        )
    size, extra = divmod(len(files), count)
    start = (index - 1) * size + min(index - 1, extra)
    return list(files[start : start + size + (index <= extra)])


def part_dir_name(index: int, count: int) -> str:
    """``part-I-of-N``, ``I`` zero-padded to the width of ``N`` (so the names sort in part order)."""
    return f"part-{index:0{len(str(count))}d}-of-{count}"


def part_dirs_pattern(count: int) -> str:
    """A shell glob of the names of all ``count`` parts."""
    return f"part-*-of-{count}"


def inputs_digest(files: Sequence[Path]) -> str:
    return hashlib.sha256(json.dumps([str(f) for f in files]).encode()).hexdigest()


# what parts of one dataset share (the part entry's count and input list too)
_SHARED = (
    "format",
    "seq_len",
    "sample_tokens",
    "dtype",
    "vocab_size",
    "eos_id",
    "tokenizer_fingerprint",
    "sample_member",
    "samples_per_shard",
    "val_fraction",
    "text_field",
)


def _read_part(out: Path, part_dir: Path) -> dict:
    """A part's manifest, after checking that it is a finished part inside ``out``."""
    if not part_dir.resolve().is_relative_to(out.resolve()) or part_dir.resolve() == out.resolve():
        raise DataError(
            f"part directory {part_dir} is not inside {out}: the merged manifest names the parts' shards "
            f"by their paths under {out}, so that it can be copied or moved whole; move the part there "
            f"(prepare-data --part I/N --out {out} writes part I into {out}/part-I-of-N)"
        )
    try:
        manifest = json.loads((part_dir / MANIFEST).read_text())
    except FileNotFoundError:
        raise DataError(
            f"part directory {part_dir} has no {MANIFEST}: its preparation did not finish; run its "
            "prepare-data --part I/N again"
        ) from None
    if manifest.get("format") != FORMAT or "part" not in manifest:
        raise DataError(
            f"{part_dir / MANIFEST} is not the manifest of a part (prepared with --part I/N); merge only "
            "the parts of one preparation"
        )
    return manifest


def _part_settings(manifest: dict) -> dict:
    return {key: manifest[key] for key in _SHARED} | {
        "part count": manifest["part"]["count"],
        "input list": manifest["part"]["inputs_sha256"],
    }


def _check_alike(parts: list[tuple[Path, dict]]) -> None:
    """Every part has the settings most parts have; a part that differs is named."""
    settings = [(d, _part_settings(m)) for d, m in parts]
    for key in settings[0][1]:
        common, _ = Counter(json.dumps(s[key]) for _, s in settings).most_common(1)[0]
        odd = [(d, s[key]) for d, s in settings if json.dumps(s[key]) != common]
        if odd:
            raise DataError(
                f"part {odd[0][0]} has {key} {odd[0][1]!r}, the other parts "
                f"{json.loads(common)!r}: parts of one dataset come from one input list, tokenizer and "
                "settings; prepare it again with the others' (prepare-data --part I/N)"
            )


def _in_order(parts: list[tuple[Path, dict]]) -> list[tuple[Path, dict]]:
    """The parts in part order, each exactly once."""
    count = parts[0][1]["part"]["count"]
    by_index: dict[int, tuple[Path, dict]] = {}
    for part_dir, manifest in parts:
        index = manifest["part"]["index"]
        if index in by_index:
            raise DataError(
                f"{by_index[index][0]} and {part_dir} are both part {index}/{count}: pass each part once"
            )
        by_index[index] = part_dir, manifest
    missing = [str(i) for i in range(1, count + 1) if i not in by_index]
    if missing:
        raise DataError(
            f"part {', '.join(missing)} of {count} is missing: prepare it (prepare-data --part I/{count}) "
            "and pass its directory too"
        )
    return [by_index[i] for i in range(1, count + 1)]


def _check_shard_files(part_dir: Path, manifest: dict) -> None:
    """Every shard a part lists is there with its size (its SHA-256 the reader checks as it reads)."""
    for split in manifest["splits"].values():
        for entry in split["shards"]:
            path = part_dir / entry["name"]
            if not path.is_file() or path.stat().st_size != entry["bytes"]:
                raise DataError(
                    f"shard {path} is missing or not {entry['bytes']} bytes as {part_dir / MANIFEST} "
                    "says; prepare that part again"
                )


def merge(
    out: str | os.PathLike, part_dirs: Sequence[str | os.PathLike], overwrite: bool = False
) -> dict:
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
        raise DataError(
            f"{out} already holds a {MANIFEST} or {TOKENIZER_DIR}/; pass --overwrite to replace them "
            "(the parts stay as they are)"
        )
    merged = dict(parts[0][1])  # the shared settings, in a one-process manifest's key order
    del merged["part"]
    merged["inputs"] = [f for _, m in parts for f in m["inputs"]]
    merged["skipped_documents"] = sum(m["skipped_documents"] for _, m in parts)
    merged["splits"] = {
        name: _merged_split(out, [(d, m["splits"][name]) for d, m in parts])
        for name in merged["splits"]
    }
    merged["parts"] = [_under(out, d) for d, _ in parts]
    check_samples(merged["splits"], merged["inputs"], merged["seq_len"])
    _replace_tokenizer(parts[0][0] / merged["tokenizer"], out / TOKENIZER_DIR)
    write_atomic(out / MANIFEST, json.dumps(merged, indent=2) + "\n")
    return merged


def _merged_split(out: Path, splits: list[tuple[Path, dict]]) -> dict:
    """The parts' splits as one: counts summed, shard entries in part order, named by their path under ``out``."""
    shards = [
        entry | {"name": f"{_under(out, d)}/{entry['name']}"}
        for d, split in splits
        for entry in split["shards"]
    ]
    sums = {
        key: sum(split[key] for _, split in splits)
        for key in ("documents", "input_tokens", "samples", "tokens", "dropped_tokens")
    }
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
