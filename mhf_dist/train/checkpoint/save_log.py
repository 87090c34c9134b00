"""The line each checkpoint save logs (its size, duration and write rate per node) and the warning when a save on
the scheduler's signal would not fit the job's grace period."""

from __future__ import annotations

import os
from pathlib import Path

from tqdm.auto import tqdm

from mhf_dist.remote import is_url
from mhf_dist.train.checkpoint.index import checkpoint_bytes, readable_size
from mhf_dist.train.preemption import GRACE_ENV, grace_seconds


def log_save(
    path: Path,
    reason: str,
    stall: float,
    background: float | None = None,
    step_s: float = 0.0,
    shown: str | None = None,
) -> None:
    """Rank 0: the save with its size, duration (an asynchronous save's ``stall`` of training and its ``background``
    time) and write rate; a warning when a step (``step_s``) and a save like this one would not fit in the job's grace
    period (the time between the scheduler's warning signal and the time limit), naming the grace that would
    (``grace_seconds``). ``shown``: how the checkpoint is named (``path`` itself when None; a URL: the save uploaded
    its files, and the rate named is the upload's)."""
    seconds = stall if background is None else stall + background
    size = checkpoint_bytes(path)
    # the nodes of the job (its scheduler or launcher says)
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", 1))
    per_node = size / max(seconds, 1e-9) / nodes / 1e9
    took = (
        f"{stall:.1f} s"
        if background is None
        else f"{stall:.1f} s stall, {background:.1f} s in the background"
    )
    tqdm.write(
        f"saved {shown or path} ({reason}, {readable_size(size)} in {took}, {per_node:.3g} GB/s per node)"
    )
    grace = float(os.environ.get(GRACE_ENV, "inf"))
    rate = "upload_gb_per_s" if is_url(shown) else "storage_gb_per_s"
    if (needed := grace_seconds(step_s, seconds)) > grace:
        tqdm.write(
            f"warning: a save on SLURM's signal (the step in progress, {step_s:.1f} s, then a save like this "
            f"one) needs a grace of about {needed} s, and this job has {grace:.0f} s: submit with --grace "
            f"{needed}, or set {rate}: {per_node:.3g} (this save's rate) in the cluster profile, "
            "from which submit sizes the grace"
        )
