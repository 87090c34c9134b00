"""Faults the test suite injects into steps, evaluations, checkpoint saves and conversions, through environment
variables a test sets for the ranks it starts; nothing here acts unless its variable is set. A step's faults act
through callbacks (``injected_faults``), a change to its numbers through the loss wrapper the trainer is built with.

- ``SAVE_PAUSE_ENV``: seconds a save stalls after its files, before it is marked complete (a rank is killed there).
- ``CONVERT_PAUSE_ENV``: seconds a conversion for another layout takes longer (past the process group's timeout).
- ``SAVE_FAIL_ENV``: the rank whose checkpoint writes fail as on a full disk.
- ``DISK_BYTES_ENV``: the capacity, in bytes, of a simulated filesystem holding the checkpoints.
- ``SLOW_RANK_ENV``, ``SLOW_DEVICE_ENV``: ``RANK:FRACTION``: that rank computes ``FRACTION`` more in each step
  (a straggler), or its device probe times ``FRACTION`` more products (a device slower at the same work).
- ``SLOW_WORK_ENV``: ``KIND:SECONDS[,...]``: healthy work that takes longer: ``first_step`` (a start's first step,
  as a compile does), ``eval_batch`` (each evaluation micro-batch), ``checkpoint_file`` (each checkpoint file).
- ``LOSS_SPIKE_ENV``: ``SAMPLE:FACTOR[,...]``: the loss of the step whose global batch holds sample ``SAMPLE``
  times ``FACTOR`` on every rank: a spike that comes with its data, so a run that skips that data never meets it again.
- ``OOM_ENV``: ``RANK:STEP``: that rank's step runs out of memory (``torch.OutOfMemoryError`` raised in its loss).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

from mhf_dist.train.callbacks import Callback, RunContext, Stepped

if TYPE_CHECKING:
    import torch

SAVE_PAUSE_ENV = "MHF_DIST_TEST_SAVE_PAUSE"
CONVERT_PAUSE_ENV = "MHF_DIST_TEST_CONVERT_PAUSE"
SAVE_FAIL_ENV = "MHF_DIST_TEST_SAVE_FAIL_RANK"
DISK_BYTES_ENV = "MHF_DIST_TEST_DISK_BYTES"
SLOW_RANK_ENV = "MHF_DIST_TEST_SLOW_RANK"
SLOW_DEVICE_ENV = "MHF_DIST_TEST_SLOW_DEVICE"
LOSS_SPIKE_ENV = "MHF_DIST_TEST_LOSS_SPIKE"
SLOW_WORK_ENV = "MHF_DIST_TEST_SLOW_WORK"
OOM_ENV = "MHF_DIST_TEST_OOM"


def _pause(variable: str) -> None:
    if os.environ.get(variable):
        time.sleep(float(os.environ[variable]))


def pause_save() -> None:
    """A save's stall between its files and its marker (``SAVE_PAUSE_ENV``)."""
    _pause(SAVE_PAUSE_ENV)


def pause_conversion() -> None:
    """A conversion's extra time (``CONVERT_PAUSE_ENV``)."""
    _pause(CONVERT_PAUSE_ENV)


def slow_work(kind: str) -> None:
    """The extra seconds ``SLOW_WORK_ENV`` gives work of ``kind``, slept here."""
    for item in filter(None, os.environ.get(SLOW_WORK_ENV, "").split(",")):
        name, seconds = item.split(":")
        if name == kind:
            time.sleep(float(seconds))


def write_fails(rank: int, path: Path) -> bool:
    """Whether writing checkpoint file ``path`` on ``rank`` fails as on a full disk: the rank named by
    ``SAVE_FAIL_ENV``, or a simulated filesystem (``DISK_BYTES_ENV``) that the checkpoints directory (the
    parent of ``path``'s step directory) has filled."""
    if os.environ.get(SAVE_FAIL_ENV) == str(rank):
        return True
    return DISK_BYTES_ENV in os.environ and free_bytes(path.parent.parent) <= 0


def free_bytes(directory: Path) -> int:
    """Free space on ``directory``'s filesystem; under ``DISK_BYTES_ENV``, what that capacity leaves beside the
    files in ``directory``."""
    if DISK_BYTES_ENV in os.environ:
        return int(os.environ[DISK_BYTES_ENV]) - sum(
            f.stat().st_size for f in directory.rglob("*") if f.is_file()
        )
    return shutil.disk_usage(directory).free


def _slowed_by(variable: str, rank: int) -> float:
    """The fraction by which ``variable`` (``RANK:FRACTION``) slows ``rank``: 0 when unset or for another rank."""
    if not os.environ.get(variable):
        return 0.0
    slow, fraction = os.environ[variable].split(":")
    return float(fraction) if int(slow) == rank else 0.0


class SlowRank(Callback):
    """The straggler of ``SLOW_RANK_ENV``: after a step of so many CPU seconds, it computes for that fraction of
    them again (busy, as a slower device or a starved host would be), inside the straggler watch's measure."""

    def on_start(self, run: RunContext) -> None:
        self.fraction = _slowed_by(SLOW_RANK_ENV, run.job.rank)

    def before_step(self, step: int) -> None:
        self.began = time.thread_time()

    def after_step(self, step: int, stepped: Stepped) -> None:
        until = time.thread_time() + self.fraction * (time.thread_time() - self.began)
        while time.thread_time() < until:
            pass


class SlowWork(Callback):
    """The longer healthy work of ``SLOW_WORK_ENV`` in the loop: a start's first step, each evaluation
    micro-batch."""

    def on_start(self, run: RunContext) -> None:
        self.first = run.progress.start + 1

    def after_step(self, step: int, stepped: Stepped) -> None:
        if step == self.first:
            slow_work("first_step")

    def eval_progress(self) -> None:
        slow_work("eval_batch")


def slow_device_repeats(rank: int, products: int) -> int:
    """How many products the device probe times: ``products``, or for the slow device of ``SLOW_DEVICE_ENV``
    that many more by its fraction."""
    return round(products * (1 + _slowed_by(SLOW_DEVICE_ENV, rank)))


class LossSpikes(Callback):
    """The spikes of ``LOSS_SPIKE_ENV``: the loss of a step whose ``batch`` global positions hold a listed sample
    is multiplied by its factor (the data's position read before each step: one directory's reader, as a mixture
    has no single global order)."""

    def __init__(self, batch: int):
        self.batch, self.factor = batch, 1.0
        self.spikes = [
            (int(sample), float(factor))
            for sample, factor in (
                item.split(":") for item in os.environ[LOSS_SPIKE_ENV].split(",")
            )
        ]

    def on_start(self, run: RunContext) -> None:
        self.data = run.data

    def before_step(self, step: int) -> None:
        first = self.data.global_position()
        self.factor = next(
            (factor for sample, factor in self.spikes if first <= sample < first + self.batch), 1.0
        )

    def wrap_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.factor == 1.0 else loss * self.factor


class InjectedOutOfMemory(Callback):
    """The step of ``OOM_ENV`` (``RANK:STEP``) runs out of memory on that rank: its first micro-batch's loss raises
    torch's out-of-memory error, inside the step as a failed allocation would."""

    def __init__(self):
        self.rank, self.at = (int(n) for n in os.environ[OOM_ENV].split(":"))
        self.step = 0

    def on_start(self, run: RunContext) -> None:
        self.mine = run.job.rank == self.rank

    def before_step(self, step: int) -> None:
        self.step = step

    def wrap_loss(self, loss: torch.Tensor) -> torch.Tensor:
        if self.mine and self.step == self.at:
            import torch

            raise torch.OutOfMemoryError(
                f"injected ({OOM_ENV}={os.environ[OOM_ENV]}): out of memory in step {self.step}"
            )
        return loss


def injected_faults(batch: int) -> list[Callback]:
    """The callbacks of the step faults the environment asks for, in a run of global batches of ``batch``."""
    wanted = (
        (SLOW_RANK_ENV, SlowRank),
        (SLOW_WORK_ENV, SlowWork),
        (LOSS_SPIKE_ENV, lambda: LossSpikes(batch)),
        (OOM_ENV, InjectedOutOfMemory),
    )
    return [make() for variable, make in wanted if os.environ.get(variable)]
