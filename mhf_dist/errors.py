"""Errors a user can act on, and the exit codes the command line and job scripts agree on.

Every error that names a problem and its fix derives from ``MhfError``;
the command line prints it without a traceback and exits with
``ERROR_EXIT_CODE``. This module imports nothing, so every layer can use it.
"""

ERROR_EXIT_CODE = 2  # bad input: the message names the problem and the fix
PREEMPTED_EXIT_CODE = (
    85  # "saved and stopped on a signal; requeue me" (cluster scripts test for it)
)
RANK_LOST_EXIT_CODE = (
    86  # a rank died (killed, crashed): the others stopped without saving; rerun to resume
)
HUNG_EXIT_CODE = (
    87  # no progress for train.hang_timeout_s: stacks written, nothing saved; requeue to resume
)
NODE_LOST_EXIT_CODE = (
    88  # ranks stopped answering (their heartbeats) for train.peer_timeout_s: a lost node
)
OOM_EXIT_CODE = (
    89  # a step ran out of memory: reports in RUN/oom/; not requeued, it would run out again
)
ABORTED_EXIT_CODE = (
    130  # a second Ctrl-C: stopped at once without saving (128 + SIGINT, as shells report it)
)


class MhfError(Exception):
    """A problem with the user's input, files or run directory, described for the user."""


class ConfigError(MhfError, ValueError):
    """A run configuration is invalid; the message names the field and the fix."""
