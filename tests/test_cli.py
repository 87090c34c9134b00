"""The command line: commands that train nothing start without the training stack."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mhf_dist.cli import build_parser
from mhf_dist.config import load_config

HEAVY = ("torch", "deepspeed", "transformers", "webdataset", "numpy", "safetensors")
PROBE = """
import json, sys
from mhf_dist.cli import main
try:
    rc = main(sys.argv[1:])
except SystemExit as e:  # --help and --version exit through argparse
    rc = e.code
print(json.dumps({"rc": rc, "loaded": sorted(m for m in %r if m in sys.modules)}), file=sys.stderr)
""" % (HEAVY,)


def loaded_by(*args: str, cwd=None) -> list[str]:
    """The heavy modules a fresh interpreter has loaded after running ``mhf-dist ARGS`` (which must succeed)."""
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, cwd=cwd)
    report = json.loads(proc.stderr.strip().splitlines()[-1])
    assert report["rc"] in (0, None), proc.stdout + proc.stderr
    return report["loaded"]


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["presets"], ["config", "--preset", "tiny-h4b16k"],
                                  ["submit", "--help"]])
def test_commands_without_training_load_nothing_heavy(args):
    assert loaded_by(*args) == []


def test_status_loads_nothing_heavy(tmp_path):
    import yaml

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(load_config("tiny-h4b16k").model_dump(mode="json")))
    assert loaded_by("status", str(run), "--json") == []


def test_plan_and_submit_do_not_load_deepspeed_or_transformers(tmp_path):
    assert loaded_by("submit", "--preset", "3b-h4b16k", "--set", "data.path=/shared/data", "--cluster", "a100-80g",
                     "--nodes", "4", "--run-dir", str(tmp_path / "r"), "--dry-run") == []
    loaded = loaded_by("plan", "--preset", "3b-h4b16k", "--cluster", "a100-80g", "--nodes", "4")
    assert "deepspeed" not in loaded and "transformers" not in loaded  # the meta-device model needs torch


def test_help_lists_user_commands_with_examples(capsys):
    text = build_parser().format_help()
    assert "examples:" in text and "mhf-dist train --preset" in text and "mhf-dist status" in text
    assert "profile-worker" not in text  # internal: started by `profile` for its ranks
    for command in ("train", "status", "submit", "plan", "export-hf", "generate", "profile"):
        assert f"    {command} " in text


def test_version():
    from mhf_dist import __version__

    proc = subprocess.run([sys.executable, "-m", "mhf_dist", "--version"], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == f"mhf-dist {__version__}"
