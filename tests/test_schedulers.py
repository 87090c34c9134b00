"""Schedulers as an extension point: the registry, a toy scheduler from the tests chosen, rendered for, submitted to
and asked about, the profile's scheduler and options (and its older flat form), and run directories of the older
job directory name."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

import mhf_dist.cluster.scheduler as registry
from helpers.toy_scheduler import Toy
from mhf_dist.cli import main
from mhf_dist.cluster.files import PROFILE_DIR
from mhf_dist.cluster.profile import load_profile
from mhf_dist.cluster.scheduler import register, scheduler, schedulers
from mhf_dist.cluster.scheduler.slurm import SLURM, SlurmOptions
from mhf_dist.config import ConfigError
from mhf_dist.storage.run_dir import RunDir

ROOT = Path(__file__).parents[1]
TINY = ["--preset", "tiny-h4b16k", "--set", "train.micro_batch_size=4"]


@pytest.fixture
def toy(monkeypatch):
    """The toy scheduler, registered for one test: the registry as it was comes back after it."""
    monkeypatch.setattr(registry, "_REGISTRY", schedulers())
    return register(Toy())


def submit_args(run: Path, *more: str) -> list[str]:
    return ["submit", *TINY, "--cluster", "cpu-local", "--run-dir", str(run), *more]


def test_the_registry_holds_the_shipped_schedulers_and_refuses_impostors(toy):
    assert list(schedulers()) == ["slurm", "hostfile", "toy"] and scheduler("toy") is toy
    assert register(toy) is toy and len(schedulers()) == 3  # the same one again changes nothing
    with pytest.raises(ValueError, match="another scheduler is registered as 'toy'"):
        register(Toy())
    with pytest.raises(TypeError, match="is not a scheduler"):
        register(object())


def test_a_toy_scheduler_from_the_tests_is_listed_chosen_and_renders_its_script(
    toy, tmp_path, capsys
):
    with pytest.raises(SystemExit):
        main(["submit", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "--scheduler {slurm,hostfile,toy}" in shown and "--toy-queue TOY_QUEUE" in shown
    run = tmp_path / "run"
    assert main(submit_args(run, "--scheduler", "toy", "--dry-run")) == 0
    script = capsys.readouterr().out
    assert script.startswith(
        f"#!/bin/bash\n# toy job (profile cpu-local) on queue default: 1 node(s) x 2 rank(s), "
        f"logs in {run}/jobs\n"
    )
    assert (
        f"-m mhf_dist train --run-dir {run} --preset tiny-h4b16k --set train.micro_batch_size=4"
        in script
    )
    assert "#SBATCH" not in script and not run.exists()  # printed only
    assert main(submit_args(run, "--scheduler", "toy", "--toy-queue", "fast", "--dry-run")) == 0
    assert "on queue fast:" in capsys.readouterr().out
    assert (
        main(
            submit_args(
                run,
                "--scheduler",
                "toy",
                "--nodes",
                "1-2",
                "--set",
                "train.micro_batch_size=2",
                "--dry-run",
            )
        )
        == 2
    )
    assert "the toy scheduler runs jobs of a fixed size only" in capsys.readouterr().err


def test_a_profile_names_its_scheduler_and_that_schedulers_options(toy, tmp_path, capsys):
    site = tmp_path / "toy-site.yaml"
    site.write_text(
        yaml.safe_dump(
            {
                "name": "toy-site",
                "extends": "cpu-local",
                "scheduler": "toy",
                "scheduler_options": {"toy": {"queue": "night"}},
            }
        )
    )
    args = [
        "submit",
        *TINY,
        "--cluster",
        str(site),
        "--run-dir",
        str(tmp_path / "run"),
        "--dry-run",
    ]
    assert main(args) == 0
    assert "# toy job (profile toy-site) on queue night:" in capsys.readouterr().out
    # another scheduler than the profile's, with its defaults
    assert main([*args, "--scheduler", "slurm"]) == 0
    assert "#SBATCH --nodes=1\n" in capsys.readouterr().out


def test_a_job_submitted_to_the_toy_is_recorded_in_run_jobs_and_status_asks_the_toy(
    toy, tmp_path, capsys, monkeypatch
):
    run = tmp_path / "run"
    assert main(submit_args(run, "--scheduler", "toy")) == 0
    assert f"submitted job toy-1; logs: {run}/jobs/" in capsys.readouterr().out
    assert toy.queued["toy-1"] == (run / "jobs" / "job.toy").read_text()
    record = json.loads((run / "jobs" / "jobs.jsonl").read_text())
    assert (record["job_id"], record["scheduler"], record["cluster"]) == (
        "toy-1",
        "toy",
        "cpu-local",
    )
    assert os.readlink(run / "slurm") == "jobs"  # the older name still leads there
    assert RunDir(run).jobs_dir == run / "jobs"
    assert main(["status", str(run), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert (got["job"]["job_id"], got["job"]["state"], got["job"]["source"]) == (
        "toy-1",
        "QUEUED",
        "toy",
    )
    assert got["slurm"] == got["job"]  # the key's older name, for scripts that read it
    assert main(["status", str(run)]) == 0
    assert "\njob        toy-1 QUEUED, 0 restarts (submitted " in capsys.readouterr().out
    # read where the toy is not registered: the job's state is unknown, and status still answers
    monkeypatch.setattr(
        registry, "_REGISTRY", {k: v for k, v in schedulers().items() if k != "toy"}
    )
    assert main(["status", str(run)]) == 0
    assert "job        toy-1 state unknown" in capsys.readouterr().out


def test_hostfile_implies_its_scheduler_and_a_contradiction_is_refused(tmp_path, capsys):
    run, hosts = tmp_path / "r", str(tmp_path / "hosts")
    assert main(submit_args(run, "--hostfile", hosts, "--dry-run")) == 0
    implied = capsys.readouterr().out
    assert f"deepspeed.launcher.runner --hostfile {hosts} " in implied and "#SBATCH" not in implied
    assert main(submit_args(run, "--scheduler", "hostfile", "--hostfile", hosts, "--dry-run")) == 0
    assert capsys.readouterr().out == implied
    assert main(submit_args(run, "--scheduler", "hostfile", "--dry-run")) == 2
    assert "a job of the hostfile scheduler needs --hostfile FILE" in capsys.readouterr().err
    assert main(submit_args(run, "--scheduler", "slurm", "--hostfile", hosts, "--dry-run")) == 2
    assert (
        "--hostfile names the nodes of a hostfile job, which --scheduler slurm does not start"
        in capsys.readouterr().err
    )
    with pytest.raises(SystemExit) as refused:
        main(submit_args(run, "--scheduler", "pbs", "--dry-run"))
    assert refused.value.code == 2 and "invalid choice: 'pbs'" in capsys.readouterr().err
    assert (
        main(submit_args(run, "--dry-run")) == 0 and "#SBATCH" in capsys.readouterr().out
    )  # the profile's: slurm


# ---------------------------------------------------------------- profiles
def write(path: Path, fields: dict) -> str:
    path.write_text(yaml.safe_dump(fields))
    return str(path)


SITE = {"partition": "gpu", "time": "1:00:00", "python": "python"}


def test_a_profile_in_the_older_flat_form_loads_as_the_nested_one(tmp_path):
    own = {"sbatch_args": ["--constraint=a100"], "srun_args": ["--container-image=/i.sqsh"]}
    flat = load_profile(
        write(tmp_path / "flat.yaml", {"name": "s", "extends": "a100-80g", **SITE, **own})
    )
    nested = load_profile(
        write(
            tmp_path / "nested.yaml",
            {"name": "s", "extends": "a100-80g", **SITE, "scheduler_options": {"slurm": own}},
        )
    )
    assert (
        flat == nested
        and flat.scheduler == "slurm"
        and flat.options_of(SLURM) == SlurmOptions(**own)
    )
    # srun_args: pyxis's container
    assert SLURM.in_container(flat) and scheduler("hostfile").in_container(flat)

    # extends: the site's values replace the base's one by one, in either form
    base = write(
        tmp_path / "base.yaml",
        yaml.safe_load((ROOT / "cluster" / "cpu-local.yaml").read_text()) | own,
    )
    site = load_profile(
        write(
            tmp_path / "site.yaml",
            {"name": "s", "extends": base, "sbatch_args": ["--constraint=h100"]},
        )
    )
    assert site.options_of(SLURM) == SlurmOptions(
        sbatch_args=["--constraint=h100"], srun_args=own["srun_args"]
    )
    site = load_profile(
        write(
            tmp_path / "site2.yaml",
            {"name": "s", "extends": base, "scheduler_options": {"slurm": {"srun_args": []}}},
        )
    )
    assert site.options_of(SLURM) == SlurmOptions(sbatch_args=own["sbatch_args"])


@pytest.mark.parametrize(
    "fields, said",
    [
        (
            {"sbatch_args": ["--a"], "scheduler_options": {"slurm": {"sbatch_args": ["--b"]}}},
            "sbatch_args: given both at the top level and in scheduler_options.slurm",
        ),
        ({"scheduler": "pbs"}, "no scheduler 'pbs'; the schedulers are slurm, hostfile"),
        ({"scheduler_options": {"pbs": {}}}, "no scheduler 'pbs'"),
        (
            {"scheduler_options": {"slurm": {"sbatch_arg": ["--a"]}}},
            "sbatch_arg\n.*Extra inputs are not permitted",
        ),
        ({"scheduler_options": {"hostfile": {"nodes": 2}}}, "Extra inputs are not permitted"),
    ],
    ids=[
        "given-twice",
        "unknown-scheduler",
        "unknown-options",
        "misspelt-option",
        "options-of-none",
    ],
)
def test_a_profiles_scheduler_and_options_are_checked(tmp_path, fields, said):
    with pytest.raises(ConfigError, match=said):
        load_profile(write(tmp_path / "p.yaml", {"name": "p", "extends": "cpu-local", **fields}))


def test_the_shipped_profiles_and_the_site_example_load_unchanged():
    # the repository's cluster/ is the package's profiles
    assert (ROOT / "cluster").samefile(PROFILE_DIR)
    names = sorted(p.stem for p in (ROOT / "cluster").glob("*.yaml"))
    assert names == ["a100-80g", "cpu-local", "mi300x"]
    for name in names:
        profile = load_profile(name)
        assert profile == load_profile(str(ROOT / "cluster" / f"{name}.yaml"))
        assert profile.scheduler == "slurm" and profile.options_of(SLURM) == SlurmOptions()
    example = load_profile(str(ROOT / "docs" / "site-profile-example.yaml"))
    assert example.scheduler == "slurm" and example.partition == "gpu-a100"


# ---------------------------------------------------------------- run directories of the older layout
def test_a_run_directory_of_the_older_layout_keeps_its_slurm_directory(
    tmp_path, capsys, monkeypatch
):
    """A run submitted before the job directory was RUN/jobs: status, requeue and an elastic round read and write
    RUN/slurm, and a new submission into it logs there too."""
    from mhf_dist.cluster.elastic import plan_round
    from mhf_dist.config import load_config

    run, old = tmp_path / "run", tmp_path / "run" / "slurm"
    old.mkdir(parents=True)
    (old / "jobs.jsonl").write_text(
        json.dumps(
            {"job_id": "7", "submitted": "2026-12-01 03:00:00", "cluster": "cpu-local", "nodes": 2}
        )
        + "\n"
    )  # no scheduler named
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (
        ("scontrol", 'echo "JobId=$4 JobState=RUNNING Restarts=1"'),
        ("sbatch", "echo 8"),
    ):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    assert RunDir(run).jobs_dir == old

    assert main(["status", str(run), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["job"]
    assert (got["job_id"], got["state"], got["restarts"], got["source"]) == (
        "7",
        "RUNNING",
        1,
        "scontrol",
    )

    script = old / "job.sbatch"
    script.write_text("#!/bin/bash\n#SBATCH --exclude=n9\n")
    assert (
        main(
            [
                "requeue",
                "--run-dir",
                str(run),
                "--job",
                "7",
                "--script",
                str(script),
                "--lost",
                "n2",
            ]
        )
        == 0
    )
    assert (
        "requeue: queued again as job 8 without n2, n9, to start when job 7 ends"
        in capsys.readouterr().err
    )
    last = json.loads((old / "jobs.jsonl").read_text().splitlines()[-1])
    assert (last["job_id"], last["requeue_of"], last["excluded"], last["script"]) == (
        "8",
        "7",
        ["n2", "n9"],
        str(script),
    )

    (old / "elastic.json").write_text(json.dumps({"dp": 3, "nodes": 3, "ranks": 6}))
    cfg = load_config(
        "tiny-h4b16k",
        overrides=["parallel.tp=2", "train.global_batch_size=12", "train.micro_batch_size=2"],
    )
    chosen = plan_round(
        cfg, RunDir(run), up=["n1", "n2"], lost=["n3"], tasks_per_node=2, min_nodes=1
    )
    assert any("chose: dp 2 (was dp 3 on 3 nodes)" in line for line in chosen.story), chosen.story
    assert json.loads((old / "elastic.json").read_text())["dp"] == 2

    assert main(submit_args(run, "--write", str(tmp_path / "again.sbatch"))) == 0
    assert f"#SBATCH --output={old}/%x-%j.out" in (tmp_path / "again.sbatch").read_text()
    assert not (run / "jobs").exists() and not old.is_symlink()
    (run / "jobs").mkdir()  # once both are there, the newer name is the one
    assert RunDir(run).jobs_dir == run / "jobs"
