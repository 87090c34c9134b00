"""``train.checkpoint_minutes``: saves by the clock as well as by steps."""

from __future__ import annotations

import time
from pathlib import Path

from mhf_dist.train.callbacks import Callback, RunContext


class SaveClock(Callback):
    """A save is due once ``minutes`` passed since the last one (or the start); the ranks agree on it each step, so a
    slow clock on one rank cannot split the job."""

    save_reason = "time"

    def __init__(self, minutes: float | None):
        self.seconds = None if minutes is None else minutes * 60
        self.since = time.monotonic()

    def on_start(self, run: RunContext) -> None:
        self.since = time.monotonic()

    def wants_save(self) -> bool:
        return self.seconds is not None and time.monotonic() - self.since >= self.seconds

    def after_save(self, step: int, path: Path) -> None:
        self.since = time.monotonic()
