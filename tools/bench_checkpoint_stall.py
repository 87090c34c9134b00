"""Benchmark: how long training stalls per checkpoint save, synchronous against ``train.checkpoint_async``.

Usage: python tools/bench_checkpoint_stall.py [--preset 100m-h4b16k] [--saves 3] [--interval 5] [--seq-len 32]
                                              [--micro 1] [--nproc 1] [--rounds 1]
Each mode is `mhf-dist train` in a fresh process on the embedded text (ZeRO as the layout chooses; fp32 on CPU, the
preset's bf16 on a GPU), one micro-batch per step, a save every ``--interval`` steps (the last one at the end of
training). A save's stall is the time the training loop spent in it, as the run logs it (`saved ... (interval,
1.66 GB in 0.4 s stall, ...)`): the whole save when synchronous, the copy to host memory (and any wait for the save
before) when asynchronous. ``--interval`` should leave each background write the time to finish before the next save, or
that wait counts as stall too. Rounds alternate the modes (sync, async, sync, ...), so a machine whose speed drifts
slows both alike. Reported per mode: the median stall per save, the median background time (async), the checkpoint
size; then the ratio of the median stalls, async / sync.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parents[1]
# rank 0's line for each save (``log_save``): where, why, size, then its time (an asynchronous save's stall and
# background time) and rate
SAVED = re.compile(
    r"^saved (\S+) \((\w+), ([\d.]+) ([MG])B in ([\d.]+) s(?: stall, ([\d.]+) s in the background)?, "
    r"[\d.e+-]+ GB/s per node\)$",
    re.M,
)
MODES = ("sync", "async")


@dataclass
class Save:
    """One save as the run logged it."""

    where: str  # its directory, or its URL in object storage
    size: float  # bytes (as logged: three significant digits)
    stall: float  # seconds training spent in it
    background: float | None  # an asynchronous save's seconds after the stall


def saves_in(log: str) -> list[Save]:
    """The saves a run's console output reports, in order."""
    return [
        Save(
            where,
            float(size) * (1e9 if unit == "G" else 1e6),
            float(stall),
            float(bg) if bg else None,
        )
        for where, _, size, unit, stall, bg in SAVED.findall(log)
    ]


def train(
    run: Path, args, *overrides: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``mhf-dist train`` of ``args.preset`` into ``run``, in a fresh process, its output captured: the embedded text,
    ``args.saves`` saves ``args.interval`` steps apart (the last at the end), ``args.micro`` sequences of
    ``args.seq_len`` tokens per step and rank on ``args.nproc`` ranks, a step logged at each save, fp32 without a GPU;
    then ``overrides`` (``key=value``). ``env``: the process's environment (this one's when None)."""
    settings = [
        "data.path=embedded",
        f"data.seq_len={args.seq_len}",
        f"train.max_steps={args.saves * args.interval}",
        f"train.global_batch_size={args.micro * args.nproc}",
        f"train.micro_batch_size={args.micro}",
        f"train.log_interval={args.interval}",
        f"train.eval_sequences={args.micro * args.nproc}",
        "train.eval_interval=0",
        f"train.checkpoint_interval={args.interval}",
        "train.keep_checkpoints=2",
        *([] if torch.cuda.is_available() else ["train.dtype=fp32"]),
        *overrides,
    ]
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
    for o in settings:
        argv += ["--set", o]
    environ = os.environ if env is None else env
    return subprocess.run(
        argv,
        capture_output=True,
        text=True,
        env=environ | {"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"},
    )


def run_mode(run: Path, asynchronous: bool, args) -> tuple[list[float], list[float], int]:
    """(stall seconds per save, background seconds per save, bytes of the last checkpoint) of one training run."""
    done = train(run, args, f"train.checkpoint_async={str(asynchronous).lower()}")
    saves = saves_in(done.stdout)
    if done.returncode or len(saves) != args.saves:
        raise SystemExit(
            f"expected {args.saves} saves in the {'async' if asynchronous else 'sync'} run's log, "
            f"found {len(saves)}:\n{(done.stdout + done.stderr)[-3000:]}"
        )
    return [s.stall for s in saves], [s.background for s in saves if s.background], saves[-1].size


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="100m-h4b16k")
    parser.add_argument("--saves", type=int, default=3, help="saves per run (the last at its end)")
    parser.add_argument("--interval", type=int, default=5, help="steps between saves")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument(
        "--micro", type=int, default=1, help="sequences per step and rank (one micro-batch)"
    )
    parser.add_argument("--nproc", type=int, default=1, help="ranks")
    parser.add_argument("--rounds", type=int, default=1, help="runs per mode, alternating")
    args = parser.parse_args()
    stalls = {m: [] for m in MODES}
    background, sizes = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for n in tqdm(range(args.rounds * len(MODES)), desc="runs", unit="run"):
            mode = MODES[n % len(MODES)]
            stall, bg, size = run_mode(Path(tmp) / f"{mode}-{n}", mode == "async", args)
            stalls[mode] += stall
            background += bg
            sizes.append(size)
    median = {m: statistics.median(s) for m, s in stalls.items()}
    print(
        f"{args.preset}, {args.nproc} rank(s), {statistics.median(sizes) / 1e9:.2f} GB per save, "
        f"{len(stalls['sync'])} saves per mode"
    )
    print(f"{'mode':<8}{'stall s (median)':>18}{'stalls s':>32}{'background s (median)':>24}")
    print(
        f"{'sync':<8}{median['sync']:>18.2f}{' '.join(f'{s:.1f}' for s in stalls['sync']):>32}{'-':>24}"
    )
    print(
        f"{'async':<8}{median['async']:>18.2f}{' '.join(f'{s:.1f}' for s in stalls['async']):>32}"
        f"{statistics.median(background):>24.2f}"
    )
    print(f"async / sync stall: {median['async'] / median['sync']:.2f}")


if __name__ == "__main__":
    main()
