"""``train.checkpoint_minutes``: saves by the clock as well as by steps."""

from __future__ import annotations

import time


class SaveClock:
    """``train.checkpoint_minutes``: a save is due once that long passed since the last one (or the start); the
    ranks agree on it each step, so a slow clock on one rank cannot split the job."""

    def __init__(self, minutes: float | None):
        self.seconds = None if minutes is None else minutes * 60
        self.reset()

    def reset(self) -> None:
        self.since = time.monotonic()

    @property
    def due(self) -> bool:
        return self.seconds is not None and time.monotonic() - self.since >= self.seconds
