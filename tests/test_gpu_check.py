"""``tools/gpu_check.sh --cpu``: the main job end to end at tiny sizes (train, resume, export, generate, eval,
profile), its summary table and its JSON report; and the resume check's verdicts on made-up runs."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXPECTED = ["train-standard", "resume-fp32", "export-hf", "generate-cli", "generate-mhf", "generate-standard",
            "generate-ratio", "eval-perplexity", "profile-tiny-standard", "profile-tiny-h4b16k", "profile-tiny-ratio",
            "profile-tiny-head"]


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.multirank
def test_cpu_mode_runs_every_step_and_reports_every_check(tmp_path):
    proc = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), "--cpu", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=1200, env=os.environ | {"PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]

    report = json.loads((tmp_path / "gpu_check.json").read_text())
    checks = {c["name"]: c for c in report["checks"]}
    assert list(checks) == EXPECTED
    for check in checks.values():
        assert check["status"] in ("PASS", "measured"), check
        assert check["values"], check
        assert all(math.isfinite(v) for v in check["values"].values()), check
    assert report["passed"] and report["mode"] == "cpu"
    assert report["torch"] and report["deepspeed"] != "not installed" and report["date"]

    resume = checks["resume-fp32"]["values"]
    assert resume["max_abs_diff"] == 0 and resume["steps_compared"] == 4
    assert checks["eval-perplexity"]["values"]["rel_diff_nll"] <= 1e-4

    table = (tmp_path / "gpu_check.md").read_text()
    assert "| check | result | status |" in table and table in proc.stdout  # the table was printed
    for name in EXPECTED:
        assert f"| {name} |" in table
    for step in ("training and resume", "export, generation, evaluation", "throughput"):
        assert f"{step} done in" in proc.stdout


def _fake_runs(ctx, whole_losses, resumed_losses, resume_line):
    for name, losses in (("mhf-fp32", whole_losses), ("mhf-fp32-resumed", resumed_losses)):
        ctx.run(name).mkdir(parents=True)
        (ctx.run(name) / "metrics.jsonl").write_text(
            "".join(json.dumps({"step": i + 1, "loss": loss}) + "\n" for i, loss in enumerate(losses)))
    ctx.logs.mkdir(parents=True)
    (ctx.logs / "train-mhf-fp32-resume.log").write_text(resume_line)


def test_resume_check_fails_on_any_difference_or_a_fresh_start(tmp_path):
    gpu_check = _gpu_check()
    losses = [38.9, 38.7, 38.6, 38.5, 38.3, 38.0, 37.6, 37.2]
    cases = {
        "equal": (losses, "resumed from RUN/checkpoints/step-00000004 at step 4\n", "PASS"),
        "one ulp": (losses[:-1] + [math.nextafter(losses[-1], 0)], "resumed from X at step 4\n", "FAIL"),
        "started afresh": (losses, "step 1 | loss 38.9\n", "FAIL"),
        "step missing": (losses[:-1], "resumed from X at step 4\n", "FAIL"),
    }
    for case, (resumed, log, expected) in cases.items():
        ctx = gpu_check.Context(gpu_check.CPU, tmp_path / case, tmp_path / case / "work", 989.0)
        _fake_runs(ctx, losses, resumed, log)
        assert ctx.mode.resume_tolerance["fp32"] == 0
        assert gpu_check.resume_check(ctx, "fp32").status == expected, case
