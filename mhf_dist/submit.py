"""``mhf-dist submit``: multi-node jobs from a cluster profile, SLURM or a hostfile.

SLURM: an sbatch script rendered from ``cluster/sbatch.template`` with one
``srun`` task per rank (GPU). Each task learns its rank from SLURM
(``SLURM_PROCID``/``SLURM_LOCALID``/``SLURM_NTASKS``) and rendezvous on the
first node of ``scontrol show hostnames``; so SLURM's ``--signal=USR1@<grace>``
reaches every rank itself, the ranks save and exit with 85, and the script
requeues the job (``--requeue``), which resumes from that checkpoint
(``--resume auto``). ``scontrol requeue`` or preemption (SIGTERM) goes the same
way. Without SLURM, ``--hostfile`` renders a script for DeepSpeed's launcher.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path
from string import Template

from mhf_dist.cluster import PROFILE_DIR, ClusterProfile
from mhf_dist.config import ConfigError, RunConfig
from mhf_dist.train.checkpoint import PREEMPTED_EXIT_CODE
from mhf_dist.train.engine import preflight
from mhf_dist.train.preemption import GRACE_ENV


def _train_args(run_dir: Path, preset: str | None, config: str | None, overrides: list[str]) -> str:
    args = ["--run-dir", str(run_dir)]
    if preset:
        args += ["--preset", preset]
    if config:
        args += ["--config", str(Path(config).resolve())]
    for o in overrides:
        args += ["--set", o]
    return shlex.join(args)


def render(kind: str, cfg: RunConfig, profile: ClusterProfile, nodes: int, run_dir: Path, preset: str | None,
           config: str | None, overrides: list[str], *, grace: int = 120, depends_on: str | None = None,
           hostfile: str | None = None, python: str = sys.executable, workdir: Path | None = None) -> str:
    """The job script (``kind``: ``sbatch`` or ``hostfile``); the layout is checked against the nodes first."""
    if nodes < 1:
        raise ConfigError(f"--nodes={nodes}: need at least one node")
    preflight(cfg, nodes * profile.gpus_per_node, data_here=False)  # nodes × ranks per node must fit tp·pp·dp
    run_dir = run_dir.resolve()
    extra = [f"#SBATCH --{key}={value}" for key, value in (
        ("partition", profile.partition), ("account", profile.account),
        ("gpus-per-node", profile.gpus_per_node if profile.backend == "nccl" else None),
        ("dependency", f"afterany:{depends_on}" if depends_on else None)) if value]
    values = dict(
        profile=profile.name, nodes=nodes, tasks_per_node=profile.gpus_per_node, cpus_per_task=profile.cpus_per_task,
        time=profile.time, job_name=f"mhf-{run_dir.name}", log_dir=run_dir / "slurm", grace=grace,
        extra_sbatch="\n".join(extra), workdir=shlex.quote(str(workdir or Path.cwd())),
        setup="\n".join(profile.setup), exports="\n".join(f"export {k}={shlex.quote(v)}" for k, v in profile.env.items()),
        deepspeed_env="\n".join(f"{k}={v}" for k, v in profile.env.items()), hostfile=hostfile,
        master_port=29500, python=shlex.quote(python), train_args=_train_args(run_dir, preset, config, overrides),
        preempted_exit_code=PREEMPTED_EXIT_CODE, grace_env=GRACE_ENV,
    )
    return Template((PROFILE_DIR / f"{kind}.template").read_text()).substitute(values)


def submit(script: str, run_dir: Path) -> str:
    """``sbatch`` the script (kept in ``RUN/slurm/``); returns the job id."""
    log_dir = run_dir.resolve() / "slurm"
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / "job.sbatch"
    path.write_text(script)
    proc = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True)
    if proc.returncode:
        raise ConfigError(f"sbatch refused the job: {proc.stderr.strip()}")
    return proc.stdout.strip().split(";")[0]
