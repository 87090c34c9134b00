"""Preemption: SIGUSR1 (SLURM's warning before the time limit) or SIGTERM (preemption, ``scancel``).

The handler is installed before anything slow starts (imports of the training
stack, data preparation, the model build), so a signal at any moment of a
rank's life is noted instead of killing it: the ranks agree on it, save if
they trained anything, and exit with :data:`PREEMPTED_EXIT_CODE`, which the
job script answers with a requeue. The job script also tells the ranks the
grace period (:data:`GRACE_ENV`), so a save that would not fit in it is
flagged while there is time to act.
"""

from __future__ import annotations

import signal

GRACE_ENV = "MHF_DIST_GRACE_SECONDS"  # set by the job script: seconds between SLURM's warning and the time limit


class StopSignal:
    """SIGUSR1 / SIGTERM on any rank: every rank stops after the current step (the ranks agree each step)."""

    def __init__(self):
        self.received = False
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame):
        self.received = True
