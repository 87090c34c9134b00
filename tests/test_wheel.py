"""The built wheel, installed non-editable into a separate venv and run from outside the checkout.

The venv sees this venv's packages (torch, DeepSpeed, ...) through a plain path in a ``.pth`` file, so nothing is
downloaded; that path is not a site directory, so this venv's editable ``mhf_dist`` stays out of it.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from helpers.runs import metrics

# the module's tests share a wheel built and installed into a fresh venv: half a minute together
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
GENERATED = (".git", ".venv", "build", "dist", "runs", "*.egg-info", "__pycache__", ".pytest_cache")


def _run(cmd: list, cwd: Path | None = None, expect_rc: int = 0, timeout: int = 600) -> str:
    """Run ``cmd``; asserts the exit code and returns stdout + stderr."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")
    }
    proc = subprocess.run(
        [str(c) for c in cmd],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env | {"DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == expect_rc, (
        f"{shlex.join(map(str, cmd))}: exit {proc.returncode}:\n{out[-5000:]}"
    )
    return out


def build_wheel(out: Path) -> Path:
    """The wheel of a copy of the checkout (building in place would leave build/ and egg-info there)."""
    src = out / "src"
    shutil.copytree(REPO, src, symlinks=True, ignore=shutil.ignore_patterns(*GENERATED))
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            out,
            src,
        ]
    )
    (wheel,) = out.glob("mhf_dist-*.whl")
    return wheel


def install_venv(venv: Path, wheel: Path) -> None:
    """A venv with ``wheel`` installed (by this venv's pip, which it finds through the ``.pth``)."""
    _run([sys.executable, "-m", "venv", "--without-pip", venv])
    python = venv / "bin" / "python"
    site = Path(
        _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip()
    )
    dev_site = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "dev-venv.pth").write_text("".join(f"{path}\n" for path in sorted(dev_site)))
    _run(
        [
            python,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--ignore-installed",
            wheel,
        ]
    )


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("wheel")
    install_venv(root / "venv", build_wheel(root))
    return root / "venv"


def cli(venv: Path, *args: str, cwd: Path, expect_rc: int = 0) -> str:
    """The venv's ``mhf-dist ARGS`` in ``cwd``."""
    return _run([venv / "bin" / "mhf-dist", *args], cwd=cwd, expect_rc=expect_rc)


def test_the_installed_package_lies_in_the_venv(venv, tmp_path):
    where = _run(
        [venv / "bin" / "python", "-c", "import mhf_dist; print(mhf_dist.__file__)"], cwd=tmp_path
    )
    path = Path(where.strip()).resolve()
    assert path.is_relative_to(venv.resolve()) and not path.is_relative_to(REPO), path


def test_plan_reads_the_shipped_profile_and_deepspeed_config(venv, tmp_path):
    out = cli(
        venv, "plan", "--preset", "3b-h4b16k", "--cluster", "a100-80g", "--nodes", "4", cwd=tmp_path
    )
    assert "ZeRO-3" in out and "32 ranks" in out and "the run fits" in out


def test_plan_takes_a_profile_and_a_deepspeed_config_by_path(venv, tmp_path):
    (tmp_path / "mine.yaml").write_text(
        "name: mine\ngpus_per_node: 2\ncores_per_node: 32\ndevice_memory_gb: 80\nbackend: nccl\n"
    )
    (tmp_path / "zero2.json").write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    out = cli(
        venv,
        "plan",
        "--preset",
        "3b-h4b16k",
        "--cluster",
        "mine.yaml",
        "--nodes",
        "4",
        "--set",
        "parallel.deepspeed_config=zero2.json",
        cwd=tmp_path,
    )
    assert "ZeRO-2" in out and "8 ranks" in out


def test_unknown_names_list_the_shipped_ones(venv, tmp_path):
    out = cli(venv, "plan", "--preset", "3b-h4b16k", "--cluster", "h100", cwd=tmp_path, expect_rc=2)
    assert (
        "cluster profile 'h100' not found" in out
        and "use one of a100-80g, cpu-local, mi300x" in out
    )
    assert f"({venv / 'lib'}" in out  # looked up in the installed package
    out = cli(
        venv,
        "plan",
        "--preset",
        "3b-h4b16k",
        "--cluster",
        "a100-80g",
        "--set",
        "parallel.deepspeed_config=nope",
        cwd=tmp_path,
        expect_rc=2,
    )
    assert "use one of cpu_fp32, zero1_pp_bf16, zero3_bf16_actckpt" in out


def test_submit_dry_run_renders_the_shipped_template(venv, tmp_path):
    out = cli(
        venv,
        "submit",
        "--preset",
        "3b-h4b16k",
        "--cluster",
        "a100-80g",
        "--nodes",
        "4",
        "--run-dir",
        "RUN",
        "--set",
        "data.path=/shared/data",
        "--partition",
        "gpu",
        "--time",
        "1:00:00",
        "--dry-run",
        cwd=tmp_path,
    )
    assert "#SBATCH --nodes=4" in out and "#SBATCH --ntasks-per-node=8" in out
    assert "srun --cpus-per-task=16 --kill-on-bad-exit=1" in out
    assert (
        f"  {shlex.quote(str(venv / 'bin' / 'python'))} -m mhf_dist train --run-dir {tmp_path / 'RUN'}"
        in out
    )


@pytest.mark.multirank
def test_two_training_steps_on_cpu(venv, tmp_path):
    out = cli(
        venv,
        "train",
        "--preset",
        "tiny-h4b16k",
        "--run-dir",
        "RUN",
        "--set",
        "train.max_steps=2",
        "--set",
        "model.hash.num_buckets=256",
        "--set",
        "data.seq_len=64",
        "--set",
        "train.global_batch_size=4",
        "--set",
        "train.micro_batch_size=4",
        cwd=tmp_path,
    )
    run = tmp_path / "RUN"
    assert "done: step 2" in out
    assert [r["step"] for r in metrics(run)] == [1, 2]
    assert (run / "checkpoints" / "step-00000002" / "complete.json").is_file()
