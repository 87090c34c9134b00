"""Benchmark: what the health metrics (``train.health_metrics``, docs/usage.md "Health metrics") cost a training step.

One process trains one model (one rank, ZeRO-3, the run's own shards) and steps it three ways, side by side in
rounds (each round steps each way once, in a rotating order, so a machine whose speed drifts slows all three alike):

- ``off``: the trainer without the health metrics (as ``train.health_metrics=false``);
- ``ordinary``: with them, on a step that is not logged (the targets' bucket counts only);
- ``logged``: with them, on a logged step (norms per family and block, the update, the forward's statistics, one
  all-reduce).

Reports, in wall seconds and in the process's CPU seconds (the step's work, which other tenants of a shared machine
disturb less), the median step time of each way, the ratios to ``off`` (the median of the rounds' ratios, with their
range), and the cost per step at log intervals 1 and 10: ``((L − 1) · ordinary + logged) / (L · off) − 1``.

Usage: python tools/bench_health.py [--preset 100m-h4b16k] [--rounds 15] [--run-dir DIR] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed loads: a CPU benchmark

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from mhf_dist.config import load_config

WAYS = ("off", "ordinary", "logged")
DEFAULTS = [
    "data.path=embedded",
    "tokenizer.path=null",
    "tokenizer.vocab_size=4096",
    "data.seq_len=128",
    "train.micro_batch_size=1",
    "train.global_batch_size=2",
    "train.dtype=fp32",
    "train.max_steps=1000",
    "train.eval_interval=0",
]


def timed_step(trainer, reader, way: str) -> tuple[float, float]:
    """``(wall seconds, CPU seconds of the process)`` of one step taken ``way``."""
    health = trainer.health
    if way == "off":
        trainer.health = None
    began, cpu = time.perf_counter(), time.process_time()
    stats = trainer.train_step(reader, health=way == "logged")
    seconds = (time.perf_counter() - began, time.process_time() - cpu)
    trainer.health = health
    assert (stats.health is not None) == (way == "logged")
    return seconds


def summary(times: dict[str, list[float]]) -> dict:
    """Medians, ratios to ``off`` (the median of the rounds' ratios, and their range), and the cost per step at log
    intervals 1 and 10."""
    median = {way: statistics.median(t) for way, t in times.items()}
    ratios = {
        way: sorted(t / o for t, o in zip(times[way], times["off"]))
        for way in ("ordinary", "logged")
    }
    found = {
        "median_s": median,
        "ratio_to_off": {w: statistics.median(r) for w, r in ratios.items()},
        "ratio_range": {w: [r[0], r[-1]] for w, r in ratios.items()},
    }
    for interval in (1, 10):
        found[f"cost_at_log_interval_{interval}"] = (
            (interval - 1) * median["ordinary"] + median["logged"]
        ) / (interval * median["off"]) - 1
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="100m-h4b16k")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2, help="steps of each way before the rounds")
    parser.add_argument(
        "--run-dir",
        type=Path,
        help="where the run's tokenizer and shards go (default: a temporary directory)",
    )
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", type=Path, help="also write the results as JSON here")
    args = parser.parse_args()

    from mhf_dist.train.loop import TrainingLoop
    from mhf_dist.train.preemption import StopSignal

    torch.set_num_threads(os.cpu_count() or 1)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=0, world_size=1)
        cfg = load_config(
            args.preset, overrides=DEFAULTS + args.set + ["train.health_metrics=true"]
        )
        loop = TrainingLoop(cfg, StopSignal())
        assert loop.setup(args.run_dir or Path(tmp) / "run", "none")
        trainer, reader = loop.trainer, loop.data
        wall, cpu = {way: [] for way in WAYS}, {way: [] for way in WAYS}
        for _ in tqdm(range(args.warmup), desc="warm-up"):
            for way in WAYS:
                timed_step(trainer, reader, way)
        for r in tqdm(range(args.rounds), desc="rounds"):
            for way in WAYS[r % 3 :] + WAYS[: r % 3]:
                seconds, cpu_seconds = timed_step(trainer, reader, way)
                wall[way].append(seconds)
                cpu[way].append(cpu_seconds)
        reader.close()

    # CPU seconds: the work of the step, which other tenants of a shared machine slow less than its wall time
    result = {
        "preset": args.preset,
        "settings": DEFAULTS + args.set,
        "rounds": args.rounds,
        "wall": summary(wall),
        "cpu": summary(cpu),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
