"""``mhf-dist submit``: multi-node jobs from a cluster profile, SLURM or a hostfile.

SLURM: an sbatch script rendered from ``cluster/sbatch.template`` with one
``srun`` task per rank (GPU). Each task learns its rank from SLURM
(``SLURM_PROCID``/``SLURM_LOCALID``/``SLURM_NTASKS``) and rendezvous on the
first node of ``scontrol show hostnames``; so SLURM's ``--signal=USR1@<grace>``
reaches every rank itself, the ranks save and exit with 85, and the script
requeues the job (``--requeue``), which resumes from that checkpoint
(``--resume auto``). ``scontrol requeue`` or preemption (SIGTERM) goes the same
way. Without SLURM, ``--hostfile`` renders a script for DeepSpeed's launcher.

The script depends on nothing of the machine or directory it was submitted
from: it runs in the run directory, names the Python (or container) by an
absolute path, and every path in the command is made absolute at submit time.
``mhf-dist submit-data``: the same machinery renders two jobs from
``cluster/prepare-data.template`` for a preparation spread over a cluster
(:mod:`mhf_dist.data.prepare`, "Parts and merging"): an array job whose task
``I`` of ``1..N`` runs ``prepare-data --part I/N`` on one node (``--workers``
cores, default the profile's ``cores_per_node``), and a merge job
(``prepare-data --merge``) that SLURM starts only when every task succeeded
(``--dependency=afterok`` on the array, given at submission). Both run in the
output directory and log into ``OUT/slurm``, where the scripts are kept.

Every value a user chose is quoted — for the shell with :func:`shlex.quote`,
in ``#SBATCH`` lines in sbatch's own double quotes — and values that no
quoting makes safe (control characters; ``"`` or ``\\`` in an ``#SBATCH``
value; a job id that is not a number) are refused with the reason.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from string import Template

from mhf_dist.backend import hostfile_template
from mhf_dist.cluster.profile import PROFILE_DIR, ClusterProfile, no_control_characters
from mhf_dist.config import ConfigError, RunConfig
from mhf_dist.errors import PREEMPTED_EXIT_CODE
from mhf_dist.parallel.layout import preflight
from mhf_dist.train.job_estimates import save_estimate, time_limit_seconds
from mhf_dist.train.preemption import GRACE_ENV

LOG_DIR = "slurm"  # RUN/slurm: job logs, the submitted script, the job ids (jobs.jsonl); OUT/slurm of submit-data
DATA_SCRIPTS = ("prepare-data.sbatch", "merge-data.sbatch")  # submit-data's array job and merge job
JOBS_FILE = "jobs.jsonl"
_JOB_ID = re.compile(r"\d+(_\d+)?")
_SBATCH_PLAIN = re.compile(r"[A-Za-z0-9_./:%@+,=-]*")


def sbatch_quoted(what: str, value: object) -> str:
    """``value`` as one argument of an ``#SBATCH`` line (sbatch reads these itself, not the shell)."""
    text = no_control_characters(what, str(value))
    if _SBATCH_PLAIN.fullmatch(text):
        return text
    if '"' in text or "\\" in text:
        raise ConfigError(f'{what}={text!r}: sbatch cannot read a double quote or backslash in an #SBATCH value; '
                          "choose a value without them")
    return f'"{text}"'


def _sbatch_option(what: str, arg: str) -> str:
    """An ``--option[=value]`` from a profile or ``--sbatch-arg`` as an ``#SBATCH`` line."""
    no_control_characters(what, arg)
    name, eq, value = arg.partition("=")
    if not re.fullmatch(r"--?[A-Za-z][A-Za-z0-9-]*", name):
        raise ConfigError(f"{what}={arg!r} is not an sbatch option (expected e.g. --constraint=a100 or --exclusive)")
    return f"#SBATCH {name}={sbatch_quoted(what, value)}" if eq else f"#SBATCH {name}"


def _absolute_paths(cfg: RunConfig, overrides: list[str]) -> list[str]:
    """``overrides`` with the run's relative data and tokenizer paths made absolute (relative to this directory,
    which the job does not run in)."""
    out = list(overrides)
    single = None if cfg.data.sources else cfg.data.shard_dir
    for key, value in (("data.path", single), ("tokenizer.path", cfg.tokenizer.path)):
        if value and value != "mistral-v0.3" and _relative(value):
            out = [o for o in out if not o.startswith(f"{key}=")] + [f"{key}={Path(value).resolve()}"]
    if cfg.data.sources and any(_relative(s.path) for s in cfg.data.sources):
        sources = [s.model_dump(exclude_none=True) | {"path": str(Path(s.path).resolve()) if _relative(s.path)
                                                      else s.path} for s in cfg.data.sources]
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


def _python_check(python: str, profile: ClusterProfile) -> str:
    """A line that stops the job early, with the fix, when the nodes cannot see the Python."""
    if profile.launcher or profile.srun_args:
        return ""  # the container brings its own
    # the quoted path stands outside the message's double quotes, where the shell would expand it
    return (f"[ -x {python} ] || {{ echo \"mhf-dist: \"{python}\" is not on $(hostname): install mhf-dist on "
            "storage every node sees, or set python/launcher in the cluster profile\" >&2; exit 2; }")


def _check_site_values(profile: ClusterProfile) -> None:
    """A SLURM job needs a time limit, and on a hardware-only profile the site's partition too: never another
    site's, rendered as if it were the user's."""
    missing = [f"{what} ({flag})" for what, flag, value, needed in (
        ("partition", "--partition NAME", profile.partition, profile.hardware_only),
        ("time limit", "--time HH:MM:SS", profile.time, True)) if needed and value is None]
    if missing:
        base = f"profile {profile.name} holds only its hardware" if profile.hardware_only else \
            f"profile {profile.name} has no time limit"
        raise ConfigError(
            f"{base}; this job also needs your site's {' and '.join(missing)}, or a site profile that has them "
            f"(a YAML with `extends: {profile.name}` and your partition, time, modules and network settings: "
            "docs/usage.md#site-profiles)")


def _stop_on_failure(line: str, profile: str) -> str:
    """A setup line (a module load, say) that stops the job when it fails, naming itself."""
    said = shlex.quote(f"mhf-dist: the setup line of profile {profile} failed: {line}")
    return f"{{ {no_control_characters('setup', line)}\n}} || {{ echo {said} >&2; exit 2; }}"


def _sbatch_lines(profile: ClusterProfile, job_options: dict[str, object]) -> list[str]:
    """The profile's ``#SBATCH`` lines (its sbatch_args, partition, account, qos, exclusive) with ``job_options``
    (``None`` values left out) after its qos."""
    lines = [_sbatch_option(f"profile {profile.name}: sbatch_args", a) for a in profile.sbatch_args]
    options = {"partition": profile.partition, "account": profile.account, "qos": profile.qos} | job_options
    lines += [f"#SBATCH --{key}={sbatch_quoted(key, value)}" for key, value in options.items() if value is not None]
    if profile.exclusive:
        lines.append("#SBATCH --exclusive")
    return lines


def _shell_values(profile: ClusterProfile, python: str | None, srun_args: list[str]) -> dict[str, str]:
    """Template values of the job's shell part: the site's setup lines, the exports, the Python and its check, the
    ``mhf_dist`` command and the ``srun`` options (``srun_args``, the profile's among them)."""
    python = no_control_characters("python", python or profile.python or sys.executable)
    return dict(
        setup="\n".join(_stop_on_failure(line, profile.name) for line in profile.setup),  # the site's own lines
        exports="\n".join(f"export {k}={shlex.quote(v)}" for k, v in profile.env.items()),
        python=shlex.quote(python), python_check=_python_check(shlex.quote(python), profile),
        command=shlex.join([*profile.launcher, python, "-m", "mhf_dist"]),
        srun_args="".join(f"{shlex.quote(no_control_characters('srun_args', a))} " for a in srun_args),
    )


def signal_grace(cfg: RunConfig, profile: ClusterProfile, nodes: int, asked: int | None) -> int:
    """The seconds before the time limit at which SLURM signals the ranks to save: ``asked`` (``--grace``), else
    what a step and a save of this job need (:mod:`mhf_dist.train.job_estimates`). A grace that leaves the job no
    time to train is refused; an asked one shorter than the estimate is warned about."""
    est = save_estimate(cfg, profile, nodes)
    grace = est.grace if asked is None else asked
    why = (f"a checkpoint of {est.bytes / 1e9:.3g} GB takes about {est.seconds:.0f} s at {est.storage_gb_per_s:g} "
           f"GB/s per node (profile storage_gb_per_s)")
    if asked is not None and asked < est.grace:
        print(f"warning: --grace {asked} is shorter than the {est.grace} s a save on SLURM's signal needs ({why}); "
              "a save cut short by the time limit is lost and the job is not requeued", file=sys.stderr)
    limit = time_limit_seconds(profile.time) if profile.time else None
    if limit is not None and grace >= limit:
        raise ConfigError(f"the job's time limit ({profile.time}) is not longer than the {grace} s it needs after "
                          f"SLURM's warning signal ({why}): ask for a longer --time, or faster storage "
                          "(storage_gb_per_s in a site profile)")
    return grace


def render(kind: str, cfg: RunConfig, profile: ClusterProfile, nodes: int, run_dir: Path, *, preset: str | None = None,
           config: str | None = None, overrides: list[str] = (), grace: int | None = None,
           depends_on: str | None = None, hostfile: str | None = None, python: str | None = None) -> str:
    """The job script (``kind``: ``sbatch`` or ``hostfile``); the layout is checked against the nodes first.
    ``preset``, ``config`` and ``overrides`` are what the ranks load the run's config from, as ``train`` takes them."""
    if nodes < 1:
        raise ConfigError(f"--nodes={nodes}: need at least one node")
    if grace is not None and grace < 1:
        raise ConfigError(f"--grace={grace}: the seconds between SLURM's warning signal and the time limit must be > 0")
    if depends_on is not None and not _JOB_ID.fullmatch(depends_on):
        raise ConfigError(f"--depends-on={depends_on!r} is not a SLURM job id (a number, e.g. 123456)")
    if kind == "hostfile" and (profile.launcher or profile.srun_args):
        raise ConfigError(f"profile {profile.name} runs in a container (launcher/srun_args), which DeepSpeed's "
                          "hostfile launcher does not start; submit through SLURM, or use a profile without them")
    preflight(cfg, nodes * profile.gpus_per_node, "cpu" if profile.backend == "gloo" else "cuda", data_here=False)
    run_dir = Path(no_control_characters("--run-dir", str(run_dir))).resolve()
    gpus = profile.backend == "nccl"
    bind = [f"--gpu-bind={profile.gpu_bind}"] if gpus and profile.gpus_per_task else []
    shell = _shell_values(profile, python, bind + profile.srun_args)
    extra = _sbatch_lines(profile, {
        "gpus-per-node": profile.gpus_per_node if gpus and not profile.gpus_per_task else None,
        "gpus-per-task": profile.gpus_per_task if gpus else None, "mem": 0 if profile.all_memory else None,
        "dependency": f"afterany:{depends_on}" if depends_on else None})
    if kind == "sbatch":
        _check_site_values(profile)
        grace = signal_grace(cfg, profile, nodes, grace)
    values = dict(
        profile=profile.name, nodes=nodes, tasks_per_node=profile.gpus_per_node, cpus_per_task=profile.cpus_per_task,
        time=sbatch_quoted("time", profile.time) if profile.time else "",
        job_name=re.sub(r"[^A-Za-z0-9_.-]", "_", f"mhf-{run_dir.name}"),
        log_dir=run_dir / LOG_DIR, sbatch_run_dir=sbatch_quoted("--run-dir", run_dir),
        sbatch_log=sbatch_quoted("--run-dir", f"{run_dir / LOG_DIR}/%x-%j.out"), grace=grace,
        extra_sbatch="\n".join(extra), run_dir=shlex.quote(str(run_dir)),
        launcher_env="\n".join(f"{k}={no_control_characters(k, v)}" for k, v in profile.env.items()),
        # absolute: the script runs in the run directory
        hostfile=shlex.quote(str(Path(no_control_characters("--hostfile", hostfile)).resolve()) if hostfile else ""),
        master_port=29500, **shell,
        train_args=_train_args(run_dir, preset, config, _absolute_paths(cfg, overrides)),
        preempted_exit_code=PREEMPTED_EXIT_CODE, grace_env=GRACE_ENV,
    )
    template = hostfile_template() if kind == "hostfile" else (PROFILE_DIR / "sbatch.template").read_text()
    return Template(template).substitute(values)


def _job_name(prefix: str, directory: Path) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", f"{prefix}-{directory.name}")


def render_data(profile: ClusterProfile, inputs: list[str], tokenizer: str, out: Path, parts: int,
                options: list[str], *, workers: int | None = None, python: str | None = None) -> tuple[str, str]:
    """The array job preparing part ``$SLURM_ARRAY_TASK_ID`` of ``parts`` of ``inputs`` into ``out`` and the job
    merging the parts (``DATA_SCRIPTS``); ``options`` are more ``prepare-data`` options. Paths are made absolute."""
    from mhf_dist.data.prepare import part_dirs_pattern  # the data stack, which training's submit does without

    _check_site_values(profile)
    out = Path(no_control_characters("--out", str(out))).resolve()
    if tokenizer != "mistral-v0.3":
        tokenizer = str(Path(no_control_characters("--tokenizer", tokenizer)).resolve())
    inputs = [str(Path(no_control_characters("inputs", pattern)).absolute()) for pattern in inputs]  # globs kept
    cpus = workers or profile.cores_per_node
    mem = 0 if profile.all_memory else None
    common = dict(profile=profile.name, time=sbatch_quoted("time", profile.time), log_dir=out / LOG_DIR,
                  sbatch_out=sbatch_quoted("--out", out), **_shell_values(profile, python, profile.srun_args))
    template = Template((PROFILE_DIR / "prepare-data.template").read_text())
    prepare = template.substitute(
        common, what=f"part $SLURM_ARRAY_TASK_ID of {parts} of the inputs, one array task each.",
        job_name=_job_name("mhf-data", out), cpus_per_task=cpus,
        sbatch_log=sbatch_quoted("--out", f"{out / LOG_DIR}/%x-%A_%a.out"),
        extra_sbatch="\n".join(_sbatch_lines(profile, {"mem": mem, "array": f"1-{parts}"})),
        prepare_args=shlex.join([*inputs, "--tokenizer", tokenizer, "--out", str(out), *options, "--workers",
                                 str(cpus), "--no-progress"]) + f' --part "$SLURM_ARRAY_TASK_ID/{parts}"')
    merge = template.substitute(
        common, what=f"merges the {parts} parts once all succeeded (sbatch --dependency=afterok:ARRAY_JOB).",
        job_name=_job_name("mhf-merge", out), cpus_per_task=1,
        sbatch_log=sbatch_quoted("--out", f"{out / LOG_DIR}/%x-%j.out"),
        extra_sbatch="\n".join(_sbatch_lines(profile, {"mem": mem})),
        prepare_args=shlex.join(["--merge", str(out), *[o for o in options if o == "--overwrite"]])
        + f" {shlex.quote(str(out))}/{part_dirs_pattern(parts)}")  # the glob outside the quotes
    return prepare, merge


def data_submission_command(prepare: Path, merge: Path) -> str:
    """The shell line that submits the two scripts of ``submit-data``, the merge after the array's success."""
    return (f"jid=$(sbatch --parsable {shlex.quote(str(prepare))}) && "
            f"sbatch --dependency=afterok:$jid {shlex.quote(str(merge))}")


def write_script(script: str, path: Path, run_dir: Path) -> Path:
    """Write the job script to ``path`` and make the log directory SLURM needs before the job starts."""
    (run_dir.resolve() / LOG_DIR).mkdir(parents=True, exist_ok=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(script)
    return path


def manual_submission_note(run_dir: Path) -> str:
    """What submitting a printed script by hand needs."""
    log_dir = shlex.quote(str(run_dir.resolve() / LOG_DIR))
    return (f"# nothing submitted. SLURM does not create the log directory: to submit this script yourself, run "
            f"`mkdir -p {log_dir}` first, then `sbatch SCRIPT` (or use --write SCRIPT, which makes the directory)")


def _sbatch(path: Path, *options: str) -> str:
    """``sbatch`` the script at ``path`` with ``options``; the job id."""
    try:
        proc = subprocess.run(["sbatch", "--parsable", *options, str(path)], capture_output=True, text=True)
    except FileNotFoundError:
        raise ConfigError("sbatch is not on PATH: submit from a SLURM login node, or use --write "
                          "(submit: or --hostfile)") from None
    if proc.returncode:
        raise ConfigError(f"sbatch refused the job: {proc.stderr.strip()}")
    return proc.stdout.strip().split(";")[0]


def submit(script: str, run_dir: Path, cluster: str, nodes: int) -> str:
    """``sbatch`` the script (kept in ``RUN/slurm/job.sbatch``); records and returns the job id."""
    log_dir = run_dir.resolve() / LOG_DIR
    path = write_script(script, log_dir / "job.sbatch", run_dir)
    try:
        job = _sbatch(path)
    except ConfigError:
        path.unlink()  # nothing was submitted: no script that looks as if it had been
        raise
    with (log_dir / JOBS_FILE).open("a") as f:
        f.write(json.dumps({"job_id": job, "submitted": time.strftime("%Y-%m-%d %H:%M:%S"), "cluster": cluster,
                            "nodes": nodes, "script": str(path)}) + "\n")
    return job


def submit_data(prepare: str, merge: str, out: Path) -> tuple[str, str]:
    """``sbatch`` submit-data's array job, then its merge job to start after every task succeeded (the scripts kept
    in ``OUT/slurm``); the two job ids."""
    paths = [write_script(script, out.resolve() / LOG_DIR / name, out) for script, name in
             zip((prepare, merge), DATA_SCRIPTS)]
    array = _sbatch(paths[0])
    try:
        return array, _sbatch(paths[1], f"--dependency=afterok:{array}")
    except ConfigError as e:
        raise ConfigError(f"{e}; the parts are being prepared (array job {array}): merge them after it with "
                          f"sbatch --dependency=afterok:{array} {paths[1]}") from None
