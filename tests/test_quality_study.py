"""tools/quality_study.py at a few steps: every output written, every reported number finite."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).parents[1] / "tools" / "quality_study.py"


@pytest.mark.multirank
def test_two_preset_study_writes_finite_results(tmp_path):
    out = tmp_path / "study"
    args = [
        sys.executable,
        str(TOOL),
        "--out",
        str(out),
        "--run",
        "tiny-standard",
        "--run",
        "tiny-h4b2k:train.seed=3",
        "--steps",
        "4",
        "--eval-interval",
        "2",
        "--eval-sequences",
        "8",
        "--global-batch",
        "4",
        "--micro-batch",
        "4",
        "--seq-len",
        "64",
    ]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    study = json.loads((out / "study.json").read_text())
    assert [r["run"] for r in study["runs"]] == ["tiny-standard", "tiny-h4b2k:train.seed=3"]
    for run in study["runs"]:
        assert run["parameters"] > 0 and math.isfinite(run["tokens_per_s"])
        assert [e["step"] for e in run["evaluations"]] == [2, 4]
        for e in run["evaluations"]:
            assert all(math.isfinite(v) for k, v in e.items() if isinstance(v, float)), e
            assert e["val_ppl"] > 1
    table = (out / "study.md").read_text()
    assert (
        "| `tiny-standard` |" in table
        and "| `tiny-h4b2k:train.seed=3` |" in table
        and "—" not in table
    )
    assert (out / "study.png").stat().st_size > 10_000
    # finished runs are reused
    rerun = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert (
        rerun.returncode == 0
        and json.loads((out / "study.json").read_text())["runs"] == study["runs"]
    )
