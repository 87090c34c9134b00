"""A private single-node SLURM (munge + slurmctld + slurmd on localhost) for the scheduler tests.

Everything lives in one directory: config, state, spool, logs, pid files and the
munge socket. Sandboxes such as gVisor offer no usable cgroups, so processes are
tracked with proctrack/linuxproc and tasks are not confined (task/none). Clients find it through ``SLURM_CONF``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from mhf_dist.parallel.rendezvous import free_port
from mhf_dist.storage.run_dir import RunDir

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue")


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None]


class LocalSlurm:
    """One node, ``localhost``, and its controller on 127.0.0.1 (subclasses place nodes elsewhere)."""

    controller = "localhost(127.0.0.1)"
    slurmd_timeout_s = 300  # SLURM's default: how long a silent node takes to be declared down

    def __init__(self, root: Path, cpus: int = 2):
        self.root, self.cpus = root, cpus
        self.conf = root / "slurm.conf"
        self.env = os.environ | {"SLURM_CONF": str(self.conf)}
        self.procs: list[subprocess.Popen] = []

    def nodes(self) -> dict[str, str]:
        """``{node name: its address}``."""
        return {"localhost": "127.0.0.1"}

    def slurmd_command(self, node: str) -> list[str]:
        """How node ``node``'s slurmd starts (in the foreground)."""
        return ["slurmd", "-D", "-N", node, "-f", str(self.conf)]

    def start(self) -> "LocalSlurm":
        r = self.root
        for d in ("munge/socket", "munge/key", "state", "spool", "log"):
            (r / d).mkdir(parents=True, exist_ok=True)
        os.chmod(r / "munge" / "key", 0o700)
        os.chmod(r / "munge" / "socket", 0o755)  # o+x for clients
        key = r / "munge/key/munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        munge_socket = r / "munge/socket/munge.socket"
        self._run(
            [
                "munged",
                "--force",
                f"--key-file={key}",
                f"--socket={munge_socket}",
                f"--pid-file={r / 'munge/munged.pid'}",
                f"--log-file={r / 'log/munged.log'}",
                f"--seed-file={r / 'munge/seed'}",
            ]
        )
        # ports of its own: a cluster still shutting down (or another test's) never holds the next one's
        self.conf.write_text(
            f"""ClusterName=mhftest
SlurmctldHost={self.controller}
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
StateSaveLocation={r / "state"}
SlurmdSpoolDir={r / "spool"}/%n
SlurmctldPidFile={r / "slurmctld.pid"}
SlurmdPidFile={r / "slurmd-%n.pid"}
SlurmctldLogFile={r / "log/slurmctld.log"}
SlurmdLogFile={r / "log/slurmd-%n.log"}
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmdTimeout={self.slurmd_timeout_s}
KillWait=60
MinJobAge=3600
SchedulerType=sched/builtin
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
"""
            + "".join(
                f"NodeName={name} NodeAddr={addr} CPUs={self.cpus} State=UNKNOWN\n"
                for name, addr in self.nodes().items()
            )
            + f"PartitionName=debug Nodes={','.join(self.nodes())} Default=YES MaxTime=INFINITE State=UP\n"
        )
        self.procs.append(
            subprocess.Popen(
                ["slurmctld", "-D", "-f", str(self.conf)],
                env=self.env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        for node in self.nodes():
            self.procs.append(
                subprocess.Popen(
                    self.slurmd_command(node),
                    env=self.env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        self.wait_until_up()
        return self

    def wait_until_up(self, timeout: float = 60) -> None:
        """Until every node is in service (RuntimeError with the daemons' logs after ``timeout`` seconds)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            out = subprocess.run(
                ["sinfo", "-h", "-N", "-o", "%T"], env=self.env, capture_output=True, text=True
            ).stdout
            if out.split() and all(
                state in ("idle", "mixed", "allocated") for state in out.split()
            ):
                return
            time.sleep(0.5)
        raise RuntimeError(f"SLURM did not come up: {self.log_tail()}")

    def _run(self, cmd: list[str]) -> None:
        subprocess.run(cmd, env=self.env, check=True, capture_output=True)

    def scontrol(self, *args: str) -> str:
        return subprocess.run(
            ["scontrol", *args], env=self.env, capture_output=True, text=True, check=True
        ).stdout

    def job_state(self, job: str) -> dict:
        out = self.scontrol("show", "job", job)
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def log_tail(self) -> str:
        logs = ["slurmctld.log", *(f"slurmd-{node}.log" for node in self.nodes())]
        return "\n".join(
            (self.root / "log" / f).read_text()[-2000:]
            for f in logs
            if (self.root / "log" / f).exists()
        )

    def story(self, job: str, run: Path) -> str:
        """SLURM's view of ``job``, its log in ``run``, the processes of SLURM and the ranks, and the daemons' log
        tails: why a job did not get somewhere."""
        log = job_log(run)
        ps = subprocess.run(
            ["ps", "-eo", "pid,stat,etime,time,args"], capture_output=True, text=True
        ).stdout
        squeue = subprocess.run(["squeue"], env=self.env, capture_output=True, text=True).stdout
        return (
            f"job {job}: {self.scontrol('show', 'job', job)}\njob log:\n{log[-4000:]}\nsqueue: {squeue}\n"
            "processes:\n"
            + "\n".join(line for line in ps.splitlines() if "mhf" in line or "slurm" in line)
            + f"\ndaemons:\n{self.log_tail()}"
        )

    def stop(self) -> None:
        # end every job first: ranks of a job left running (a failed test's) would take the cores of the next tests
        jobs = subprocess.run(
            ["squeue", "-h", "-o", "%i"], env=self.env, capture_output=True, text=True
        ).stdout.split()
        if jobs:
            subprocess.run(
                ["scancel", "--full", "--signal=KILL", *jobs], env=self.env, capture_output=True
            )
            deadline = time.time() + 30
            while (
                time.time() < deadline
                and subprocess.run(
                    ["squeue", "-h"], env=self.env, capture_output=True, text=True
                ).stdout.strip()
            ):
                time.sleep(0.5)
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        pid = self.root / "munge/munged.pid"
        if pid.exists():
            subprocess.run(["kill", pid.read_text().strip()], capture_output=True)


def job_log(run: Path) -> str:
    """The job logs SLURM wrote in ``run``'s job directory, oldest job first."""
    return "".join(p.read_text() for p in sorted(RunDir(run).jobs_dir.glob("*.out")))


def wait_for(predicate, timeout: float, what: str, explain=None):
    """``predicate()``'s first true value within ``timeout`` seconds; else a failure naming ``what``, followed by
    what ``explain()`` tells (e.g. ``LocalSlurm.story``)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if value := predicate():
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}" + (f"\n{explain()}" if explain else ""))


def submit_job(cluster: LocalSlurm, train: list[str], nodes: str) -> str:
    """``mhf-dist submit`` on ``cluster`` (the cpu-local profile) of a ``train`` command's arguments (its
    ``--nproc-per-node`` left out: the profile places the ranks), on ``nodes`` (``N`` or ``MIN-MAX``); the job id."""
    flags = [
        a
        for i, a in enumerate(train[1:], 1)
        if a != "--nproc-per-node" and train[i - 1] != "--nproc-per-node"
    ]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mhf_dist",
            "submit",
            "--cluster",
            "cpu-local",
            "--nodes",
            nodes,
            *flags,
        ],
        env=cluster.env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return re.search(r"submitted job (\d+)", proc.stdout).group(1)
