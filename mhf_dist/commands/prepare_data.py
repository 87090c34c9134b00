"""``mhf-dist prepare-data``: prepare shards of text files, or merge prepared parts (the library:
``mhf_dist.data.prepare``)."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from mhf_dist.data.formats import MANIFEST, DataError
from mhf_dist.data.inputs import expand_inputs
from mhf_dist.data.locations import check_upload, is_url, upload
from mhf_dist.data.parts import merge, part_dir_name, part_dirs_pattern
from mhf_dist.data.prepare import prepare
from mhf_dist.storage.output_dir import check_target, staged
from mhf_dist.storage.reading_marks import refuse_if_read


def _print_summary(manifest: dict, where: Path | str) -> None:
    for name, split in manifest["splits"].items():
        print(
            f"{name}: {split['documents']} documents, {split['samples']} samples of {manifest['sample_tokens']} "
            f"tokens in {len(split['shards'])} shards ({split['dropped_tokens']} trailing tokens dropped)"
        )
    if manifest["skipped_documents"]:
        print(
            f"skipped {manifest['skipped_documents']} documents that were not strings (--on-bad-document skip)"
        )
    print(f"wrote {where}/{MANIFEST}")


def run(args: argparse.Namespace) -> int:
    """``mhf-dist prepare-data``: prepare shards (all, or ``--part I/N`` into ``OUT/part-I-of-N``) into a staging
    directory, renamed into place when complete, or ``--merge`` parts; print a summary. A directory that training
    runs read is never replaced (``reading_marks``)."""
    _check_mode(args)
    if args.merge:
        refuse_if_read(args.merge)  # its manifest is replaced in place
        manifest = merge(args.merge, args.inputs, args.overwrite)
        print(f"merged {len(manifest['parts'])} parts")
        _print_summary(manifest, args.merge.rstrip("/") if is_url(args.merge) else Path(args.merge))
        return 0
    if is_url(args.out):
        return _prepare_to_url(args)
    out = Path(args.out) / part_dir_name(*args.part) if args.part else Path(args.out)
    sources = [
        *expand_inputs(args.inputs),
        *([args.tokenizer] if Path(args.tokenizer).exists() else []),
    ]
    out = check_target(out, sources, args.overwrite)
    # runs read a part's shards through the merged manifest
    merged = [Path(args.out)] if args.part else []
    # and again once it is prepared: a run may have started meanwhile
    refuse_if_read(out, read_through=merged)
    with staged(out, before_replace=lambda tmp: refuse_if_read(out, tmp, merged)) as tmp:
        manifest = _prepare(args, tmp)
    return _done(args, manifest, out)


def _prepare_to_url(args: argparse.Namespace) -> int:
    """Into object storage: prepared in a local temporary directory (under TMPDIR), then uploaded, its manifest
    last; the target is checked (bucket, credentials, no data unless --overwrite) before any tokenizing."""
    out = f"{args.out.rstrip('/')}/{part_dir_name(*args.part)}" if args.part else args.out
    check_upload(out, args.overwrite)
    with tempfile.TemporaryDirectory(prefix="mhf-dist-prepare-") as tmp:
        manifest = _prepare(args, Path(tmp) / "out")
        upload(Path(tmp) / "out", out, args.overwrite)
    return _done(args, manifest, out.rstrip("/"))


def _prepare(args: argparse.Namespace, out: Path) -> dict:
    return prepare(
        args.inputs,
        args.tokenizer,
        out,
        seq_len=args.seq_len,
        samples_per_shard=args.samples_per_shard,
        prefix=args.prefix,
        text_field=args.text_field,
        val_fraction=args.val_fraction,
        workers=args.workers,
        progress=args.progress,
        on_bad_document=args.on_bad_document,
        part=args.part,
    )


def _done(args: argparse.Namespace, manifest: dict, out: Path | str) -> int:
    _print_summary(manifest, out)
    if args.part:
        print(
            f"when all {args.part[1]} parts are done: mhf-dist prepare-data --merge {args.out} "
            f"{str(args.out).rstrip('/')}/{part_dirs_pattern(args.part[1])}"
        )
    return 0


def _check_mode(args: argparse.Namespace) -> None:
    """``--merge`` takes part directories only; preparing needs a tokenizer, an output and a sequence length."""
    preparing = {
        "--tokenizer": args.tokenizer,
        "--out": args.out,
        "--seq-len": args.seq_len,
        "--part": args.part,
    }
    if args.merge and (given := [flag for flag, value in preparing.items() if value is not None]):
        raise DataError(
            f"--merge OUT PART_DIRS... takes the part directories only; {', '.join(given)} belong to "
            "preparing the parts: leave them out"
        )
    if not args.merge and (
        missing := [flag for flag, value in list(preparing.items())[:3] if value is None]
    ):
        raise DataError(
            f"prepare-data needs {', '.join(missing)} (or --merge OUT PART_DIRS... to merge parts)"
        )
