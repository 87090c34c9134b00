"""Faults the test suite injects into checkpoint saves and conversions, through environment variables a test sets
for the ranks it starts. Nothing here acts unless its variable is set: a run never has them.

- :data:`SAVE_PAUSE_ENV`: seconds a save stalls after its files, before it is marked complete (crash-safety tests
  kill a rank there).
- :data:`CONVERT_PAUSE_ENV`: seconds a conversion for another layout takes longer (it must outlast the process
  group's timeout without any rank waiting in a collective).
- :data:`SAVE_FAIL_ENV`: the rank whose checkpoint writes fail as on a full disk.
- :data:`DISK_BYTES_ENV`: the capacity, in bytes, of a simulated filesystem holding the checkpoints; writes fail
  once the checkpoints fill it.
- :data:`SLOW_RANK_ENV`: ``RANK:FRACTION``: that rank computes ``FRACTION`` more in each step (a straggler).
- :data:`SLOW_DEVICE_ENV`: ``RANK:FRACTION``: that rank's device probe computes ``FRACTION`` more products in its
  timed chain (a device that takes longer for the same work).
- :data:`SLOW_WORK_ENV`: ``KIND:SECONDS[,KIND:SECONDS...]``: healthy work that takes longer: ``first_step`` (a
  start's first step, as a compile does), ``eval_batch`` (each evaluation micro-batch), ``checkpoint_file`` (each
  checkpoint file, as on a slow filesystem).
- :data:`LOSS_SPIKE_ENV`: ``SAMPLE:FACTOR[,SAMPLE:FACTOR...]``: the loss (and so the gradients) of the step whose
  global batch holds global sample position ``SAMPLE`` multiplied by ``FACTOR`` on every rank: a loss spike that comes
  with its data, so a run that skips that data does not meet it again.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

SAVE_PAUSE_ENV = "MHF_DIST_TEST_SAVE_PAUSE"
CONVERT_PAUSE_ENV = "MHF_DIST_TEST_CONVERT_PAUSE"
SAVE_FAIL_ENV = "MHF_DIST_TEST_SAVE_FAIL_RANK"
DISK_BYTES_ENV = "MHF_DIST_TEST_DISK_BYTES"
SLOW_RANK_ENV = "MHF_DIST_TEST_SLOW_RANK"
SLOW_DEVICE_ENV = "MHF_DIST_TEST_SLOW_DEVICE"
LOSS_SPIKE_ENV = "MHF_DIST_TEST_LOSS_SPIKE"
SLOW_WORK_ENV = "MHF_DIST_TEST_SLOW_WORK"


def _pause(variable: str) -> None:
    if os.environ.get(variable):
        time.sleep(float(os.environ[variable]))


def pause_save() -> None:
    """A save's stall between its files and its marker (:data:`SAVE_PAUSE_ENV`)."""
    _pause(SAVE_PAUSE_ENV)


def pause_conversion() -> None:
    """A conversion's extra time (:data:`CONVERT_PAUSE_ENV`)."""
    _pause(CONVERT_PAUSE_ENV)


def slow_work(kind: str) -> None:
    """The extra seconds :data:`SLOW_WORK_ENV` gives work of ``kind``, slept here."""
    for item in filter(None, os.environ.get(SLOW_WORK_ENV, "").split(",")):
        name, seconds = item.split(":")
        if name == kind:
            time.sleep(float(seconds))


def write_fails(rank: int, path: Path) -> bool:
    """Whether writing checkpoint file ``path`` on ``rank`` fails as on a full disk: the rank named by
    :data:`SAVE_FAIL_ENV`, or a simulated filesystem (:data:`DISK_BYTES_ENV`) that the checkpoints directory (the
    parent of ``path``'s step directory) has filled."""
    if os.environ.get(SAVE_FAIL_ENV) == str(rank):
        return True
    return DISK_BYTES_ENV in os.environ and free_bytes(path.parent.parent) <= 0


def free_bytes(directory: Path) -> int:
    """Free space on ``directory``'s filesystem; under :data:`DISK_BYTES_ENV`, what that capacity leaves beside the
    files in ``directory``."""
    if DISK_BYTES_ENV in os.environ:
        return int(os.environ[DISK_BYTES_ENV]) - sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
    return shutil.disk_usage(directory).free


def _slowed_by(variable: str, rank: int) -> float:
    """The fraction by which ``variable`` (``RANK:FRACTION``) slows ``rank``: 0 when unset or for another rank."""
    if not os.environ.get(variable):
        return 0.0
    slow, fraction = os.environ[variable].split(":")
    return float(fraction) if int(slow) == rank else 0.0


def slow_step(rank: int, compute_s: float) -> None:
    """The straggler of :data:`SLOW_RANK_ENV`: after a step of ``compute_s`` CPU seconds, it computes for that
    fraction of them again (busy, as a slower device or a starved host would be)."""
    if fraction := _slowed_by(SLOW_RANK_ENV, rank):
        until = time.thread_time() + fraction * compute_s
        while time.thread_time() < until:
            pass


def slow_device_repeats(rank: int, products: int) -> int:
    """How many products the device probe times: ``products``, or for the slow device of :data:`SLOW_DEVICE_ENV`
    that many more by its fraction."""
    return round(products * (1 + _slowed_by(SLOW_DEVICE_ENV, rank)))


def loss_scale(first: Callable[[], int], batch: int) -> float:
    """What the loss of a step reading global positions ``first()`` onward (``batch`` of them) is multiplied by: the
    factor of a sample of :data:`LOSS_SPIKE_ENV` among them, else 1 (``first`` is asked only when the variable is
    set)."""
    if not os.environ.get(LOSS_SPIKE_ENV):
        return 1.0
    start = first()
    spikes = [item.split(":") for item in os.environ[LOSS_SPIKE_ENV].split(",")]
    return next((float(factor) for sample, factor in spikes if start <= int(sample) < start + batch), 1.0)
