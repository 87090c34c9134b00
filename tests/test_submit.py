"""Job submission: rendered scripts (golden files), named errors, and a real SLURM requeue end to end."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.runs import metrics, run_cli, train_args
from helpers.slurm import LocalSlurm, job_log, missing_binaries, submit_job, wait_for
from mhf_dist.cli import main
from mhf_dist.cluster.job_estimates import save_estimate, time_limit_seconds
from mhf_dist.cluster.profile import load_profile
from mhf_dist.cluster.scheduler.hostfile import HOSTFILE
from mhf_dist.cluster.scheduler.slurm import DATA_SCRIPTS, SLURM, SlurmOptions
from mhf_dist.cluster.submit import render, render_data, submit
from mhf_dist.config import ConfigError, load_config
from mhf_dist.errors import NODE_LOST_EXIT_CODE, RANK_LOST_EXIT_CODE
from mhf_dist.train.preemption import MIN_GRACE_SECONDS, grace_seconds

GOLDEN = Path(__file__).parent / "golden"
DATA = "data.path=/shared/data"
# the documented site profile
SITE = str(Path(__file__).parents[1] / "docs" / "site-profile-example.yaml")
SCHEDULERS = {"sbatch": SLURM, "hostfile": HOSTFILE}  # by the kind of script each writes
AT_SITE = {
    "partition": "gpu",
    "time": "48:00:00",
}  # what submit's --partition and --time give a hardware profile
CASES = {  # golden file: (profile, nodes, preset, overrides, extra)
    "a100-80g-2nodes.sbatch": (
        SITE,
        2,
        "1b-h4b16k",
        [DATA, "parallel.tp=2"],
        {"depends_on": "1234"},
    ),
    "mi300x-4nodes.sbatch": (
        "mi300x",
        4,
        "3b-h4b16k",
        [DATA, "parallel.tp=2", "parallel.pp=2"],
        {},
    ),
    "cpu-local-1node.sbatch": ("cpu-local", 1, "tiny-h4b16k", ["train.micro_batch_size=4"], {}),
    "a100-80g-2nodes.hostfile.sh": (
        "a100-80g",
        2,
        "1b-h4b16k",
        [DATA],
        {"hostfile": "/shared/hostfile"},
    ),
    "a100-80g-4to8nodes.elastic.sbatch": (
        SITE,
        8,
        "1b-h4b16k",
        [DATA, "parallel.tp=2"],
        {"min_nodes": 4},
    ),
}


def at_site(name: str):
    """A shipped hardware profile with the partition and time limit submit's flags would give it."""
    return load_profile(name).model_copy(update=AT_SITE)


def rendered(name: str) -> str:
    profile, nodes, preset, overrides, extra = CASES[name]
    scheduler = HOSTFILE if "hostfile" in extra else SLURM
    return render(
        scheduler,
        load_config(preset, overrides=overrides),
        at_site(profile) if profile == "mi300x" else load_profile(profile),
        nodes=nodes,
        run_dir=Path("/shared/runs/demo"),
        preset=preset,
        overrides=overrides,
        python="/opt/venv/bin/python",
        **extra,
    )


def test_every_scheduler_answers_the_whole_protocol_and_is_found_by_name():
    from mhf_dist.cluster.scheduler import Scheduler, scheduler, schedulers

    assert set(schedulers()) == {"slurm", "hostfile"}
    for name, s in schedulers().items():
        assert isinstance(s, Scheduler) and scheduler(name) is s
    assert HOSTFILE.task_env() == {} and HOSTFILE.query("1") is None
    with pytest.raises(ValueError, match="no scheduler 'pbs'; the schedulers are slurm, hostfile"):
        scheduler("pbs")


def test_a_task_of_a_job_step_is_told_its_rank_and_job(monkeypatch):
    from mhf_dist.cluster.scheduler import task_env
    from mhf_dist.storage.heartbeats import NODE_ENV
    from mhf_dist.storage.run_lock import JOB_ID_ENV

    for key in (
        "SLURM_STEP_ID",
        "SLURM_JOB_NUM_NODES",
        "SLURM_STEP_NUM_NODES",
        "SLURM_JOB_ID",
        "SLURMD_NODENAME",
    ):
        monkeypatch.delenv(key, raising=False)
    assert task_env() == {}  # not inside a job step
    for key, value in dict(
        SLURM_STEP_ID="0",
        SLURM_PROCID="5",
        SLURM_LOCALID="1",
        SLURM_NTASKS="8",
        SLURM_JOB_NUM_NODES="2",
        SLURM_JOB_ID="77",
    ).items():
        monkeypatch.setenv(key, value)
    assert task_env() == {
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "GROUP_WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "4",
        JOB_ID_ENV: "77",
    }
    monkeypatch.setenv("SLURMD_NODENAME", "n2")  # the node's name in heartbeats and the log
    assert task_env()[NODE_ENV] == "n2"


@pytest.mark.parametrize("name", list(CASES))
def test_rendered_scripts_match_reviewed_golden_files(name):
    if os.environ.get("MHF_DIST_UPDATE_GOLDEN"):
        (GOLDEN / name).write_text(rendered(name))
    assert rendered(name) == (GOLDEN / name).read_text()


def test_a_relative_hostfile_is_named_absolutely(tmp_path, monkeypatch):
    # the script runs in the run directory, where a relative hostfile would name nothing
    monkeypatch.chdir(tmp_path)
    script = render(
        HOSTFILE,
        load_config("1b-h4b16k", overrides=[DATA]),
        load_profile("a100-80g"),
        nodes=2,
        run_dir=Path("/shared/runs/demo"),
        preset="1b-h4b16k",
        overrides=[DATA],
        hostfile="hosts",
    )
    assert f"--hostfile {tmp_path / 'hosts'} " in script and "--hostfile hosts" not in script


def test_a_refused_job_leaves_no_script_behind(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(
        "#!/bin/sh\necho 'sbatch: error: invalid partition specified: gpu' >&2\nexit 1\n"
    )
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    with pytest.raises(
        ConfigError, match="sbatch refused the job: sbatch: error: invalid partition"
    ):
        submit(SLURM, "#!/bin/bash\n", tmp_path / "run", "a100-80g", 1)
    assert not (tmp_path / "run" / "jobs" / "job.sbatch").exists()


def test_a_hardware_profile_asks_for_the_sites_values(tmp_path, capsys):
    # the shipped GPU profiles hold no partition, time limit, network interface or module of anyone's site
    for name in ("a100-80g", "mi300x"):
        profile = load_profile(name)
        assert (
            profile.hardware_only
            and profile.partition is None
            and profile.time is None
            and not profile.setup
        )
        assert not {"NCCL_SOCKET_IFNAME", "NCCL_IB_HCA"} & set(profile.env)
    args = [
        "submit",
        "--preset",
        "1b-h4b16k",
        "--set",
        DATA,
        "--cluster",
        "a100-80g",
        "--run-dir",
        str(tmp_path / "r"),
        "--dry-run",
    ]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert (
        "profile a100-80g holds only its hardware; this job also needs your site's partition (--partition NAME) "
        "and time limit (--time HH:MM:SS), or a site profile that has them (a YAML with `extends: a100-80g`"
    ) in err
    assert (
        main([*args, "--partition", "gpu"]) == 2 and "time limit (--time" in capsys.readouterr().err
    )
    assert main([*args, "--partition", "gpu", "--time", "1:00:00"]) == 0
    assert main([*args[:5], "--cluster", SITE, *args[7:]]) == 0  # the site profile has them
    script = capsys.readouterr().out
    for line in (
        "#SBATCH --partition=gpu-a100",
        "#SBATCH --account=my-project",
        "#SBATCH --time=2-00:00:00",
        "export NCCL_SOCKET_IFNAME=ib0",
        "#SBATCH --gpus-per-node=8",
        "export NCCL_DEBUG=WARN",
    ):
        assert line in script.splitlines(), line


def test_a_failed_setup_line_stops_the_job(tmp_path):
    profile = load_profile("cpu-local").model_copy(
        update={"setup": ["false  # a module that is not there"]}
    )
    script = render(
        SLURM,
        load_config("tiny-h4b16k", overrides=["train.micro_batch_size=4"]),
        profile,
        nodes=1,
        run_dir=tmp_path / "r",
        preset="tiny-h4b16k",
        overrides=["train.micro_batch_size=4"],
        python="/no/python",
    )
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2
    assert (
        "the setup line of profile cpu-local failed: false  # a module that is not there"
        in proc.stderr
    )
    assert "is not on" not in proc.stderr  # stopped there, before anything else ran


def test_script_contents():
    script = rendered("mi300x-4nodes.sbatch")
    assert "#SBATCH --nodes=4" in script and "#SBATCH --ntasks-per-node=8" in script
    assert "#SBATCH --cpus-per-task=24" in script  # the node's 192 cores over its 8 ranks
    assert "srun --cpus-per-task=24 --kill-on-bad-exit=1" in script  # srun does not inherit it
    assert "#SBATCH --exclusive" in script and "#SBATCH --mem=0" in script
    assert (
        "#SBATCH --chdir=/shared/runs/demo" in script and "cd " not in script
    )  # nothing of the submitting shell
    assert "[ -x /opt/venv/bin/python ]" in script and ".venv/bin/activate" not in script
    assert "#SBATCH --signal=USR1@120" in script and "#SBATCH --requeue" in script
    assert 'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in script
    # the site adds modules
    assert "export HSA_FORCE_FINE_GRAIN_PCIE=1" in script and "module load" not in script
    assert 'if [ "$rc" -eq 85 ]' in script
    assert "#SBATCH --dependency=afterany:1234" in rendered("a100-80g-2nodes.sbatch")


def test_nodes_that_do_not_fit_the_layout_fail_before_submitting(capsys):
    with pytest.raises(ConfigError, match=r"world size 24 does not fit parallel.tp=16"):
        render(
            SLURM,
            load_config("3b-h4b16k", overrides=[DATA, "parallel.tp=16"]),
            load_profile("a100-80g"),
            nodes=3,
            run_dir=Path("/x"),
            preset="3b-h4b16k",
            overrides=[],
        )
    assert (
        main(
            [
                "submit",
                "--preset",
                "tiny-h4b16k",
                "--cluster",
                "nope",
                "--run-dir",
                "/tmp/x",
                "--dry-run",
            ]
        )
        == 2
    )
    assert "cluster profile 'nope' not found" in capsys.readouterr().err


def test_relative_paths_are_resolved_at_submit_time(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config("1b-h4b16k", overrides=["data.path=shards", "tokenizer.path=tok"])
    script = render(
        SLURM,
        cfg,
        at_site("a100-80g"),
        nodes=1,
        run_dir=Path("runs/r"),
        preset="1b-h4b16k",
        overrides=["data.path=shards", "tokenizer.path=tok"],
    )
    assert f"--run-dir {tmp_path}/runs/r" in script
    assert (
        f"--set data.path={tmp_path}/shards" in script
        and f"--set tokenizer.path={tmp_path}/tok" in script
    )
    assert "data.path=shards" not in script


def test_container_profiles_wrap_each_rank(tmp_path):
    profile = load_profile("mi300x").model_copy(
        update=AT_SITE
        | {
            "python": "python3",
            "launcher": ["apptainer", "exec", "--rocm", "/shared/images/mhf dist.sif"],
        }
    )
    script = render(
        SLURM,
        load_config("1b-h4b16k", overrides=[DATA]),
        profile,
        nodes=1,
        run_dir=Path("/r"),
        preset="1b-h4b16k",
        overrides=[DATA],
    )
    assert "apptainer exec --rocm '/shared/images/mhf dist.sif' python3 -m mhf_dist train" in script
    assert "[ -x" not in script  # the container brings its own Python
    pyxis = (
        load_profile("a100-80g")
        .model_copy(update=AT_SITE | {"python": "python"})
        .with_options(
            SLURM,
            SlurmOptions(
                srun_args=[
                    "--container-image=/shared/images/mhf.sqsh",
                    "--container-mounts=/shared:/shared",
                ]
            ),
        )
    )
    script = render(
        SLURM,
        load_config("1b-h4b16k", overrides=[DATA]),
        pyxis,
        nodes=1,
        run_dir=Path("/r"),
        preset="1b-h4b16k",
        overrides=[DATA],
    )
    assert (
        "srun --cpus-per-task=16 --kill-on-bad-exit=1 --container-image=/shared/images/mhf.sqsh "
        "--container-mounts=/shared:/shared"
    ) in script
    with pytest.raises(ConfigError, match="hostfile launcher does not start"):
        render(
            HOSTFILE,
            load_config("1b-h4b16k", overrides=[DATA]),
            profile,
            nodes=1,
            run_dir=Path("/r"),
            preset="1b-h4b16k",
            overrides=[DATA],
            hostfile="/h",
        )


def test_per_submit_overrides(tmp_path, capsys):
    args = [
        "submit",
        "--preset",
        "1b-h4b16k",
        "--set",
        DATA,
        "--cluster",
        "a100-80g",
        "--nodes",
        "2",
        "--run-dir",
        str(tmp_path / "r"),
        "--dry-run",
    ]
    assert (
        main(
            [
                *args,
                "--partition",
                "big",
                "--account",
                "proj-42",
                "--time",
                "2-00:00:00",
                "--qos",
                "high",
                "--sbatch-arg=--constraint=a100&ib",
                "--sbatch-arg",
                "--comment=first run",
            ]
        )
        == 0
    )
    out = capsys.readouterr()
    for line in (
        "#SBATCH --partition=big",
        "#SBATCH --account=proj-42",
        "#SBATCH --time=2-00:00:00",
        "#SBATCH --qos=high",
        '#SBATCH --constraint="a100&ib"',
        '#SBATCH --comment="first run"',
    ):
        assert line in out.out.splitlines(), line
    assert "#SBATCH --partition=gpu" not in out.out
    # printed, not made
    assert f"mkdir -p {tmp_path / 'r' / 'jobs'}" in out.err and not (tmp_path / "r").exists()
    assert main([*args, "--sbatch-arg", "constraint=a100"]) == 2
    assert "is not an sbatch option" in capsys.readouterr().err


def test_write_makes_the_log_directory_and_submits_nothing(tmp_path, capsys):
    script = tmp_path / "job.sbatch"
    assert (
        main(
            [
                "submit",
                "--preset",
                "tiny-h4b16k",
                "--set",
                "train.micro_batch_size=4",
                "--cluster",
                "cpu-local",
                "--run-dir",
                str(tmp_path / "r"),
                "--write",
                str(script),
            ]
        )
        == 0
    )
    assert f"sbatch {script}" in capsys.readouterr().out
    assert script.read_text().startswith("#!/bin/bash") and (tmp_path / "r" / "jobs").is_dir()
    # the directory's older name, for whoever reads that
    assert os.readlink(tmp_path / "r" / "slurm") == "jobs"
    assert not (tmp_path / "r" / "jobs" / "jobs.jsonl").exists()


HOSTILE = "run d'ir $(touch PWNED1) `touch PWNED2`; touch PWNED3 & | > <"


def _fake_commands(bin_dir: Path, log: Path) -> None:
    """``srun``, ``scontrol`` and a Python that record their arguments (one JSON list per call) and do nothing."""
    bin_dir.mkdir()
    for name in ("srun", "scontrol", "python"):
        tool = bin_dir / name
        tool.write_text(
            f"#!{sys.executable}\nimport json, sys\n"
            f"open({str(log)!r}, 'a').write(json.dumps([{name!r}, *sys.argv[1:]]) + '\\n')\n"
            "print('localhost') if sys.argv[1:3] == ['show', 'hostnames'] else None\n"
        )
        tool.chmod(0o755)


def test_hostile_values_stay_single_arguments(tmp_path):
    """A run directory, overrides and a hostfile full of shell syntax: the scripts parse (bash -n), run exactly
    their own commands with each value as one argument, and nothing the values spell out is executed."""
    run_dir, hostfile = tmp_path / HOSTILE, str(tmp_path / "hosts; touch PWNED4")
    run_dir.mkdir()
    overrides = ["train.max_steps=7", "model.name=$(touch PWNED5) 'x' \"y\""]
    overrides.append("train.micro_batch_size=4")
    cfg = load_config("tiny-h4b16k", overrides=[overrides[0], overrides[2]])
    log, bin_dir = tmp_path / "calls.jsonl", tmp_path / "bin"
    _fake_commands(bin_dir, log)
    env = os.environ | {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": "localhost",
    }
    for kind in ("sbatch", "hostfile"):
        script = render(
            SCHEDULERS[kind],
            cfg,
            load_profile("cpu-local"),
            nodes=1,
            run_dir=run_dir,
            preset="tiny-h4b16k",
            overrides=overrides,
            hostfile=hostfile,
            python=str(bin_dir / "python"),
        )
        path = tmp_path / f"{kind}.sh"
        path.write_text(script)
        subprocess.run(["bash", "-n", str(path)], check=True)
        subprocess.run(["bash", str(path)], env=env, cwd=tmp_path, check=True, capture_output=True)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    train = [
        "-m",
        "mhf_dist",
        "train",
        "--run-dir",
        str(run_dir),
        "--preset",
        "tiny-h4b16k",
        "--set",
        overrides[0],
        "--set",
        overrides[1],
        "--set",
        overrides[2],
    ]
    assert calls == [
        ["scontrol", "show", "hostnames", "localhost"],
        ["srun", "--cpus-per-task=1", "--kill-on-bad-exit=1", str(bin_dir / "python"), *train],
        [
            "python",
            "-m",
            "deepspeed.launcher.runner",
            "--hostfile",
            hostfile,
            "--num_nodes",
            "1",
            "--num_gpus",
            "2",
            "--master_port",
            "29500",
            "--no_local_rank",
            "--module",
            "mhf_dist",
            *train[2:],
        ],
    ]
    assert not list(tmp_path.rglob("PWNED*"))

    # a Python path that is itself hostile: the job stops at the check, naming it, and runs nothing it spells
    python = str(tmp_path / "$(touch PWNED6)" / "python")
    script = render(
        SLURM,
        cfg,
        load_profile("cpu-local"),
        nodes=1,
        run_dir=run_dir,
        preset="tiny-h4b16k",
        overrides=overrides,
        python=python,
    )
    (tmp_path / "check.sh").write_text(script)
    proc = subprocess.run(
        ["bash", str(tmp_path / "check.sh")], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    assert proc.returncode == 2 and f"mhf-dist: {python} is not on" in proc.stderr
    assert not list(tmp_path.rglob("PWNED*"))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"run_dir": Path("/runs/a\nrm -rf x")}, "control character"),
        ({"overrides": ["train.max_steps=7\nrm -rf x"]}, "control character"),
        ({"run_dir": Path('/runs/a"b')}, "double quote or backslash"),
        ({"depends_on": "123; touch x"}, "is not a SLURM job id"),
        ({"depends_on": "123\n"}, "is not a SLURM job id"),
        ({"grace": 0}, "must be > 0"),
    ],
)
def test_values_no_quoting_makes_safe_are_refused(change, message):
    args = {"run_dir": Path("/runs/a"), "overrides": ["train.micro_batch_size=4"]} | change
    extra = {k: v for k, v in args.items() if k in ("depends_on", "grace")}
    with pytest.raises(ConfigError, match=message):
        render(
            SLURM,
            load_config("tiny-h4b16k", overrides=["train.micro_batch_size=4"]),
            load_profile("cpu-local"),
            nodes=1,
            run_dir=args["run_dir"],
            preset="tiny-h4b16k",
            overrides=args["overrides"],
            **extra,
        )


def test_a_profile_with_fewer_cores_than_ranks_is_refused(tmp_path, capsys):
    bad = tmp_path / "small.yaml"
    bad.write_text(
        (Path(__file__).parents[1] / "cluster" / "a100-80g.yaml")
        .read_text()
        .replace("cores_per_node: 128", "cores_per_node: 4")
    )
    assert (
        main(
            [
                "submit",
                "--preset",
                "1b-h4b16k",
                "--set",
                DATA,
                "--cluster",
                str(bad),
                "--run-dir",
                str(tmp_path / "r"),
                "--dry-run",
            ]
        )
        == 2
    )
    assert (
        "cores_per_node=4 is fewer than one core for each of the gpus_per_node=8 ranks"
        in capsys.readouterr().err
    )
    with pytest.raises(SystemExit) as stopped:  # argparse: usage and exit 2
        main(
            [
                "submit",
                "--preset",
                "tiny-h4b16k",
                "--cluster",
                "cpu-local",
                "--run-dir",
                str(tmp_path / "r"),
                "--grace",
                "0",
                "--dry-run",
            ]
        )
    assert stopped.value.code == 2 and "--grace: must be at least 1" in capsys.readouterr().err


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    missing = missing_binaries()
    if missing and not os.environ.get("CI"):
        pytest.skip(
            f"SLURM is not installed here ({', '.join(missing)} missing); .ci/run installs it"
        )
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
    except Exception as e:  # whatever stops it: report why, then skip (CI must be able to start it)
        if os.environ.get("CI"):
            raise
        pytest.skip(f"SLURM could not start here: {e}")
    yield cluster
    cluster.stop()


@pytest.mark.slurm
@pytest.mark.multirank
def test_slurm_job_requeued_mid_run_resumes_and_matches(tmp_path, data, slurm):
    steps = 30
    overrides = ["parallel.zero_stage=1"]
    reference = run_cli(train_args(tmp_path / "ref", data, 2, *overrides, steps=steps)) and metrics(
        tmp_path / "ref"
    )
    run = tmp_path / "run d'ir"  # sbatch reads the quoted #SBATCH --chdir / --output
    job = submit_job(slurm, train_args(run, data, 2, *overrides, steps=steps), "1")
    log = run / "metrics.jsonl"
    wait_for(
        lambda: log.exists() and len(log.read_text().splitlines()) >= 3,
        300,
        "training to start",
        lambda: slurm.story(job, run),
    )
    # SIGTERM to every rank: they save, then SLURM queues the job again
    slurm.scontrol("requeue", job)
    wait_for(lambda: slurm.job_state(job)["JobState"] == "PENDING", 120, "the requeue")
    # a requeued job otherwise waits ~2 minutes
    slurm.scontrol("update", f"JobId={job}", "StartTime=now")
    state = wait_for(
        lambda: (s := slurm.job_state(job))["JobState"] in ("COMPLETED", "FAILED") and s,
        600,
        "the job to finish",
    )
    out = job_log(run)
    assert state["JobState"] == "COMPLETED", out[-4000:] + slurm.log_tail()
    assert int(state["Restarts"]) >= 1
    assert "resumed from" in out
    markers = sorted((run / "checkpoints").glob("step-*/complete.json"))
    assert markers, "no checkpoint was written"
    assert [r["loss"] for r in metrics(run)] == [r["loss"] for r in reference]
    shown = run_cli(["status", str(run)])
    assert f"step       {steps} / {steps}" in shown and f"checkpoint step-{steps:08d}" in shown


def _slurm_rank_pid(job: str, rank: int) -> int | None:
    """The pid of ``rank`` of SLURM job ``job`` (the training process, not the task around it), read from /proc."""
    wanted = {f"SLURM_JOB_ID={job}".encode(), f"RANK={rank}".encode()}
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if wanted <= set(environ.read_bytes().split(b"\0")):
                return int(environ.parent.name)
        except OSError:
            continue
    return None


@pytest.mark.slurm
@pytest.mark.multirank
def test_slurm_job_log_names_a_rank_killed_by_a_signal(tmp_path, data, slurm):
    run = tmp_path / "run"
    job = submit_job(
        slurm,
        train_args(
            run, data, 2, "parallel.zero_stage=1", "train.checkpoint_interval=2", steps=10_000
        ),
        "1",
    )
    wait_for(
        lambda: (run / "checkpoints/step-00000002/complete.json").exists(),
        300,
        "the first checkpoint",
        lambda: slurm.story(job, run),
    )
    pid = wait_for(lambda: _slurm_rank_pid(job, 1), 60, "rank 1's process")
    os.kill(pid, 9)
    state = wait_for(
        lambda: (s := slurm.job_state(job))["JobState"] in ("COMPLETED", "FAILED") and s,
        300,
        "the job to end",
    )
    out = job_log(run)
    assert state["ExitCode"] == f"{RANK_LOST_EXIT_CODE}:0", out[-4000:]
    assert f"rank 1 (pid {pid}) was killed by SIGKILL; stopping the others" in out
    newest = sorted(p.parent.name for p in run.glob("checkpoints/step-*/complete.json"))[-1]
    assert f"the steps since {newest} are lost; rerun the same command to resume from it" in out
    assert "Traceback" not in out, out[-4000:]


def test_the_grace_is_sized_from_the_save_and_must_fit_in_the_time_limit(capsys):
    cfg = load_config("13b-h4b16k", overrides=[DATA])
    slow = at_site("a100-80g").model_copy(update={"storage_gb_per_s": 0.5})
    est = save_estimate(cfg, slow, 2)
    assert est.seconds == pytest.approx(est.bytes / (2 * 0.5e9)) and est.grace > MIN_GRACE_SECONDS
    assert est.grace == grace_seconds(est.step_seconds, est.seconds)
    # checkpoints in object storage: the upload after the local write
    stored = load_config(
        "13b-h4b16k",
        overrides=[DATA, "train.checkpoint_dir=s3://b/r", "train.checkpoint_staging=/tmp/r"],
    )
    uploaded = save_estimate(stored, slow.model_copy(update={"upload_gb_per_s": 0.25}), 2)
    assert uploaded.seconds == pytest.approx(est.bytes / (2 * 0.5e9) + est.bytes / (2 * 0.25e9))
    assert uploaded.grace > est.grace and "then uploaded at 0.25 GB/s per node" in uploaded.rates
    script = render(
        SLURM, cfg, slow, nodes=2, run_dir=Path("/r"), preset="13b-h4b16k", overrides=[DATA]
    )
    assert (
        f"#SBATCH --signal=USR1@{est.grace}\n" in script
        and f"MHF_DIST_GRACE_SECONDS={est.grace} " in script
    )
    # an asked grace shorter than the estimate is used, with a warning
    assert "#SBATCH --signal=USR1@200\n" in render(
        SLURM, cfg, slow, nodes=2, run_dir=Path("/r"), overrides=[DATA], grace=200
    )
    assert (
        f"--grace 200 is shorter than the {est.grace} s a save on SLURM's signal needs"
        in capsys.readouterr().err
    )
    # a time limit no longer than the grace would never train
    with pytest.raises(
        ConfigError, match=rf"time limit \(0:03:00\) is not longer than the {est.grace} s"
    ):
        render(
            SLURM,
            cfg,
            slow.model_copy(update={"time": "0:03:00"}),
            nodes=2,
            run_dir=Path("/r"),
            overrides=[DATA],
        )


def test_grace_seconds_covers_a_step_and_a_save():
    assert grace_seconds(0.0, 1.0) == MIN_GRACE_SECONDS
    assert grace_seconds(10.0, 100.0) == 200  # 1.5 × 110 + 30 = 195, rounded up to ten seconds


@pytest.mark.parametrize(
    "limit, seconds",
    [
        ("30", 1800),
        ("30:15", 1815),
        ("1:00:00", 3600),
        ("2-00:00:00", 172800),
        ("2-3", 183600),
        ("1-0:30", 88200),
        ("UNLIMITED", None),
        ("infinite", None),
    ],
)
def test_time_limits_are_read_as_slurm_reads_them(limit, seconds):
    assert time_limit_seconds(limit) == seconds


def test_an_unreadable_time_limit_is_named():
    with pytest.raises(ConfigError, match="'two days' is not a SLURM time limit"):
        time_limit_seconds("two days")


def test_a_mixtures_relative_sources_are_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blend = "data.path=0.7 shards/web 0.3 /shared/code"
    cfg = load_config("1b-h4b16k", overrides=[blend])
    script = render(
        SLURM,
        cfg,
        load_profile(SITE),
        nodes=2,
        run_dir=Path("/r"),
        preset="1b-h4b16k",
        overrides=[blend],
    )
    listed = [
        {"path": str(tmp_path / "shards/web"), "weight": 0.7},
        {"path": "/shared/code", "weight": 0.3},
    ]
    assert (
        shlex.quote(f"data.sources={json.dumps(listed)}") in script and "data.path=" not in script
    )


# ---------------------------------------------------------------- submit-data: prepare-data over a SLURM array
DATA_CASES = {  # golden file prefix: (profile, parts, options)
    "cpu-local-3parts": ("cpu-local", 3, ["--seq-len", "2048", "--val-fraction", "0.001"]),
    "a100-80g-site-64parts": (
        SITE,
        64,
        ["--seq-len", "4096", "--text-field", "content", "--overwrite"],
    ),
}


def rendered_data(name: str) -> dict[str, str]:
    profile, parts, options = DATA_CASES[name]
    scripts = render_data(
        load_profile(profile),
        ["/shared/text/*.jsonl.zst"],
        tokenizer="/shared/tok",
        out=Path("/shared/data"),
        parts=parts,
        options=options,
        python="/opt/venv/bin/python",
    )
    return {f"{name}.{script_name}": script for script_name, script in zip(DATA_SCRIPTS, scripts)}


@pytest.mark.parametrize("name", list(DATA_CASES))
def test_rendered_data_scripts_match_reviewed_golden_files(name):
    for golden, script in rendered_data(name).items():
        if os.environ.get("MHF_DIST_UPDATE_GOLDEN"):
            (GOLDEN / golden).write_text(script)
        assert script == (GOLDEN / golden).read_text(), golden


def _fake_sbatch(bin_dir: Path, log: Path, refuse_dependent: bool = False) -> None:
    """An ``sbatch`` that records its arguments and answers job ids 101, 102, ... (or refuses a job with
    ``--dependency``)."""
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(
        f"#!{sys.executable}\nimport json, sys\ncalls = open({str(log)!r}, 'a+')\ncalls.seek(0)\n"
        "n = len(calls.readlines())\ncalls.write(json.dumps(sys.argv[1:]) + '\\n')\n"
        f"if {refuse_dependent} and any(a.startswith('--dependency') for a in sys.argv):\n"
        "    sys.exit('sbatch: error: Job dependency problem')\nprint(101 + n)\n"
    )
    (bin_dir / "sbatch").chmod(0o755)


def test_submit_data_submits_the_merge_after_the_array(tmp_path, monkeypatch, capsys):
    text = tmp_path / "text"
    text.mkdir()
    for name in ("a", "b", "c"):
        (text / f"{name}.txt").write_text("a document\n")
    log, out = tmp_path / "calls.jsonl", tmp_path / "data"
    _fake_sbatch(tmp_path / "bin", log)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.chdir(tmp_path)
    args = [
        "submit-data",
        "text/*.txt",
        "--tokenizer",
        "tok",
        "--out",
        "data",
        "--seq-len",
        "64",
        "--cluster",
        "cpu-local",
    ]
    assert main([*args, "--parts", "4"]) == 2
    assert (
        "the inputs are 3 files, fewer than 4 parts (a part holds whole files); use at most 3"
        in capsys.readouterr().err
    )
    assert main([*args, "--parts", "3"]) == 0
    assert (
        "submitted array job 101 (3 parts) and merge job 102 (after all parts succeed)"
        in capsys.readouterr().out
    )
    scripts = [out / "jobs" / name for name in DATA_SCRIPTS]
    assert [json.loads(line) for line in log.read_text().splitlines()] == [
        ["--parsable", str(scripts[0])],
        ["--parsable", "--dependency=afterok:101", str(scripts[1])],
    ]
    # absolute
    assert f"'{text}/*.txt' --tokenizer {tmp_path / 'tok'} --out {out} " in scripts[0].read_text()
    log.unlink()
    _fake_sbatch(tmp_path / "bin2", log, refuse_dependent=True)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin2'}:{os.environ['PATH']}")
    assert main([*args, "--parts", "3"]) == 2
    assert (
        "sbatch refused the job: sbatch: error: Job dependency problem; the parts are being prepared (array job "
        f"101): merge them after it with sbatch --dependency=afterok:101 {scripts[1]}"
    ) in capsys.readouterr().err


@pytest.mark.slow
def test_the_rendered_array_tasks_and_merge_prepare_the_one_process_shards(tmp_path, bpe_dir):
    """Each array task's script run as SLURM would (SLURM_ARRAY_TASK_ID set; srun runs its command), then the
    merge's: the merged data read as a one-process preparation of the same inputs."""
    from mhf_dist.data.prepare import prepare
    from mhf_dist.data.reader import ShardReader
    from mhf_dist.vocab.tokenizers import embedded_corpus

    docs = [d.strip() for d in list(embedded_corpus())[:30]]
    text = tmp_path / "text"
    text.mkdir()
    for k in range(3):
        (text / f"{k}.txt").write_text("\n\n".join(docs[10 * k : 10 * k + 10]) + "\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(
        '#!/bin/sh\nwhile [ "${1#-}" != "$1" ]; do shift; done\nexec "$@"\n'
    )  # options off
    (bin_dir / "srun").chmod(0o755)
    out, options = (
        tmp_path / "data d'ir",
        ["--seq-len", "32", "--samples-per-shard", "50", "--val-fraction", "0.2"],
    )
    scripts = render_data(
        load_profile("cpu-local"),
        [str(text / "*.txt")],
        tokenizer=str(bpe_dir),
        out=out,
        parts=3,
        options=options,
        workers=1,
        python=sys.executable,
    )
    env = os.environ | {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "PYTHONPATH": str(Path(__file__).parents[1]),
    }
    for task in ("3", "1", "2"):
        proc = subprocess.run(
            ["bash", "-c", scripts[0]],
            env=env | {"SLURM_ARRAY_TASK_ID": task},
            cwd=tmp_path,
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = subprocess.run(
        ["bash", "-c", scripts[1]], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    assert proc.returncode == 0 and "merged 3 parts" in proc.stdout, proc.stdout + proc.stderr
    prepare(
        [text / f"{k}.txt" for k in range(3)],
        bpe_dir,
        tmp_path / "one",
        seq_len=32,
        samples_per_shard=50,
        val_fraction=0.2,
        progress=False,
    )
    for split in ("train", "val"):
        streams = []
        for source in (out, tmp_path / "one"):
            with ShardReader(source, split=split, seed=3, shuffle_window=2) as reader:
                streams.append(reader.next_batch(reader.samples_per_epoch).tolist())
        assert streams[0] == streams[1]


def test_an_elastic_round_takes_the_largest_dp_the_nodes_left_allow_and_tells_why(tmp_path):
    from mhf_dist.cluster.elastic import TooFewNodes, plan_round
    from mhf_dist.storage.run_dir import RunDir

    cfg = load_config(
        "tiny-h4b16k",
        overrides=["parallel.tp=2", "train.global_batch_size=12", "train.micro_batch_size=2"],
    )
    run = RunDir(tmp_path / "run")
    first = plan_round(cfg, run, up=["n1", "n2", "n3"], lost=[], tasks_per_node=2, min_nodes=2)
    assert first.shell() == "NODELIST=n1,n2,n3 NNODES=3 NTASKS=6 lost=''" and first.layout.dp == 3
    run.heartbeats_dir.mkdir(parents=True)
    (run.heartbeats_dir / "lost.json").write_text(json.dumps({"nodes": ["n3"], "ranks": [4, 5]}))
    second = plan_round(cfg, run, up=["n1", "n2"], lost=["n3"], tasks_per_node=2, min_nodes=2)
    assert second.shell() == "NODELIST=n1,n2 NNODES=2 NTASKS=4 lost=n3" and second.layout.dp == 2
    assert second.story == [
        "lost: node n3 (ranks 4, 5): no longer runs a task",
        "kept: no checkpoint yet: the run starts again from step 0",
        "chose: dp 2 (was dp 3 on 3 nodes) on 2 nodes (n1, n2), 4 ranks: tp 2 x pp 1 kept, the most of the 2 "
        "answering nodes of 2 ranks (at least the minimum of 2) whose ranks all train the global batch 12 = dp 2 x 3 "
        "micro-batches of 2",
    ]
    # 5 nodes of 2 allow dp 5; 12 sequences in micro-batches of 2 (set, so kept) split over dp 3 at most: 3 nodes
    five = plan_round(
        cfg, run, up=["n1", "n2", "n3", "n4", "n5"], lost=[], tasks_per_node=2, min_nodes=2
    )
    assert five.shell() == "NODELIST=n1,n2,n3 NNODES=3 NTASKS=6 lost=''"
    assert five.story[-1] == (
        "idle: 2 answering nodes (n4, n5; 4 ranks) wait this round out: more nodes do not "
        "train the global batch 12 in micro-batches of 2 with every rank busy (dp 5 on 5 nodes; "
        "dp 4 on 4 nodes)"
    )
    with pytest.raises(
        TooFewNodes, match=r"1 node left \(n1; lost: n2, n3\), fewer than the job's minimum of 2"
    ):
        plan_round(cfg, run, up=["n1"], lost=["n2", "n3"], tasks_per_node=2, min_nodes=2)

    # the ranks of n2 stopped answering while n2 still runs a task: it is left out too
    (run.heartbeats_dir / "lost.json").write_text(json.dumps({"nodes": ["n2"], "ranks": [2, 3]}))
    third = plan_round(
        cfg, run, up=["n1", "n2"], lost=["n3"], tasks_per_node=2, min_nodes=1, ranks_lost=True
    )
    assert third.shell() == "NODELIST=n1 NNODES=1 NTASKS=2 lost='n3 n2'"
    assert (
        third.story[0]
        == "lost: node n2 (ranks 2, 3): its ranks stopped answering, though it still runs a task"
    )
    with pytest.raises(TooFewNodes) as too_few:
        plan_round(
            cfg, run, up=["n1", "n2"], lost=["n3"], tasks_per_node=2, min_nodes=2, ranks_lost=True
        )
    assert too_few.value.lost == ["n3", "n2"]
    (
        run.heartbeats_dir / "lost.json"
    ).unlink()  # nothing names the ranks' node: no round on the same nodes again
    with pytest.raises(ConfigError, match="none is named as theirs"):
        plan_round(
            cfg, run, up=["n1", "n2"], lost=["n3"], tasks_per_node=2, min_nodes=1, ranks_lost=True
        )


def test_an_elastic_round_uses_whole_nodes_and_never_runs_below_the_minimum(tmp_path):
    """Every rank of a round is busy and a round has at least MIN nodes: where the nodes left train the batch only
    with idle ranks or below MIN, it is as if fewer than MIN were left (the job is queued again without the lost)."""
    from mhf_dist.cluster.elastic import TooFewNodes, plan_round
    from mhf_dist.storage.run_dir import RunDir

    def config(batch: int):
        return load_config(
            "tiny-h4b16k",
            overrides=[f"train.global_batch_size={batch}", "train.micro_batch_size=1"],
        )

    run = RunDir(tmp_path / "run")
    # 2 nodes of 2 ranks: dp 4 does not divide 6, and dp 3 would leave a rank idle
    with pytest.raises(
        TooFewNodes,
        match=r"2 nodes left \(n1, n2; lost: n3\), and no count of them from the job's "
        r"minimum of 2 up trains the global batch 6 in micro-batches of 1 with every rank busy "
        r"\(dp 4 on 2 nodes\)",
    ) as too_few:
        plan_round(config(6), run, up=["n1", "n2"], lost=["n3"], tasks_per_node=2, min_nodes=2)
    assert too_few.value.lost == ["n3"]
    # 4 nodes left of a 4-5 job with a batch of 10: dp 5 on 3 nodes would be below the minimum
    with pytest.raises(TooFewNodes, match=r"\(dp 8 on 4 nodes\)$"):
        plan_round(
            config(10), run, up=["n1", "n2", "n3", "n4"], lost=["n5"], tasks_per_node=2, min_nodes=4
        )
    # nothing lost, and the allocation trains nothing: queueing it again would meet the same
    with pytest.raises(ConfigError, match="the job stops; submit it again with a batch") as stops:
        plan_round(
            config(10), run, up=["n1", "n2", "n3", "n4"], lost=[], tasks_per_node=2, min_nodes=4
        )
    assert not isinstance(stops.value, TooFewNodes)

    # 5 of 6 nodes left with a batch of 12 and a minimum of 3: dp 10 and dp 8 do not divide it; 3 nodes do, 2 wait
    chosen = plan_round(
        config(12),
        run,
        up=["n1", "n2", "n3", "n4", "n5"],
        lost=["n6"],
        tasks_per_node=2,
        min_nodes=3,
    )
    assert chosen.shell() == "NODELIST=n1,n2,n3 NNODES=3 NTASKS=6 lost=n6" and chosen.layout.dp == 6
    assert chosen.story[-1] == (
        "idle: 2 answering nodes (n4, n5; 4 ranks) wait this round out: more nodes do not "
        "train the global batch 12 in micro-batches of 1 with every rank busy (dp 10 on 5 "
        "nodes; dp 8 on 4 nodes)"
    )
    # tp x pp that a node count's ranks do not fit is said as such
    cfg = load_config(
        "tiny-h4b16k",
        overrides=["parallel.tp=4", "train.global_batch_size=8", "train.micro_batch_size=1"],
    )
    odd = plan_round(cfg, run, up=["n1", "n2", "n3"], lost=[], tasks_per_node=2, min_nodes=2)
    assert odd.shell() == "NODELIST=n1,n2 NNODES=2 NTASKS=4 lost=''"
    assert odd.story[-1].endswith("(6 ranks, no multiple of tp x pp = 4, on 3 nodes)")


@pytest.mark.parametrize(
    "nodes, batch, said",
    [
        (
            "2-3",
            6,
            "--nodes 2-3: no count of nodes below 3 trains the global batch 6 in micro-batches of 1 with every "
            "rank busy (2 ranks a node, tp 1 x pp 1: dp 4 on 2 nodes), so a lost node would end the job's rounds; "
            "use train.global_batch_size=12 (2 and 3 nodes train it), --nodes 1-3 (1 node trains it) or a fixed "
            "--nodes 3",
        ),
        (
            "4-5",
            10,
            "--nodes 4-5: no count of nodes below 5 trains the global batch 10 in micro-batches of 1 with every "
            "rank busy (2 ranks a node, tp 1 x pp 1: dp 8 on 4 nodes), so a lost node would end the job's "
            "rounds; use train.global_batch_size=40 (4 and 5 nodes train it), --nodes 1-5 (1 node trains it) or "
            "a fixed --nodes 5",
        ),
        (
            "5-8",
            48,
            "--nodes 5-8: 5 nodes do not train the global batch 48 in micro-batches of 1 with every rank busy (2 "
            "ranks a node, tp 1 x pp 1: dp 10 on 5 nodes), and SLURM may start the job on the minimum; raise it "
            "to 6 (--nodes 6-8)",
        ),
        ("2-3", 12, None),
    ],
    ids=[
        "a-rank-idle-after-a-loss",
        "below-the-minimum-after-a-loss",
        "a-minimum-that-cannot-train",
        "accepted",
    ],
)
def test_submit_says_which_node_counts_of_an_elastic_range_train_the_batch(
    tmp_path, capsys, nodes, batch, said
):
    args = [
        "submit",
        "--preset",
        "tiny-h4b16k",
        "--set",
        f"train.global_batch_size={batch}",
        "--set",
        "train.micro_batch_size=1",
        "--cluster",
        "cpu-local",
        "--nodes",
        nodes,
        "--run-dir",
        str(tmp_path / "r"),
        "--dry-run",
    ]
    code, out = main(args), capsys.readouterr()
    if said:
        assert code == 2 and said in out.err and not out.out, out.err
        return
    assert code == 0 and "#SBATCH --nodes=2-3" in out.out
    assert (
        "elastic: of 2-3 nodes (2 ranks a node, tp 1 x pp 1), these train the global batch 12 in micro-batches of "
        "1 with every rank busy: 3 (dp 6), 2 (dp 4); after a loss each round runs on the most of these that the "
        "nodes left allow (any other node waits, idle), and with fewer than 2 left the job is queued again "
        "without the lost ones"
    ) in out.err


def test_submit_of_a_run_directory_without_a_preset_uses_its_config_yaml(tmp_path, capsys):
    """As ``train --run-dir RUN`` does: the job's ranks resume with RUN/config.yaml, which submit checks first."""
    from mhf_dist.storage.run_dir import RunDir

    run = tmp_path / "run"
    args = [
        "submit",
        "--cluster",
        "cpu-local",
        "--nodes",
        "1-2",
        "--run-dir",
        str(run),
        "--dry-run",
    ]
    assert main(args) == 2
    assert f"no configuration: {run} holds no config.yaml to resume with" in capsys.readouterr().err
    RunDir(run).save_config(
        load_config(
            "tiny-h4b16k", overrides=["train.global_batch_size=6", "train.micro_batch_size=1"]
        )
    )
    assert main(args) == 2  # checked as the config.yaml's own: dp 4 on 2 nodes does not divide 6
    err = capsys.readouterr().err
    assert (
        "train.global_batch_size=6 is not a multiple of train.micro_batch_size × dp = 1 × 4" in err
    )
    assert main([*args, "--set", "train.global_batch_size=12"]) == 0
    out = capsys.readouterr()
    train = next(line for line in out.out.splitlines() if " train --run-dir " in line)
    assert (
        f"train --run-dir {run} --set train.global_batch_size=12" in train
        and "--preset" not in train
    )
    assert (
        "these train the global batch 12 in micro-batches of 1 with every rank busy: 2 (dp 4), 1 (dp 2)"
        in out.err
    )


def _job_commands(
    bin_dir: Path, run: Path, calls: Path, sbatch: str = "echo 42", lost_nodes=("n2",)
) -> None:
    """``scontrol`` (node names), ``srun`` (a probe succeeds; the ranks' first step loses ``lost_nodes``: they record
    them and srun exits 143, as a real one does when --kill-on-bad-exit's SIGTERM ended a rank before it exited 88;
    a later step exits 0) and ``sbatch`` (``sbatch``: its shell body), each recording its arguments."""
    bin_dir.mkdir()
    record = (
        f'{sys.executable} -c "import json, sys; print(json.dumps(sys.argv[1:]))" "$(basename "$0")" "$@" '
        f">> {calls}"
    )
    lost = json.dumps({"nodes": list(lost_nodes), "ranks": [2, 3], "time": 0, "step": 2})
    bodies = {
        "scontrol": 'case "$1 $2" in "show hostnames") echo "$3" | tr , "\\n" ;; esac',
        "srun": (
            f'case "$*" in *" true") exit 0 ;; esac\n'
            f"if [ ! -e {run}/ranks-lost-once ]; then touch {run}/ranks-lost-once; "
            f"mkdir -p {run}/heartbeats; echo '{lost}' > {run}/heartbeats/lost.json; exit 143; fi"
        ),
        "sbatch": sbatch,
    }
    for name, body in bodies.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{record}\n{body}\n")
        (bin_dir / name).chmod(0o755)


def _run_job(
    tmp_path: Path, script: str, nodes: str
) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    path = tmp_path / "job.sh"
    path.write_text(script)
    env = os.environ | {
        "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": nodes,
    }
    proc = subprocess.run(
        ["bash", str(path)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    calls = tmp_path / "calls.jsonl"
    return proc, [
        json.loads(line) for line in calls.read_text().splitlines()
    ] if calls.exists() else []


def test_a_job_whose_ranks_lost_a_node_queues_itself_again_without_it(tmp_path):
    """A fixed-size job: the ranks end with exit 88 naming n2; the script submits itself again, to start after this
    job, excluding n2 and what earlier requeues excluded, recorded where ``status`` looks; a refused one is said."""
    cfg = load_config("tiny-h4b16k", overrides=["train.micro_batch_size=2"])
    run = tmp_path / "run"
    script = render(
        SLURM,
        cfg,
        load_profile("cpu-local"),
        nodes=2,
        run_dir=run,
        preset="tiny-h4b16k",
        overrides=["train.micro_batch_size=2"],
        python=sys.executable,
    )
    run.joinpath("jobs").mkdir(parents=True)
    run.joinpath("jobs/jobs.jsonl").write_text(
        json.dumps({"job_id": "7", "cluster": "cpu-local", "nodes": 2, "excluded": ["n5"]}) + "\n"
    )
    _job_commands(tmp_path / "bin", run, tmp_path / "calls.jsonl")
    proc, calls = _run_job(tmp_path, script, "n1,n2")
    assert proc.returncode == NODE_LOST_EXIT_CODE, proc.stderr
    sbatch = [c for c in calls if c[0] == "sbatch"]
    assert sbatch == [
        [
            "sbatch",
            "--parsable",
            "--exclude=n2,n5",
            "--dependency=afterany:7",
            str(tmp_path / "job.sh"),
        ]
    ]
    assert (
        "requeue: queued again as job 42 without n2, n5, to start when job 7 ends; kept: no checkpoint yet: the "
        "run starts again from step 0"
    ) in proc.stderr
    last = json.loads(run.joinpath("jobs/jobs.jsonl").read_text().splitlines()[-1])
    assert last | {"submitted": None} == {
        "job_id": "42",
        "submitted": None,
        "cluster": "cpu-local",
        "nodes": 2,
        "script": str(tmp_path / "job.sh"),
        "scheduler": "slurm",
        "requeue_of": "7",
        "excluded": ["n2", "n5"],
    }

    # too few nodes without them: sbatch refuses, and the job log says the job stops
    for p in (tmp_path / "bin", run / "ranks-lost-once", tmp_path / "calls.jsonl"):
        subprocess.run(["rm", "-r", str(p)], check=True)
    _job_commands(
        tmp_path / "bin",
        run,
        tmp_path / "calls.jsonl",
        'echo "sbatch: error: Batch job submission failed: Requested node configuration is not available" '
        ">&2; exit 1",
    )
    proc, _ = _run_job(tmp_path, script, "n1,n2")
    assert proc.returncode == NODE_LOST_EXIT_CODE
    assert (
        "sbatch refused the job: sbatch: error: Batch job submission failed: Requested node configuration is not "
        "available; nothing was queued without n2, n5: the job stops; submit it again to resume from the newest "
        "checkpoint"
    ) in proc.stderr


@pytest.mark.parametrize(
    "lost, rounds", [(["n2"], 2), (["n2", "n3"], 1)], ids=["goes-on", "requeued"]
)
def test_an_elastic_job_leaves_out_a_node_whose_ranks_were_lost(tmp_path, lost, rounds):
    """A 2-3 node job: every node answers SLURM, but the ranks of ``lost`` were lost (exit 88): the next round runs
    without them; where that leaves fewer than the minimum, the job is queued again without them."""
    overrides = ["train.global_batch_size=12", "train.micro_batch_size=1"]
    cfg = load_config("tiny-h4b16k", overrides=overrides)
    run = tmp_path / "run"
    script = render(
        SLURM,
        cfg,
        load_profile("cpu-local"),
        nodes=3,
        run_dir=run,
        preset="tiny-h4b16k",
        overrides=overrides,
        python=sys.executable,
        min_nodes=2,
    )
    _job_commands(tmp_path / "bin", run, tmp_path / "calls.jsonl", lost_nodes=lost)
    proc, calls = _run_job(tmp_path, script, "n1,n2,n3")
    trains = [c for c in calls if c[0] == "srun" and "train" in c]
    assert len(trains) == rounds and "--nodelist=n1,n2,n3" in trains[0], proc.stdout + proc.stderr
    said = "node n2 (ranks 2, 3)" if rounds == 2 else "nodes n2, n3 (ranks 2, 3)"
    assert (
        f"elastic: lost: {said}: its ranks stopped answering, though it still runs a task"
        in proc.stderr
    )
    if rounds == 2:
        assert (
            proc.returncode == 0
            and "--nodelist=n1,n3" in trains[1]
            and "round 1 on n1,n3 (4 ranks)" in proc.stdout
        )
    else:
        assert proc.returncode == 2 and [c for c in calls if c[0] == "sbatch"] == [
            [
                "sbatch",
                "--parsable",
                "--exclude=n2,n3",
                "--dependency=afterany:7",
                str(tmp_path / "job.sh"),
            ]
        ]
        assert (
            "elastic: queued again as job 42 without n2, n3, to start when job 7 ends"
            in proc.stderr
        )


def test_an_elastic_job_is_checked_at_its_minimum_and_needs_slurm():
    cfg = load_config("tiny-h4b16k", overrides=["parallel.tp=2", "train.micro_batch_size=2"])
    profile = load_profile("cpu-local")
    with pytest.raises(
        ConfigError, match="--nodes 2-2: the minimum must be at least 1 and below the maximum"
    ):
        render(SLURM, cfg, profile, nodes=2, run_dir=Path("/r"), min_nodes=2)
    with pytest.raises(ConfigError, match="needs SLURM"):
        render(HOSTFILE, cfg, profile, nodes=2, run_dir=Path("/r"), min_nodes=1, hostfile="/h")
    script = render(SLURM, cfg, profile, nodes=2, run_dir=Path("/r"), min_nodes=1)
    assert (
        "#SBATCH --nodes=1-2\n" in script
        and "#SBATCH --no-kill\n" in script
        and "elastic-plan" in script
    )
