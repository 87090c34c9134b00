"""The argument types and options several commands share."""

from __future__ import annotations

import argparse
import os

from mhf_dist.config import RunConfig, load_config
from mhf_dist.storage.output_dir import OVERWRITE_HELP


def positive_int(text: str) -> int:
    """An argparse type: a whole number ≥ 1 (a count of ranks, nodes, steps, seconds, ...)."""
    return _int_at_least(text, 1)


def node_range(text: str) -> tuple[int | None, int]:
    """An argparse type: ``N`` nodes, or ``MIN-MAX`` (an elastic job): (MIN or None, MAX)."""
    low, dash, high = text.partition("-")
    if not dash:
        return None, positive_int(text)
    return positive_int(low), positive_int(high)


def non_negative_int(text: str) -> int:
    return _int_at_least(text, 0)


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
    return value


def part_of(text: str) -> tuple[int, int]:
    """An argparse type: ``I/N``, two whole numbers (part I of N; the range is checked against the inputs)."""
    index, slash, count = text.partition("/")
    if not slash or not index.isdigit() or not count.isdigit() or int(count) < 1:
        raise argparse.ArgumentTypeError(f"expected I/N (part I of N, e.g. 3/8), got {text!r}")
    return int(index), int(count)


def add_overrides(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=help
    )


def add_dtype(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="floating-point type of the weights",
    )


def add_checkpoint(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "checkpoint",
        help="a checkpoint directory, or a run directory (its newest checkpoint; before the "
        "first, its initial weights: train.init_from)",
    )


def add_overwrite(p: argparse.ArgumentParser) -> None:
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)


def add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--preset", help="{size}-{variant}, e.g. tiny-h4b16k, 100m-standard+4l, 3b-h4b16k"
    )
    p.add_argument("--config", help="run YAML (may name a `preset:` to start from)")
    add_overrides(
        p, "override any config field, e.g. --set model.hash.num_buckets=4096 (repeatable)"
    )


def load_run_config(args) -> RunConfig:
    return load_config(args.preset, args.config, args.overrides)


def add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", required=True, help="export-hf directory, or a run / checkpoint directory"
    )
    add_dtype(p)
    p.add_argument(
        "--device", default="auto", help="auto (a GPU when there is one), cpu, cuda, cuda:1, ..."
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the model directory's Python files even when they are not this package's own",
    )


def add_cluster_options(p: argparse.ArgumentParser) -> None:
    """The cluster profile and what a submission may change of it (submit, submit-data)."""
    p.add_argument(
        "--cluster",
        required=True,
        help="cluster profile: a100-80g, mi300x, cpu-local or a .yaml path",
    )
    p.add_argument("--partition", help="SLURM partition (instead of the profile's)")
    p.add_argument("--account", help="SLURM account to charge (instead of the profile's)")
    p.add_argument(
        "--time", help="time limit, e.g. 24:00:00 or 2-00:00:00 (instead of the profile's)"
    )
    p.add_argument("--qos", help="SLURM quality of service (instead of the profile's)")
    from mhf_dist.cluster.scheduler import schedulers

    for s in schedulers().values():
        s.add_arguments(p)
    p.add_argument(
        "--python", help="the Python on the nodes (default: the profile's, else this one)"
    )


PREPARATION_OPTIONS = (
    "samples_per_shard",
    "prefix",
    "text_field",
    "on_bad_document",
    "val_fraction",
)


def add_preparation_options(p: argparse.ArgumentParser) -> None:
    """How documents become shards (``PREPARATION_OPTIONS``): shared by prepare-data and submit-data."""
    p.add_argument(
        "--samples-per-shard",
        type=positive_int,
        default=8192,
        help="samples per tar shard (default 8192)",
    )
    p.add_argument(
        "--prefix",
        default="train",
        help="training shard names: PREFIX-000000.tar ... (default train)",
    )
    p.add_argument(
        "--text-field",
        default="text",
        help="the field (.jsonl) or column (.parquet) holding the text",
    )
    p.add_argument(
        "--on-bad-document",
        choices=("error", "skip"),
        default="error",
        help="a document that is not a string: stop, naming its file and line or row (error), or leave it "
        "out and count it in the manifest (skip)",
    )
    p.add_argument(
        "--val-fraction",
        type=float,
        default=0.0,
        help="fraction of documents held out (by a hash of their text) into val-*.tar shards",
    )


def preparation_options(args) -> list[str]:
    """The ``PREPARATION_OPTIONS`` of ``args`` as prepare-data arguments."""
    return [
        a
        for name in PREPARATION_OPTIONS
        for a in (f"--{name.replace('_', '-')}", str(getattr(args, name)))
    ]


def rank_label() -> str:
    """`` [rank N]`` in a job of several ranks (whose errors share one log), else nothing."""
    from mhf_dist.cluster.scheduler import task_env

    env = task_env() | dict(os.environ)  # a job step's task is labelled before its rank starts too
    rank, world = env.get("RANK"), env.get("WORLD_SIZE", "1")
    return f" [rank {rank}]" if rank is not None and world != "1" else ""
