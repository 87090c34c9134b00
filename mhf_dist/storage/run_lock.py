"""One job per run directory: ``RUN/lock.json`` names the job that trains in it (``RunLock``).

Two jobs in one run directory would overwrite each other's config and checkpoints, so rank 0 takes the lock before
it writes anything and releases it when the run ends. The lock records the host, the pid, the scheduler's job id
(``JOB_ID_ENV``, when there is one) and the start time; a thread refreshes its modification time every
``HEARTBEAT_S`` seconds. It is stale, and taken over with a warning, when its process is gone (same host), when an
earlier run of the same scheduler job took it (a requeue), or when its heartbeat stopped over ``STALE_S`` seconds
ago (a crashed node); a live holder makes the start fail with ``RunDirLocked``. ``status`` calls its holder gone
sooner (``holder_gone``): the process is not running (same host) or the heartbeat missed ``MISSED_BEATS`` refreshes.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

from mhf_dist.atomic import write_atomic
from mhf_dist.errors import MhfError
from mhf_dist.storage.run_dir import RunDir

JOB_ID_ENV = (
    "MHF_DIST_JOB_ID"  # the scheduler's job id, set in the environment of each task of a job's step
)
HEARTBEAT_S = 30
STALE_S = 300  # a heartbeat this old lets another job take the lock over (a busy filesystem may delay a few)
MISSED_BEATS = 3  # a heartbeat this many intervals old tells status the holder is gone


class RunDirLocked(MhfError, RuntimeError):
    """Another live job trains in this run directory."""


def running(pid: int) -> bool:
    """Whether process ``pid`` runs: it exists and is not a zombie (one that exited but that its parent, or the init
    process a killed job's ranks fall to, has not reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    if not Path("/proc/self/stat").exists():  # no /proc (not Linux): what kill said
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:  # it ended meanwhile
        return False


def _exited(holder: dict) -> str | None:
    """Why ``holder``'s process no longer runs when it ran on this host, else None (running, or on another host)."""
    host = socket.gethostname()
    if holder.get("host") == host and not running(int(holder.get("pid", 0))):
        return f"process {holder.get('pid')} on {host} has exited"
    return None


def holder_gone(holder: dict, age_s: float) -> str | None:
    """Why the job holding a lock (heartbeat ``age_s`` seconds ago) is gone as far as this host can tell, or None
    while it may be alive: its process is not running here, or its heartbeat missed ``MISSED_BEATS`` refreshes."""
    if (exited := _exited(holder)) is not None:
        return exited
    if age_s > MISSED_BEATS * HEARTBEAT_S:
        return f"its heartbeat missed over {MISSED_BEATS} refreshes (a live job refreshes it every {HEARTBEAT_S} s)"
    return None


def _owner() -> dict:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "slurm_job_id": os.environ.get(JOB_ID_ENV),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


class RunLock:
    """The lock of run directory ``run``."""

    def __init__(self, run: RunDir):
        self.path = run.lock_path
        self._stop = threading.Event()

    def stale_reason(self, holder: dict, age_s: float) -> str | None:
        """Why ``holder``'s lock (heartbeat ``age_s`` seconds ago) no longer holds, or None if it does."""
        me = _owner()
        if holder.get("slurm_job_id") and holder.get("slurm_job_id") == me["slurm_job_id"]:
            return f"it was taken by an earlier run of this SLURM job ({me['slurm_job_id']})"
        if (exited := _exited(holder)) is not None:
            return exited
        if age_s > STALE_S:
            return f"its heartbeat stopped {age_s / 60:.0f} minutes ago"
        return None

    def acquire(self) -> str | None:
        """Take the lock; returns a warning when a stale lock was taken over. Raises ``RunDirLocked``."""
        warning = None
        try:
            holder = json.loads(self.path.read_text())
        except FileNotFoundError:
            holder = None
        except (OSError, ValueError):  # a torn write: nobody holds it in a readable way
            holder = {}
        if holder is not None:
            age = time.time() - self.path.stat().st_mtime
            reason = self.stale_reason(holder, age)
            if reason is None:
                job = f", SLURM job {holder['slurm_job_id']}" if holder.get("slurm_job_id") else ""
                raise RunDirLocked(
                    f"{self.path.parent} is in use by process {holder.get('pid')} on {holder.get('host')}{job} "
                    f"(started {holder.get('started')}, alive {age:.0f} s ago): wait for that job, stop it, or use "
                    f"another --run-dir (a lock counts as stale {STALE_S // 60} minutes after its last heartbeat)"
                )
            warning = f"taking over the lock of {self.path.parent}: {reason}"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if (
            holder is None
        ):  # exclusive create: of two jobs starting at once, one gets it, the other judges it
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return self.acquire()
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(_owner()))
        else:
            write_atomic(self.path, json.dumps(_owner()), durable=False)
        threading.Thread(target=self._heartbeat, name="run-lock-heartbeat", daemon=True).start()
        return warning

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                return

    def release(self) -> None:
        self._stop.set()
        try:
            if json.loads(self.path.read_text()).get("pid") == os.getpid():
                self.path.unlink()
        except (OSError, ValueError):
            pass
