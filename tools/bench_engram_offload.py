"""Benchmark: `100m-h4b16k+engram` with the Engram tables offloaded to host memory (model.engram.offload), stepped
densely and lazily (model.engram.offload_update), vs on the device under DeepSpeed, a few steps each.

Usage: python tools/bench_engram_offload.py [--steps 4] [--seq-len 128] [--micro 1] [--baseline DIR]
Each case is `mhf-dist train` in a fresh process on the embedded text (one rank, ZeRO-3; fp32 on CPU, the preset's
bf16 on a GPU), one micro-batch per step. Step time is the median over the steps after the first (from the logged
tokens/s); peak host memory is the training process's max RSS; on a GPU the peak device memory (max allocated) too.
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

ROOT = Path(__file__).resolve().parents[1]
# runs the training command and prints its max RSS (the grandchild's, so each case is measured alone)
MEASURE = (
    "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, capture_output=True); "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
)


def run_case(run: Path, offload: bool, update: str, args, tree: Path = ROOT) -> dict:
    overrides = [
        "data.path=embedded",
        f"data.seq_len={args.seq_len}",
        f"train.max_steps={args.steps}",
        f"train.global_batch_size={args.micro}",
        f"train.micro_batch_size={args.micro}",
        "train.log_interval=1",
        f"train.eval_sequences={args.micro}",
        "train.eval_interval=0",
        f"model.engram.offload={str(offload).lower()}",
    ]
    if offload:
        overrides.append(f"model.engram.offload_update={update}")
    if not torch.cuda.is_available():
        overrides.append("train.dtype=fp32")
    argv = [
        sys.executable,
        "-m",
        "mhf_dist",
        "train",
        "--preset",
        "100m-h4b16k+engram",
        "--run-dir",
        str(run),
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
    tokens = args.micro * args.seq_len
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


CASES = (
    ("device tables", False, "dense"),
    ("offload", True, "dense"),
    ("offload, lazy", True, "lazy"),
)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro", type=int, default=1, help="sequences per step (one micro-batch)")
    parser.add_argument(
        "--baseline",
        type=Path,
        help="a checkout whose mhf_dist runs every case too, for comparison",
    )
    args = parser.parse_args()
    results, baseline = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, offload, update in CASES:
            run = Path(tmp) / name.replace(" ", "-").replace(",", "")
            if args.baseline:
                baseline[name] = run_case(
                    run.with_name(run.name + "-baseline"),
                    offload,
                    update,
                    args,
                    args.baseline.resolve(),
                )
            results[name] = run_case(run, offload, update, args)
    base = results["device tables"]
    columns = ["step_s", "host_gb"] + (["device_gb"] if "device_gb" in base else [])
    print(
        f"{'100m-h4b16k+engram':<24}" + "".join(f"{c:>12}" for c in columns) + f"{'last loss':>12}"
    )
    for name, r in results.items():
        print(f"{name:<24}" + "".join(f"{r[c]:>12.3f}" for c in columns) + f"{r['loss']:>12.4f}")
    for name in ("offload", "offload, lazy"):
        print(
            f"{name + ' / device':<24}"
            + "".join(f"{results[name][c] / base[c]:>12.2f}" for c in columns)
        )
    if baseline:
        print(f"\nbaseline {args.baseline}")
        for name, r in baseline.items():
            print(
                f"{name:<24}" + "".join(f"{r[c]:>12.3f}" for c in columns) + f"{r['loss']:>12.4f}"
            )
        for name, r in baseline.items():
            print(
                f"{name + ' / baseline':<24}"
                + "".join(f"{results[name][c] / r[c]:>12.2f}" for c in columns)
            )


if __name__ == "__main__":
    main()
