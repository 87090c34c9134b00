"""Benchmark: start-up time of the commands that train nothing, against `import torch` and `import deepspeed`.

Usage: python tools/bench_cli_startup.py [--repeats 7]
Each command runs in a fresh interpreter (`python -m mhf_dist ...`); the table gives the median wall time and
its ratio to the goal of 0.5 s. `status` reads a small run directory made here.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from mhf_dist.config import load_config

GOAL_S = 0.5


def median_seconds(argv: list[str], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        run.mkdir()
        (run / "config.yaml").write_text(
            yaml.safe_dump(load_config("tiny-h4b16k").model_dump(mode="json"))
        )
        (run / "metrics.jsonl").write_text(
            '{"step": 1, "loss": 8.3, "head_losses": [8.3], "tokens_per_s": 1000.0, "mfu": 0.01}\n'
        )
        cli = [sys.executable, "-m", "mhf_dist"]
        cases = {
            "python -c pass": [sys.executable, "-c", "pass"],
            "import torch": [sys.executable, "-c", "import torch"],
            "import deepspeed": [sys.executable, "-c", "import deepspeed"],
            "mhf-dist --help": [*cli, "--help"],
            "mhf-dist --version": [*cli, "--version"],
            "mhf-dist presets": [*cli, "presets"],
            "mhf-dist config --preset tiny-h4b16k": [*cli, "config", "--preset", "tiny-h4b16k"],
            "mhf-dist status RUN": [*cli, "status", str(run)],
            "mhf-dist submit ... --dry-run": [
                *cli,
                "submit",
                "--preset",
                "3b-h4b16k",
                "--set",
                "data.path=/d",
                "--cluster",
                "a100-80g",
                "--nodes",
                "4",
                "--run-dir",
                str(run / "job"),
                "--dry-run",
            ],
            "mhf-dist plan --preset 3b-h4b16k": [
                *cli,
                "plan",
                "--preset",
                "3b-h4b16k",
                "--cluster",
                "a100-80g",
                "--nodes",
                "4",
            ],
        }
        print(f"{'command':<40} {'median s':>9} {'/ 0.5 s goal':>13}")
        for name, argv in cases.items():
            seconds = median_seconds(argv, args.repeats)
            print(f"{name:<40} {seconds:>9.3f} {seconds / GOAL_S:>13.2f}")


if __name__ == "__main__":
    main()
