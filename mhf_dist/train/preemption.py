"""Stopping on a signal: SIGUSR1 (a scheduler's warning before the time limit), SIGTERM (preemption, a cancelled job)
or Ctrl-C (SIGINT).

The handler is installed before anything slow starts (imports of the training stack, data preparation, the model
build), so a signal at any moment of a rank's life is noted instead of killing it: the ranks agree on it, save if they
trained anything, and exit with ``PREEMPTED_EXIT_CODE``, which the job script answers with a requeue. The job
script also tells the ranks the grace period (``GRACE_ENV``), so a save that would not fit in it is flagged while
there is time to act. A first Ctrl-C is taken as SIGTERM is (during start-up, with no step to finish and nothing
trained, the note says the ranks stop without a checkpoint); a second aborts at once without saving
(``ABORTED_EXIT_CODE``) and says what that loses: the steps since the newest checkpoint, which the next start
resumes from.
"""

from __future__ import annotations

import math
import os
import signal
from collections.abc import Callable

from mhf_dist.errors import ABORTED_EXIT_CODE
from mhf_dist.storage.run_dir import RunDir
from mhf_dist.train.checkpoint.store import saved_checkpoints

MIN_GRACE_SECONDS = 120
GRACE_SAFETY = 1.5  # slow storage days
EXIT_SECONDS = 30
GRACE_ENV = "MHF_DIST_GRACE_SECONDS"  # set by the job script: seconds between the scheduler's warning and its limit
INTERRUPT_NOTE = (
    "interrupted: finishing this step, then saving (Ctrl-C again aborts without saving)"
)
# before the first step there is no step to finish and nothing trained to save: set-up ends at the check after the
# model build, and the ranks exit for a requeue
START_UP_INTERRUPT_NOTE = (
    "interrupted during start-up: stopping once the model is built, before the first step and "
    "without a checkpoint (Ctrl-C again aborts at once)"
)


def grace_seconds(step_s: float, save_s: float) -> int:
    """The grace period that fits a step and a save after the scheduler's warning: ``1.5 · (step + save) + 30 s``,
    rounded up to ten seconds, at least ``MIN_GRACE_SECONDS``."""
    needed = GRACE_SAFETY * (step_s + save_s) + EXIT_SECONDS
    return max(MIN_GRACE_SECONDS, 10 * math.ceil(needed / 10))


def lost_work(run: RunDir, checkpoint_minutes: float | None) -> str:
    """What stopping now without a save loses, and where the next start (``--resume auto``) continues from."""
    saved = saved_checkpoints(run)
    if saved:
        note = (
            f"the steps since {saved[-1].name} are lost; rerun the same command to resume from it"
        )
    else:
        note = "no checkpoint was saved yet; rerunning the same command starts again from step 0"
    if checkpoint_minutes:
        note += f" (train.checkpoint_minutes={checkpoint_minutes:g} bounds such a loss to {checkpoint_minutes:g} min)"
    return note


def say_on_rank0(line: str) -> None:
    """``line`` on stderr from rank 0 only (every rank gets a terminal's Ctrl-C under torchrun), written in one
    system call: a signal handler must not re-enter the buffered stream the interrupted code may be writing."""
    if os.environ.get("RANK", "0") == "0":
        os.write(2, f"{line}\n".encode())


class StopSignal:
    """SIGUSR1 / SIGTERM on any rank: every rank stops after the current step (the ranks agree each step).

    With ``lost_work`` (a note of what an abort loses), Ctrl-C too: the first is a stop like SIGTERM
    (``interrupted`` says so), the second ends this process at once without saving."""

    def __init__(self, lost_work: Callable[[], str] | None = None):
        self.received = False
        self.interrupted = False
        self.training = (
            False  # set by ``start_up_ends``: a first Ctrl-C finishes a step and saves from then on
        )
        self._lost_work = lost_work
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, self._handle)
        if (
            lost_work is not None
        ):  # otherwise (an embedding program, a test process) Ctrl-C stays its own
            signal.signal(signal.SIGINT, self._interrupt)

    def start_up_ends(self, stopping: bool) -> bool:
        """``stopping``: whether the ranks agreed at the end of start-up that a signal stops them (without a save);
        returned. When they go on, a signal from now on finishes a step and saves."""
        self.training = not stopping
        return stopping

    def ignore(self) -> None:
        """From now on SIGUSR1 and SIGTERM are ignored, also while the interpreter shuts down (which restores the
        default action, death, of a signal with a handler)."""
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)

    def _handle(self, signum, _frame):
        self.received = True

    def _interrupt(self, signum, frame):
        if self.interrupted:
            say_on_rank0(f"aborted without saving: {self._lost_work()}")
            # now: no collective, no save, no interpreter shutdown to wait for
            os._exit(ABORTED_EXIT_CODE)
        self.interrupted = True
        self._handle(signum, frame)
        say_on_rank0(INTERRUPT_NOTE if self.training else START_UP_INTERRUPT_NOTE)
