"""SLURM: the training job script, the data-preparation array and merge jobs, their submission, a job's state, and
what each ``srun`` task is told.

The training script is rendered from ``sbatch.template`` with one ``srun`` task per rank; each task takes its rank
from SLURM (``Slurm.task_env``), the ranks rendezvous on the first node of ``scontrol show hostnames``, and a job
stopped by ``--signal=USR1@<grace>``, ``scontrol requeue`` or preemption saves, exits 85 and is requeued.
``submit-data`` renders an array job (``prepare-data --part I/N``) and a merge job (``--dependency=afterok``) from
``prepare-data.template``. Every value a user chose is quoted, or refused with the reason where no quoting makes it
safe. A job's state comes from ``scontrol``, then ``sacct``, each within ``QUERY_TIMEOUT_S``. The job script in
full: docs/clusters.md ("Clusters and submit"); data preparation: docs/data.md.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path, PurePath, PurePosixPath
from string import Template
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, field_validator

from mhf_dist.cluster.files import PROFILE_DIR, no_control_characters
from mhf_dist.cluster.scheduler import JobState, register
from mhf_dist.errors import ConfigError
from mhf_dist.storage.heartbeats import NODE_ENV
from mhf_dist.storage.run_dir import RunDir
from mhf_dist.storage.run_lock import JOB_ID_ENV

if TYPE_CHECKING:
    from mhf_dist.cluster.profile import ClusterProfile
    from mhf_dist.config import RunConfig

QUERY_TIMEOUT_S = 5.0
PROBE_S = 30  # an elastic job's probe of one node: a node whose one-task step has not ended by then is lost
DATA_SCRIPTS = ("prepare-data.sbatch", "merge-data.sbatch")  # submit-data's array job and merge job
_JOB_ID = re.compile(r"\d+(_\d+)?")
_SBATCH_EXCLUDE = re.compile(r'^#SBATCH[ \t]+(?:--exclude[= ]|-x[ \t]*)"?([^"\s]+)', re.M)
_SBATCH_PLAIN = re.compile(r"[A-Za-z0-9_./:%@+,=-]*")


class SlurmOptions(BaseModel):
    """SLURM's own options in a cluster profile (``scheduler_options.slurm``, or the profile's top level)."""

    model_config = ConfigDict(extra="forbid")

    sbatch_args: list[str] = Field(
        default_factory=list, description="more #SBATCH options, e.g. --constraint=a100"
    )
    srun_args: list[str] = Field(
        default_factory=list, description="more srun options (e.g. pyxis --container-image)"
    )

    @field_validator("sbatch_args")
    @classmethod
    def _options(cls, args: list[str]) -> list[str]:
        for arg in args:
            if not arg.startswith("-"):
                raise ValueError(f"sbatch_args: {arg!r} is not an option (e.g. --constraint=a100)")
        return args


def sbatch_quoted(what: str, value: object) -> str:
    """``value`` as one argument of an ``#SBATCH`` line (sbatch reads these itself, not the shell)."""
    text = no_control_characters(what, str(value))
    if _SBATCH_PLAIN.fullmatch(text):
        return text
    if '"' in text or "\\" in text:
        raise ConfigError(
            f"{what}={text!r}: sbatch cannot read a double quote or backslash in an #SBATCH value; "
            "choose a value without them"
        )
    return f'"{text}"'


def _sbatch_option(what: str, arg: str) -> str:
    """An ``--option[=value]`` from a profile or ``--sbatch-arg`` as an ``#SBATCH`` line."""
    no_control_characters(what, arg)
    name, eq, value = arg.partition("=")
    if not re.fullmatch(r"--?[A-Za-z][A-Za-z0-9-]*", name):
        raise ConfigError(
            f"{what}={arg!r} is not an sbatch option (expected e.g. --constraint=a100 or --exclusive)"
        )
    return f"#SBATCH {name}={sbatch_quoted(what, value)}" if eq else f"#SBATCH {name}"


def check_site_values(profile: ClusterProfile) -> None:
    """A SLURM job needs a time limit, and on a hardware-only profile the site's partition too: never another
    site's, rendered as if it were the user's."""
    missing = [
        f"{what} ({flag})"
        for what, flag, value, needed in (
            ("partition", "--partition NAME", profile.partition, profile.hardware_only),
            ("time limit", "--time HH:MM:SS", profile.time, True),
        )
        if needed and value is None
    ]
    if missing:
        base = (
            f"profile {profile.name} holds only its hardware"
            if profile.hardware_only
            else f"profile {profile.name} has no time limit"
        )
        raise ConfigError(
            f"{base}; this job also needs your site's {' and '.join(missing)}, or a site profile that has them "
            f"(a YAML with `extends: {profile.name}` and your partition, time, modules and network settings: "
            "docs/clusters.md#site-profiles)"
        )


def _sbatch_lines(profile: ClusterProfile, job_options: dict[str, object]) -> list[str]:
    """The profile's ``#SBATCH`` lines (its sbatch_args, partition, account, qos, exclusive) with ``job_options``
    (``None`` values left out) after its qos."""
    lines = [
        _sbatch_option(f"profile {profile.name}: sbatch_args", a)
        for a in SLURM.own(profile).sbatch_args
    ]
    options = {
        "partition": profile.partition,
        "account": profile.account,
        "qos": profile.qos,
    } | job_options
    lines += [
        f"#SBATCH --{key}={sbatch_quoted(key, value)}"
        for key, value in options.items()
        if value is not None
    ]
    if profile.exclusive:
        lines.append("#SBATCH --exclusive")
    return lines


def _srun_args(args: list[str]) -> str:
    return "".join(f"{shlex.quote(no_control_characters('srun_args', a))} " for a in args)


def signal_grace(cfg: RunConfig, profile: ClusterProfile, nodes: int, asked: int | None) -> int:
    """The seconds before the time limit at which SLURM signals the ranks to save: ``asked`` (``--grace``), else
    what a step and a save of this job need (``mhf_dist.cluster.job_estimates``). A grace that leaves the job no
    time to train is refused; an asked one shorter than the estimate is warned about."""
    from mhf_dist.cluster.job_estimates import save_estimate, time_limit_seconds

    est = save_estimate(cfg, profile, nodes)
    grace = est.grace if asked is None else asked
    why = f"a checkpoint of {est.bytes / 1e9:.3g} GB takes about {est.seconds:.0f} s written at {est.rates}"
    if asked is not None and asked < est.grace:
        print(
            f"warning: --grace {asked} is shorter than the {est.grace} s a save on SLURM's signal needs ({why}); "
            "a save cut short by the time limit is lost and the job is not requeued",
            file=sys.stderr,
        )
    limit = time_limit_seconds(profile.time) if profile.time else None
    if limit is not None and grace >= limit:
        raise ConfigError(
            f"the job's time limit ({profile.time}) is not longer than the {grace} s it needs after "
            f"SLURM's warning signal ({why}): ask for a longer --time, or faster storage "
            "(storage_gb_per_s, upload_gb_per_s in a site profile)"
        )
    return grace


def _run(argv: list[str], timeout: float | None = None) -> subprocess.CompletedProcess | None:
    """``argv``'s completed process; None when the command is not here or does not finish within ``timeout``."""
    if shutil.which(argv[0]) is None:
        return None
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None


class Slurm:
    """SLURM (see the module's docstring)."""

    name = "slurm"
    script_name = "job.sbatch"
    preemption_signal = signal.SIGUSR1
    options = SlurmOptions

    def own(self, profile: ClusterProfile) -> SlurmOptions:
        """The profile's SLURM options (``SlurmOptions``)."""
        return profile.options_of(self)

    def template(self) -> str:
        return (PROFILE_DIR / "sbatch.template").read_text()

    def launch_template(self, elastic: bool) -> str:
        return (
            PROFILE_DIR / ("sbatch-elastic.template" if elastic else "sbatch-launch.template")
        ).read_text()

    def in_container(self, profile: ClusterProfile) -> bool:
        return bool(profile.launcher or self.own(profile).srun_args)

    def job_values(
        self,
        cfg: RunConfig,
        profile: ClusterProfile,
        *,
        nodes: int,
        run_dir: Path,
        grace: int | None,
        depends_on: str | None,
        hostfile: str | None,
        min_nodes: int | None,
    ) -> dict[str, object]:
        if grace is not None and grace < 1:
            raise ConfigError(
                f"--grace={grace}: the seconds between SLURM's warning signal and the time limit must "
                "be > 0"
            )
        if depends_on is not None and not _JOB_ID.fullmatch(depends_on):
            raise ConfigError(
                f"--depends-on={depends_on!r} is not a SLURM job id (a number, e.g. 123456)"
            )
        gpus = profile.backend == "nccl"
        bind = [f"--gpu-bind={profile.gpu_bind}"] if gpus and profile.gpus_per_task else []
        extra = _sbatch_lines(
            profile,
            {
                "gpus-per-node": profile.gpus_per_node
                if gpus and not profile.gpus_per_task
                else None,
                "gpus-per-task": profile.gpus_per_task if gpus else None,
                "mem": 0 if profile.all_memory else None,
                "dependency": f"afterany:{depends_on}" if depends_on else None,
            },
        )
        if min_nodes is not None:  # an elastic job: the allocation outlives a failed node
            extra.append("#SBATCH --no-kill")
        check_site_values(profile)
        log_dir = RunDir(run_dir).jobs_dir
        return dict(
            time=sbatch_quoted("time", profile.time),
            sbatch_run_dir=sbatch_quoted("--run-dir", run_dir),
            sbatch_log=sbatch_quoted("--run-dir", f"{log_dir}/%x-%j.out"),
            grace=signal_grace(cfg, profile, nodes, grace),
            signal=self.preemption_signal.name[3:],
            nodes_spec=f"{min_nodes}-{nodes}" if min_nodes is not None else str(nodes),
            min_nodes=min_nodes,
            probe_s=PROBE_S,
            extra_sbatch="\n".join(extra),
            srun_args=_srun_args(bind + self.own(profile).srun_args),
        )

    def submit(self, script: Path, *options: str) -> str:
        proc = _run(["sbatch", "--parsable", *options, str(script)])
        if proc is None:
            raise ConfigError(
                "sbatch is not on PATH: submit from a SLURM login node, or use --write "
                "(submit: or --hostfile, or another --scheduler)"
            )
        if proc.returncode:
            raise ConfigError(f"sbatch refused the job: {proc.stderr.strip()}")
        return proc.stdout.strip().split(";")[0]

    def submit_after(self, script: Path, job_id: str, exclude: list[str]) -> tuple[str, list[str]]:
        """Submit ``script`` again to start once job ``job_id`` has ended, on nodes other than ``exclude`` and those
        the script's own ``--exclude`` names; ``(the new job id, every node excluded)``. ConfigError when refused
        (the cluster has too few other nodes)."""
        own = [n for spec in _SBATCH_EXCLUDE.findall(script.read_text()) for n in spec.split(",")]
        excluded = sorted({*own, *exclude})
        return self.submit(
            script, f"--exclude={','.join(excluded)}", f"--dependency=afterany:{job_id}"
        ), excluded

    def query(self, job_id: str) -> JobState | None:
        def stdout(argv: list[str]) -> str:
            proc = _run(argv, QUERY_TIMEOUT_S)
            return proc.stdout if proc is not None and proc.returncode == 0 else ""

        first = (stdout(["scontrol", "show", "job", "-o", job_id]).strip().splitlines() or [""])[0]
        if state := re.search(r"(?:^|\s)JobState=(\S+)", first):
            restarts = re.search(r"(?:^|\s)Restarts=(\d+)", first)
            return JobState(
                state.group(1), int(restarts.group(1)) if restarts else None, "scontrol"
            )
        out = stdout(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State"])
        states = [line.split()[0] for line in out.splitlines() if line.strip()]
        return JobState(states[-1], None, "sacct") if states else None  # e.g. "CANCELLED by 1000"

    def task_env(self) -> dict[str, str]:
        if "SLURM_STEP_ID" not in os.environ:
            return {}
        env = {
            "RANK": os.environ["SLURM_PROCID"],
            "LOCAL_RANK": os.environ["SLURM_LOCALID"],
            "WORLD_SIZE": os.environ["SLURM_NTASKS"],
        }
        # the step's own
        nodes = os.environ.get("SLURM_STEP_NUM_NODES") or os.environ.get("SLURM_JOB_NUM_NODES")
        if nodes:
            env["GROUP_WORLD_SIZE"] = nodes
            env["LOCAL_WORLD_SIZE"] = str(int(env["WORLD_SIZE"]) // int(nodes))
        if job := os.environ.get("SLURM_JOB_ID"):
            env[JOB_ID_ENV] = job
        if node := os.environ.get("SLURMD_NODENAME"):
            env[NODE_ENV] = node  # the node as SLURM names it, in heartbeats and the log
        return env

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--sbatch-arg",
            dest="sbatch_args",
            action="append",
            default=[],
            metavar="OPTION",
            help="one more #SBATCH option, e.g. --sbatch-arg=--constraint=a100 (repeatable)",
        )

    def with_arguments(self, profile: ClusterProfile, args: argparse.Namespace) -> ClusterProfile:
        own = self.own(profile)
        return profile.with_options(
            self, own.model_copy(update={"sbatch_args": [*own.sbatch_args, *args.sbatch_args]})
        )

    # ------------------------------------------------------------------ submit-data
    def render_data(
        self,
        profile: ClusterProfile,
        shell: dict[str, str],
        *,
        parts: int,
        out: str,
        workdir: Path,
        log_dir: Path,
        inputs: list[str],
        tokenizer: str,
        options: list[str],
        cpus: int,
        merge_args: str,
    ) -> tuple[str, str]:
        """The array job preparing part ``$SLURM_ARRAY_TASK_ID`` of ``parts`` of ``inputs`` into ``out`` (a directory
        or a URL) and the job merging the parts (``DATA_SCRIPTS``), both run in ``workdir``; ``shell`` holds the
        job's shell values, ``merge_args`` the merge's ``prepare-data`` arguments."""
        check_site_values(profile)
        mem = 0 if profile.all_memory else None
        common = dict(
            profile=profile.name,
            time=sbatch_quoted("time", profile.time),
            log_dir=log_dir,
            sbatch_out=sbatch_quoted("--out", workdir),
            srun_args=_srun_args(self.own(profile).srun_args),
            **shell,
        )
        template = Template((PROFILE_DIR / "prepare-data.template").read_text())
        prepare = template.substitute(
            common,
            what=f"part $SLURM_ARRAY_TASK_ID of {parts} of the inputs, one array task each.",
            job_name=job_name("mhf-data", PurePosixPath(out)),
            cpus_per_task=cpus,
            sbatch_log=sbatch_quoted("--out", f"{log_dir}/%x-%A_%a.out"),
            extra_sbatch="\n".join(_sbatch_lines(profile, {"mem": mem, "array": f"1-{parts}"})),
            prepare_args=shlex.join(
                [
                    *inputs,
                    "--tokenizer",
                    tokenizer,
                    "--out",
                    out,
                    *options,
                    "--workers",
                    str(cpus),
                    "--no-progress",
                ]
            )
            + f' --part "$SLURM_ARRAY_TASK_ID/{parts}"',
        )
        merge = template.substitute(
            common,
            what=f"merges the {parts} parts once all succeeded (sbatch --dependency=afterok:ARRAY_JOB).",
            job_name=job_name("mhf-merge", PurePosixPath(out)),
            cpus_per_task=1,
            sbatch_log=sbatch_quoted("--out", f"{log_dir}/%x-%j.out"),
            extra_sbatch="\n".join(_sbatch_lines(profile, {"mem": mem})),
            prepare_args=merge_args,
        )
        return prepare, merge

    def data_submission_command(self, prepare: Path, merge: Path) -> str:
        """The shell line that submits the two scripts of ``submit-data``, the merge after the array's success."""
        return (
            f"jid=$(sbatch --parsable {shlex.quote(str(prepare))}) && "
            f"sbatch --dependency=afterok:$jid {shlex.quote(str(merge))}"
        )

    def submit_data(self, prepare: Path, merge: Path) -> tuple[str, str]:
        """Submit the array job, then its merge job to start after every task succeeded; the two job ids."""
        array = self.submit(prepare)
        try:
            return array, self.submit(merge, f"--dependency=afterok:{array}")
        except ConfigError as e:
            raise ConfigError(
                f"{e}; the parts are being prepared (array job {array}): merge them after it with "
                f"sbatch --dependency=afterok:{array} {merge}"
            ) from None

    def manual_note(self, log_dir: Path) -> str | None:
        return (
            f"# nothing submitted. SLURM does not create the log directory: to submit this script yourself, run "
            f"`mkdir -p {shlex.quote(str(log_dir))}` first, then `sbatch SCRIPT` (or use --write SCRIPT, which "
            "makes the directory)"
        )

    def how_to_submit(self, path: Path) -> str:
        return f"submit it with: sbatch {path}"


def job_name(prefix: str, directory: PurePath) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", f"{prefix}-{directory.name}")


SLURM = register(Slurm())
