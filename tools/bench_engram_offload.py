"""Benchmark: `100m-h4b16k+engram` with the Engram tables on the device under DeepSpeed and in host memory
(model.engram.offload): whole on every rank, stepped densely or lazily (model.engram.offload_update), and sharded over
the ranks (offload=sharded), with fp32 or bf16 weights and moments (table_dtype, moment_dtype), a few steps each.

Usage: python tools/bench_engram_offload.py [--preset 100m-h4b16k+engram] [--steps 4] [--seq-len 128] [--micro 1]
                                            [--nproc 1] [--cases device,offload,lazy] [--rounds 1] [--baseline DIR]
                                            [--set KEY=VALUE ...]
Cases: device, offload, lazy, sharded, sharded-bf16 (bf16 weights), sharded-bf16-moments (and bf16 moments).
Each case is `mhf-dist train` in a fresh process on the embedded text (``--nproc`` ranks, ZeRO-3; fp32 on CPU, the
preset's bf16 on a GPU), one micro-batch per data-parallel rank per step; ``--set`` adds overrides to every case
(``parallel.tp=2``, ``parallel.pp=2``: the layout). Step time is the median over the steps after the first
(from the logged tokens/s); peak host memory is the largest process's max RSS (one rank's); on a GPU the peak device
memory (max allocated) too; the last loss shows what bf16 storage costs against fp32. With ``--rounds N`` every case
runs N times, each round starting with the next case, so a machine whose speed drifts slows them alike; each number
is the median over the rounds.
`--baseline DIR` also runs every case with the mhf_dist package of DIR (e.g. `git worktree add DIR <revision>`),
each case's baseline run just before the current one, and reports current / baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from mhf_dist.config import load_config
from mhf_dist.parallel.layout import resolve_layout

ROOT = Path(__file__).resolve().parents[1]
# runs the training command and prints its max RSS (the grandchild's, so each case is measured alone)
MEASURE = (
    "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, capture_output=True); "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
)


SHARDED = ("model.engram.offload=sharded",)
CASES = {
    "device": ("model.engram.offload=false",),
    "offload": ("model.engram.offload=true",),
    "lazy": ("model.engram.offload=true", "model.engram.offload_update=lazy"),
    "sharded": SHARDED,
    "sharded-bf16": (*SHARDED, "model.engram.table_dtype=bf16"),
    "sharded-bf16-moments": (
        *SHARDED,
        "model.engram.table_dtype=bf16",
        "model.engram.moment_dtype=bf16",
    ),
}


def run_case(run: Path, case: str, args, dp: int, tree: Path = ROOT) -> dict:
    """One case on ``args.nproc`` ranks, ``dp`` of them data-parallel."""
    overrides = [
        "data.path=embedded",
        f"data.seq_len={args.seq_len}",
        f"train.max_steps={args.steps}",
        f"train.global_batch_size={args.micro * dp}",
        f"train.micro_batch_size={args.micro}",
        "train.log_interval=1",
        f"train.eval_sequences={args.micro}",
        "train.eval_interval=0",
        *CASES[case],
        *args.set,
    ]
    if not torch.cuda.is_available():
        overrides.append("train.dtype=fp32")
    argv = [
        sys.executable,
        "-m",
        "mhf_dist",
        "train",
        "--preset",
        args.preset,
        "--run-dir",
        str(run),
        "--nproc-per-node",
        str(args.nproc),
    ]
    for o in overrides:
        argv += ["--set", o]
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, *argv],
        check=True,
        capture_output=True,
        text=True,
        env=os.environ | {"PYTHONPATH": str(tree)},
    )  # that tree's mhf_dist
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    tokens = args.micro * dp * args.seq_len
    times = [tokens / r["tokens_per_s"] for r in records[1:]] or [
        tokens / records[0]["tokens_per_s"]
    ]
    result = {
        "step_s": statistics.median(times),
        "host_gb": int(out.stdout.split()[-1]) / 2**20,
        "loss": records[-1]["loss"],
    }
    if torch.cuda.is_available():
        result["device_gb"] = records[-1]["memory_gb"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro", type=int, default=1, help="sequences per step (one micro-batch)")
    parser.add_argument(
        "--preset", default="100m-h4b16k+engram", help="a preset with an Engram memory"
    )
    parser.add_argument("--nproc", type=int, default=1, help="ranks")
    parser.add_argument(
        "--set", action="append", default=[], help="an override for every case (repeatable)"
    )
    parser.add_argument("--cases", default="device,offload,lazy", help=", ".join(CASES))
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every case this many times, each round starting with the next case; medians reported",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        help="a checkout whose mhf_dist runs every case too, for comparison",
    )
    args = parser.parse_args()
    cases = args.cases.split(",")
    dp = resolve_layout(load_config(args.preset, overrides=args.set), args.nproc).dp
    rounds: dict[str, list[dict]] = {case: [] for case in cases}
    baseline = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for case in cases[r % len(cases) :] + cases[: r % len(cases)]:
                run = Path(tmp) / f"{case}-{r}"
                if args.baseline and r == 0:
                    baseline[case] = run_case(
                        run.with_name(run.name + "-baseline"),
                        case,
                        args,
                        dp,
                        args.baseline.resolve(),
                    )
                rounds[case].append(run_case(run, case, args, dp))
    results = {
        case: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        for case, runs in rounds.items()
    }
    first = results[cases[0]]
    columns = ["step_s", "host_gb"] + (["device_gb"] if "device_gb" in first else [])
    header = f"{args.preset}, {args.nproc} rank(s)"
    print(f"{header:<34}" + "".join(f"{c:>12}" for c in columns) + f"{'last loss':>12}")
    for name, r in results.items():
        print(f"{name:<34}" + "".join(f"{r[c]:>12.3f}" for c in columns) + f"{r['loss']:>12.4f}")
    for name in cases[1:]:
        print(
            f"{name + ' / ' + cases[0]:<34}"
            + "".join(f"{results[name][c] / first[c]:>12.2f}" for c in columns)
        )
    if baseline:
        print(f"\nbaseline {args.baseline}")
        for name, r in baseline.items():
            print(
                f"{name:<34}" + "".join(f"{r[c]:>12.3f}" for c in columns) + f"{r['loss']:>12.4f}"
            )
        for name, r in baseline.items():
            print(
                f"{name + ' / baseline':<34}"
                + "".join(f"{results[name][c] / r[c]:>12.2f}" for c in columns)
            )


if __name__ == "__main__":
    main()
