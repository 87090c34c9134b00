"""Where a run stands: the step it trained to and the tokens it trained on (its part of a checkpoint's client state,
``step`` and ``tokens``), the steps of this start, which of them are logged, and the recent steps' seconds."""

from __future__ import annotations

import statistics
from collections import deque

from mhf_dist.config import TrainConfig

RECENT_STEPS = 20  # the steps whose median time stands for a step's (the ETA, a save's grace)


class Progress:
    """Steps of ``train`` (``train.global_batch_size`` sequences of ``seq_len`` tokens each)."""

    def __init__(self, train: TrainConfig, seq_len: int):
        self.step = 0  # the last step trained (before the first: the resumed checkpoint's)
        self.start = 0  # the step this start resumed at
        # the last step of this start
        self.end = min(train.stop_at_step or train.max_steps, train.max_steps)
        self.log_interval, self.tokens_per_step = (
            train.log_interval,
            train.global_batch_size * seq_len,
        )
        self.recent: deque[float] = deque(maxlen=RECENT_STEPS)

    def logged(self, step: int) -> bool:
        """Whether ``step`` is logged: the first, every ``train.log_interval``-th and the last."""
        return step == 1 or step % self.log_interval == 0 or step == self.end

    def stepped(self, step: int, seconds: float) -> None:
        """``step`` was trained, in ``seconds``."""
        self.step = step
        self.recent.append(seconds)

    def step_seconds(self) -> float | None:
        """A step's seconds: the median of the recent steps' (None before the first)."""
        return statistics.median(self.recent) if self.recent else None

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens": self.step * self.tokens_per_step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
