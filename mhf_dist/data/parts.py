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
from collections.abc import Callable, Sequence
from pathlib import Path

from mhf_dist.atomic import write_atomic
from mhf_dist.data.formats import FORMAT, MANIFEST, TOKENIZER_DIR, DataError, check_samples
from mhf_dist.data.locations import is_url, storage, storage_error


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
        raise _outside(part_dir, out)
    return _part_manifest(str(part_dir), lambda path: Path(path).read_bytes())


def _outside(part_dir, out) -> DataError:
    return DataError(
        f"part directory {part_dir} is not inside {out}: the merged manifest names the parts' shards "
        f"by their paths under {out}, so that it can be copied or moved whole; move the part there "
        f"(prepare-data --part I/N --out {out} writes part I into {out}/part-I-of-N)"
    )


def _part_manifest(part_dir: str, read: Callable[[str], bytes]) -> dict:
    """The manifest of a finished part at ``part_dir`` (a path or URL), its bytes read with ``read``."""
    where = f"{str(part_dir).rstrip('/')}/{MANIFEST}"
    try:
        manifest = json.loads(read(where))
    except FileNotFoundError:
        raise DataError(
            f"part directory {part_dir} has no {MANIFEST}: its preparation did not finish; run its "
            "prepare-data --part I/N again"
        ) from None
    if manifest.get("format") != FORMAT or "part" not in manifest:
        raise DataError(
            f"{where} is not the manifest of a part (prepared with --part I/N); merge only the parts of one "
            "preparation"
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
                raise _bad_shard(path, entry, part_dir)


def _bad_shard(path, entry: dict, part_dir) -> DataError:
    return DataError(
        f"shard {path} is missing or not {entry['bytes']} bytes as {part_dir}/{MANIFEST} says; prepare that "
        "part again"
    )


def merge(
    out: str | os.PathLike, part_dirs: Sequence[str | os.PathLike], overwrite: bool = False
) -> dict:
    """One ``manifest.json`` (and ``tokenizer/``) in ``out`` over the parts in ``part_dirs`` (directories inside
    ``out``), shards left in place; returns the manifest. ``out``'s manifest and tokenizer are replaced only with
    ``overwrite``; the parts are never changed. ``out`` may be a URL (object storage, ``merge_in_storage``)."""
    if not part_dirs:
        raise DataError(f"nothing to merge into {out}: pass the part directories")
    if is_url(str(out)):
        return merge_in_storage(str(out), [str(d) for d in part_dirs], overwrite)
    out = Path(out)
    parts = [(Path(d), _read_part(out, Path(d))) for d in part_dirs]
    parts = _checked(parts)
    for part_dir, manifest in parts:
        _check_shard_files(part_dir, manifest)
    if not overwrite and any((out / name).exists() for name in (MANIFEST, TOKENIZER_DIR)):
        raise _already_merged(out)
    merged = _merged_manifest([(_under(out, d), m) for d, m in parts])
    _replace_tokenizer(parts[0][0] / merged["tokenizer"], out / TOKENIZER_DIR)
    write_atomic(out / MANIFEST, json.dumps(merged, indent=2) + "\n")
    return merged


def merge_in_storage(out: str, part_dirs: Sequence[str], overwrite: bool = False) -> dict:
    """``merge`` where ``out`` and its parts lie in object storage (``prepare-data --part I/N --out URL``): the same
    checks and manifest, each shard's size read from the store; an old manifest is deleted before the tokenizer is
    replaced and the new one is written last (one object written whole), so a reader never finds a manifest whose
    tokenizer is not the one beside it."""
    fs, root = storage(out)

    def under(part_dir: str) -> str:
        path = storage(part_dir)[1]
        if not path.startswith(root + "/"):
            raise _outside(part_dir, out)
        return path.removeprefix(root + "/")

    try:
        parts = [
            (under(d), _part_manifest(d, lambda url: fs.cat_file(storage(url)[1])))
            for d in part_dirs
        ]
        parts = _checked(parts)
        for name, manifest in parts:
            for split in manifest["splits"].values():
                for entry in split["shards"]:
                    path = f"{root}/{name}/{entry['name']}"
                    if not fs.exists(path) or fs.size(path) != entry["bytes"]:
                        raise _bad_shard(f"{out.rstrip('/')}/{name}/{entry['name']}", entry, name)
        held = [n for n in (MANIFEST, TOKENIZER_DIR) if fs.exists(f"{root}/{n}")]
        if held and not overwrite:
            raise _already_merged(out)
        merged = _merged_manifest(parts)
        if MANIFEST in held:
            fs.rm_file(f"{root}/{MANIFEST}")
        if TOKENIZER_DIR in held:
            fs.rm(f"{root}/{TOKENIZER_DIR}", recursive=True)
        fs.copy(
            f"{root}/{parts[0][0]}/{merged['tokenizer']}", f"{root}/{TOKENIZER_DIR}", recursive=True
        )
        fs.pipe_file(f"{root}/{MANIFEST}", (json.dumps(merged, indent=2) + "\n").encode())
    except DataError:
        raise
    except Exception as e:
        raise storage_error(out, e) from None
    return merged


def _checked(parts: list[tuple]) -> list[tuple]:
    """The parts, alike and in part order (``_check_alike``, ``_in_order``)."""
    _check_alike(parts)
    return _in_order(parts)


def _merged_manifest(parts: list[tuple[str, dict]]) -> dict:
    """The manifest of the parts ``(path under the merged directory, manifest)``, in part order."""
    merged = dict(parts[0][1])  # the shared settings, in a one-process manifest's key order
    del merged["part"]
    merged["inputs"] = [f for _, m in parts for f in m["inputs"]]
    merged["skipped_documents"] = sum(m["skipped_documents"] for _, m in parts)
    merged["splits"] = {
        name: _merged_split([(d, m["splits"][name]) for d, m in parts]) for name in merged["splits"]
    }
    merged["parts"] = [d for d, _ in parts]
    check_samples(merged["splits"], merged["inputs"], merged["seq_len"])
    return merged


def _already_merged(out) -> DataError:
    return DataError(
        f"{out} already holds a {MANIFEST} or {TOKENIZER_DIR}/; pass --overwrite to replace them "
        "(the parts stay as they are)"
    )


def _merged_split(splits: list[tuple[str, dict]]) -> dict:
    """The parts' splits as one: counts summed, shard entries in part order, named by their path under the merged
    directory (each part's given with its split)."""
    shards = [
        entry | {"name": f"{d}/{entry['name']}"} for d, split in splits for entry in split["shards"]
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
