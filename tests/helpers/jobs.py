"""A `mhf-dist` command running in the background in a session of its own, as in a terminal: its output is read as
it comes, and signals go to its process group (a terminal's Ctrl-C) or to one of its ranks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and has not ended (a zombie, ended but not yet reaped, counts as ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Job:
    def __init__(self, args: list[str], log: Path, **env: str):
        self.log = log
        with log.open("wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "mhf_dist", *args], stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         env=os.environ | {"PYTHONUNBUFFERED": "1"} | env)

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, text: str, timeout: float = 300) -> None:
        """Until ``text`` is in the output; fails if the command ends first."""
        deadline = time.time() + timeout
        while text not in self.output:
            assert self.proc.poll() is None, f"ended ({self.proc.returncode}) before {text!r}:\n{self.output[-3000:]}"
            assert time.time() < deadline, f"no {text!r} after {timeout} s:\n{self.output[-3000:]}"
            time.sleep(0.05)

    def ctrl_c(self) -> None:
        """SIGINT to the command's process group, as a terminal sends it."""
        os.killpg(self.proc.pid, signal.SIGINT)

    def ranks(self) -> dict[int, int]:
        """``{rank: pid}`` of the launcher's child processes (read from /proc)."""
        found = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
                environ = (stat.parent / "environ").read_bytes().split(b"\0")
            except (OSError, IndexError):
                continue
            rank = next((v[5:] for v in environ if v.startswith(b"RANK=")), None)
            if parent == self.proc.pid and rank is not None:
                found[int(rank)] = int(stat.parent.name)
        return found

    def end(self, timeout: float = 300) -> tuple[int, str]:
        """Wait for the command to end; its exit code and output."""
        try:
            self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
        return self.proc.returncode, self.output
