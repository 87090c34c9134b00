"""``mhf-dist submit`` and ``submit-data``: job scripts from a cluster profile, for one of the schedulers
(``mhf_dist.cluster.scheduler``), and their submission.

The script depends on nothing of the machine or directory it was submitted from: it runs in the run directory,
names the Python (or container) by an absolute path, and every path in the command is made absolute at submit time.
Every value a user chose is quoted for the shell with ``shlex.quote``; the scheduler quotes its own lines.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path
from string import Template

from mhf_dist.cluster.elastic import check_range
from mhf_dist.cluster.files import no_control_characters
from mhf_dist.cluster.job_records import record_job
from mhf_dist.cluster.profile import ClusterProfile
from mhf_dist.cluster.scheduler import Scheduler
from mhf_dist.cluster.scheduler.slurm import DATA_SCRIPTS, SLURM
from mhf_dist.config import ConfigError, RunConfig
from mhf_dist.errors import (
    HUNG_EXIT_CODE,
    NODE_LOST_EXIT_CODE,
    OOM_EXIT_CODE,
    PREEMPTED_EXIT_CODE,
)
from mhf_dist.remote import is_url
from mhf_dist.storage.run_dir import RunDir
from mhf_dist.train.preemption import GRACE_ENV
from mhf_dist.train.preflight import preflight


def _absolute_paths(cfg: RunConfig, overrides: list[str]) -> list[str]:
    """``overrides`` with the run's relative data and tokenizer paths made absolute (relative to this directory,
    which the job does not run in)."""
    out = list(overrides)
    single = None if cfg.data.sources else cfg.data.shard_dir
    for key, value in (("data.path", single), ("tokenizer.path", cfg.tokenizer.path)):
        if value and value != "mistral-v0.3" and _relative(value):
            out = [o for o in out if not o.startswith(f"{key}=")] + [
                f"{key}={Path(value).resolve()}"
            ]
    if cfg.data.sources and any(_relative(s.path) for s in cfg.data.sources):
        sources = [
            s.model_dump(exclude_none=True)
            | {"path": str(Path(s.path).resolve()) if _relative(s.path) else s.path}
            for s in cfg.data.sources
        ]
        out = [o for o in out if not o.startswith(("data.path=", "data.sources="))]
        out.append(f"data.sources={json.dumps(sources)}")
    return out


def _relative(path: str) -> bool:
    """A local path relative to this directory (not a URL, a pipe or an absolute path)."""
    return "://" not in path and not path.startswith("pipe:") and not Path(path).is_absolute()


def _train_args(run_dir: Path, preset: str | None, config: str | None, overrides: list[str]) -> str:
    args = ["--run-dir", str(run_dir)]
    if preset:
        args += ["--preset", preset]
    if config:
        args += ["--config", str(Path(config).resolve())]
    for o in overrides:
        args += ["--set", no_control_characters("--set", o)]
    return shlex.join(args)


def _python_check(python: str, container: bool) -> str:
    """A line that stops the job early, with the fix, when the nodes cannot see the Python."""
    if container:
        return ""  # the container brings its own
    # the quoted path stands outside the message's double quotes, where the shell would expand it
    return (
        f'[ -x {python} ] || {{ echo "mhf-dist: "{python}" is not on $(hostname): install mhf-dist on '
        'storage every node sees, or set python/launcher in the cluster profile" >&2; exit 2; }'
    )


def _stop_on_failure(line: str, profile: str) -> str:
    """A setup line (a module load, say) that stops the job when it fails, naming itself."""
    said = shlex.quote(f"mhf-dist: the setup line of profile {profile} failed: {line}")
    return f"{{ {no_control_characters('setup', line)}\n}} || {{ echo {said} >&2; exit 2; }}"


def _shell_values(profile: ClusterProfile, python: str | None, container: bool) -> dict[str, str]:
    """Template values of the job's shell part: the site's setup lines, the exports, the Python and its check and the
    ``mhf_dist`` command."""
    python = no_control_characters("python", python or profile.python or sys.executable)
    return dict(
        # the site's own lines
        setup="\n".join(_stop_on_failure(line, profile.name) for line in profile.setup),
        exports="\n".join(f"export {k}={shlex.quote(v)}" for k, v in profile.env.items()),
        python=shlex.quote(python),
        python_check=_python_check(shlex.quote(python), container),
        command=shlex.join([*profile.launcher, python, "-m", "mhf_dist"]),
    )


def render(
    scheduler: Scheduler,
    cfg: RunConfig,
    profile: ClusterProfile,
    *,
    nodes: int,
    run_dir: Path,
    preset: str | None = None,
    config: str | None = None,
    overrides: list[str] = (),
    grace: int | None = None,
    depends_on: str | None = None,
    hostfile: str | None = None,
    python: str | None = None,
    min_nodes: int | None = None,
) -> str:
    """The training job script for ``scheduler``; the layout is checked against the nodes first. ``preset``,
    ``config`` and ``overrides`` are what the ranks load the run's config from, as ``train`` takes them.
    ``min_nodes``: an elastic job of ``min_nodes`` to ``nodes`` nodes, which continues on the nodes left when one is
    lost (``mhf_dist.cluster.elastic``); its minimum and some count below its maximum must train the global batch
    with every rank busy (``check_range``)."""
    if nodes < 1:
        raise ConfigError(f"--nodes={nodes}: need at least one node")
    if min_nodes is not None and not 1 <= min_nodes < nodes:
        raise ConfigError(
            f"--nodes {min_nodes}-{nodes}: the minimum must be at least 1 and below the maximum"
        )
    preflight(
        cfg,
        nodes * profile.gpus_per_node,
        "cpu" if profile.backend == "gloo" else "cuda",
        data_here=False,
        ranks_per_node=profile.gpus_per_node,
        # a rank's share of the node's memory
        host_budget_gb=profile.memory_gb_per_node / profile.gpus_per_node
        if profile.memory_gb_per_node
        else None,
    )
    if min_nodes is not None:
        check_range(cfg, min_nodes, nodes, profile.gpus_per_node)
    run_dir = Path(no_control_characters("--run-dir", str(run_dir))).resolve()
    values = dict(
        profile=profile.name,
        nodes=nodes,
        tasks_per_node=profile.gpus_per_node,
        cpus_per_task=profile.cpus_per_task,
        job_name=re.sub(r"[^A-Za-z0-9_.-]", "_", f"mhf-{run_dir.name}"),
        log_dir=RunDir(run_dir).jobs_dir,
        run_dir=shlex.quote(str(run_dir)),
        master_port=29500,
        **_shell_values(profile, python, scheduler.in_container(profile)),
        train_args=_train_args(run_dir, preset, config, _absolute_paths(cfg, overrides)),
        preempted_exit_code=PREEMPTED_EXIT_CODE,
        hung_exit_code=HUNG_EXIT_CODE,
        node_lost_exit_code=NODE_LOST_EXIT_CODE,
        oom_exit_code=OOM_EXIT_CODE,
        lost_record=shlex.quote(str(RunDir(run_dir).lost_record)),
        oom_record=shlex.quote(str(RunDir(run_dir).oom_record)),
        grace_env=GRACE_ENV,
    )
    values |= scheduler.job_values(
        cfg,
        profile,
        nodes=nodes,
        run_dir=run_dir,
        grace=grace,
        depends_on=depends_on,
        hostfile=hostfile,
        min_nodes=min_nodes,
    )
    values["launch"] = Template(scheduler.launch_template(min_nodes is not None)).substitute(values)
    return Template(scheduler.template()).substitute(values)


def render_data(
    profile: ClusterProfile,
    inputs: list[str],
    *,
    tokenizer: str,
    out: Path | str,
    parts: int,
    options: list[str],
    workers: int | None = None,
    python: str | None = None,
    jobs_dir: Path | None = None,
) -> tuple[str, str]:
    """``submit-data``'s two jobs (a scheduler's array job preparing part I of ``parts`` of ``inputs`` into ``out``
    on one node each, and the job merging the parts); ``options`` are more ``prepare-data`` options. Paths are made
    absolute. ``out`` may be a URL of object storage, where the merge names every part (no glob lists a bucket);
    the scripts' logs go into ``jobs_dir`` (``data_jobs_dir``)."""
    # the data stack, which training's submit does without
    from mhf_dist.data.parts import part_dir_name, part_dirs_pattern

    if tokenizer != "mistral-v0.3":
        tokenizer = str(Path(no_control_characters("--tokenizer", tokenizer)).resolve())
    # globs kept
    inputs = [str(Path(no_control_characters("inputs", pattern)).absolute()) for pattern in inputs]
    overwrite = [o for o in options if o == "--overwrite"]
    jobs_dir = data_jobs_dir(out, jobs_dir)
    if is_url(str(out)):
        out = no_control_characters("--out", str(out)).rstrip("/")
        every_part = [f"{out}/{part_dir_name(i, parts)}" for i in range(1, parts + 1)]
        merge_args = shlex.join(["--merge", out, *overwrite, *every_part])
        workdir = jobs_dir
    else:
        out = workdir = Path(no_control_characters("--out", str(out))).resolve()
        merge_args = (
            shlex.join(["--merge", str(out), *overwrite])
            + f" {shlex.quote(str(out))}/{part_dirs_pattern(parts)}"
        )  # the glob outside the quotes
    shell = _shell_values(profile, python, SLURM.in_container(profile))
    return SLURM.render_data(
        profile,
        shell,
        parts=parts,
        out=str(out),
        workdir=workdir,
        log_dir=jobs_dir,
        inputs=inputs,
        tokenizer=tokenizer,
        options=options,
        cpus=workers or profile.cores_per_node,
        merge_args=merge_args,
    )


def data_jobs_dir(out: Path | str, jobs_dir: Path | None) -> Path:
    """Where ``submit-data``'s scripts and logs go: ``jobs_dir``, else ``OUT/jobs``; an ``out`` in object storage
    needs ``jobs_dir`` (a directory the nodes share)."""
    if jobs_dir is not None:
        return Path(no_control_characters("--jobs-dir", str(jobs_dir))).resolve()
    if is_url(str(out)):
        raise ConfigError(
            f"--out {out} lies in object storage, where SLURM cannot write the jobs' logs: pass --jobs-dir DIR, "
            "a directory every node sees, for the job scripts and their logs"
        )
    return RunDir(Path(out).resolve()).jobs_dir


def write_script(script: str, path: Path, run_dir: Path) -> Path:
    """Write the job script to ``path`` and make the log directory the scheduler needs before the job starts."""
    RunDir(run_dir.resolve()).make_jobs_dir()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(script)
    return path


def submit(scheduler: Scheduler, script: str, run_dir: Path, cluster: str, nodes: int) -> str:
    """Submit the script (kept in ``RUN/jobs/``); records and returns the job id."""
    run = RunDir(run_dir.resolve())
    path = write_script(script, run.jobs_dir / scheduler.script_name, run_dir)
    try:
        job = scheduler.submit(path)
    except ConfigError:
        path.unlink()  # nothing was submitted: no script that looks as if it had been
        raise
    record_job(run, job, cluster=cluster, nodes=nodes, script=str(path), scheduler=scheduler.name)
    return job


def write_data_scripts(
    scripts: tuple[str, str], folder: Path, out: Path | str, jobs_dir: Path
) -> list[Path]:
    """``submit-data``'s two scripts written into ``folder`` (``DATA_SCRIPTS``), and their log directory
    ``jobs_dir`` made (``OUT/jobs`` as a run's is, with its older name beside it)."""
    if not is_url(str(out)) and jobs_dir == RunDir(Path(out).resolve()).jobs_dir:
        RunDir(Path(out).resolve()).make_jobs_dir()
    else:
        jobs_dir.mkdir(parents=True, exist_ok=True)
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / name for name in DATA_SCRIPTS]
    for script, path in zip(scripts, paths):
        path.write_text(script)
    return paths


def submit_data(prepare: str, merge: str, out: Path | str, jobs_dir: Path) -> tuple[str, str]:
    """Submit ``submit-data``'s array job, then its merge job to start after every part succeeded (the scripts kept in
    ``jobs_dir``); the two job ids."""
    return SLURM.submit_data(*write_data_scripts((prepare, merge), jobs_dir, out, jobs_dir))
