"""Run `mhf-dist` in a subprocess (training initialises torch.distributed, which a test process must not keep)."""

from __future__ import annotations

import os
import subprocess
import sys


def run_cli(args: list[str], expect_rc: int = 0, timeout: int = 600) -> str:
    """``python -m mhf_dist ARGS``; asserts the exit code and returns stdout + stderr."""
    proc = subprocess.run([sys.executable, "-m", "mhf_dist", *args], capture_output=True, text=True,
                          timeout=timeout, env=os.environ | {"PYTHONUNBUFFERED": "1"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == expect_rc, f"exit {proc.returncode} (expected {expect_rc}):\n{out[-5000:]}"
    return out
