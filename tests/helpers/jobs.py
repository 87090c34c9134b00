"""A `mhf-dist` command running in the background in a session of its own, as in a terminal: its output is read as
it comes, and signals go to its process group (a terminal's Ctrl-C) or to one of its ranks."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from helpers.runs import CliProcess


class Job:
    def __init__(self, args: list[str], log: Path, **env: str):
        self.log = log
        self.proc = CliProcess(
            args, log, os.environ | {"PYTHONUNBUFFERED": "1"} | env, new_session=True
        )

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, text: str, timeout: float = 300) -> None:
        """Until ``text`` is in the output; fails if the command ends first."""
        deadline = time.time() + timeout
        while text not in self.output:
            assert self.proc.poll() is None, (
                f"ended ({self.proc.returncode}) before {text!r}:\n{self.output[-3000:]}"
            )
            assert time.time() < deadline, f"no {text!r} after {timeout} s:\n{self.output[-3000:]}"
            time.sleep(0.05)

    def ctrl_c(self) -> None:
        """SIGINT to the command's process group, as a terminal sends it."""
        os.killpg(self.proc.pid, signal.SIGINT)

    def ranks(self) -> dict[int, int]:
        """``{rank: pid}`` of the launcher's ranks."""
        return self.proc.rank_pids()

    def end(self, timeout: float = 300) -> tuple[int, str]:
        """Wait for the command to end; its exit code and output."""
        try:
            self.proc.wait(timeout)
        finally:
            self.proc.stop()
        return self.proc.returncode, self.output
