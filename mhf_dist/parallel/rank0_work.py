"""Work that rank 0 does alone while the other ranks wait for it outside any collective.

A collective waits at most the process group's timeout (``train.dist_timeout_minutes``) before the job is
stopped (NCCL's watchdog, gloo's timeout). Work whose length grows with the model or the data, such as
converting a 13B checkpoint for another layout or preparing a corpus, can outlast any fixed timeout, so the
other ranks do not wait for it in a barrier: they poll for a small file that rank 0 writes when the work ends,
naming its outcome, in a directory every rank sees (the run directory, on storage the job's nodes share, as its
checkpoints are). Only cheap steps are collectives: agreeing on the file's name before, a barrier after.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from mhf_dist.errors import MhfError
from mhf_dist.parallel.scalars import ScalarCollectives

POLL_SECONDS = 0.5


def _outcome_file(where: Path, name: str, token: int) -> Path:
    return where / f".{name}-{token:012x}.done"


def on_rank0(
    work: Callable[[], None],
    where: Path,
    name: str,
    scalars: ScalarCollectives,
    error: type[MhfError] = MhfError,
    worker: bool | None = None,
) -> None:
    """Rank 0 runs ``work()``; every other rank waits until it ended. A failure raises on rank 0 as it was and on
    the others as ``error`` with rank 0's message. ``where``: a directory every rank sees (rank 0 may create it
    in ``work``); ``name``: what the work is, for the outcome file's name. ``worker``: whether this rank does the
    work instead (work each node does for itself, in a node-local ``where``: its first rank)."""
    rank = dist.get_rank()
    who = "rank 0" if worker is None else "the rank doing it"
    worker = rank == 0 if worker is None else worker
    # a fresh name for this start's outcome file, so that no rank mistakes an earlier start's for it
    token = int(
        scalars.from_rank0(float(random.SystemRandom().getrandbits(48)) if rank == 0 else 0.0)
    )
    done = _outcome_file(where, name, token)
    if worker:
        for stale in where.glob(f".{name}-*.done"):  # left by a start whose work failed
            stale.unlink(missing_ok=True)
        try:
            work()
        except BaseException as e:
            _write_outcome(
                done, f"{type(e).__name__}: {e}" if not isinstance(e, MhfError) else str(e)
            )
            raise
        _write_outcome(done, None)
    else:
        while not done.exists():
            time.sleep(POLL_SECONDS)
        message = json.loads(done.read_text())["error"]
        if message is not None:
            raise error(f"{who} failed: {message}")
    dist.barrier()  # every rank has read the outcome
    if worker:
        done.unlink(missing_ok=True)


def _write_outcome(done: Path, error: str | None) -> None:
    done.parent.mkdir(parents=True, exist_ok=True)
    tmp = done.with_suffix(".tmp")
    tmp.write_text(json.dumps({"error": error}))
    tmp.replace(done)  # the others see the whole file or none
