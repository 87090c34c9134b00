"""The check's report: where it ran (date, commit, device, versions), its table, and ``gpu_check.md`` and
``gpu_check.json``, replaced whole after every command and step, so that a check stopped from outside (a machine's
time limit, a kill) still leaves what it had measured and where its time went."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import threading
import time
from dataclasses import asdict

from mhf_dist.atomic import write_atomic
from mhf_dist.backend import versions as backend_versions
from mhf_dist.commands.gpu_check.preflight import build_name
from mhf_dist.commands.gpu_check.runner import FAIL, NOT_RUNNABLE, ROOT, Check, Context, Mode

PACKAGE = "mhf-dist"


def source_commit() -> str:
    """The commit checked: the checkout's (git), else the one pip recorded when it installed from a repository
    (PEP 610's ``direct_url.json``), else "unknown" with the package's version. git is optional."""
    try:
        git = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if git.returncode == 0 and git.stdout.strip():
            return git.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):  # no git on PATH, or a git that hangs
        pass
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
    try:
        commit = (
            json.loads(dist.read_text("direct_url.json") or "{}")
            .get("vcs_info", {})
            .get("commit_id")
        )
    except (OSError, ValueError):
        commit = None
    return commit[:12] if commit else f"unknown ({PACKAGE} {dist.version})"


def environment(mode: Mode) -> dict:
    """Date, commit, device, torch build and the versions that the table names."""
    import torch

    if mode.device == "cuda" and torch.cuda.is_available():
        device = torch.cuda.get_device_name()
    else:
        device = f"CPU {platform.processor() or platform.machine()}, {os.cpu_count()} cores"

    def version(package: str) -> str:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "device": device,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": torch.version.hip,
        "build": build_name(),
        **backend_versions(),
        "transformers": version("transformers"),
        "commit": source_commit(),
    }


def finished_steps(timings: list[dict]) -> int:
    return sum(t["status"] != "interrupted" for t in timings)


def markdown(
    mode: Mode, env: dict, checks: list[Check], elapsed: float, finished: int, total: int
) -> str:
    """The summary table with its header: where it ran and the verdict (``finished`` of ``total`` steps ended)."""
    failed = [c.name for c in checks if c.status == FAIL]
    verdict = f"FAILED {', '.join(failed)}" if failed else "all passed"
    gloo = [c.name for c in checks if c.status == NOT_RUNNABLE]
    if gloo:
        verdict += f" ({NOT_RUNNABLE}: {', '.join(gloo)})"
    if finished < total:
        verdict += f" so far (in progress: {finished} of {total} steps finished)"
    lines = [
        f"# mhf-dist main-job check ({mode.name.upper()})",
        "",
        f"- date: {env['date']}, commit {env['commit']}",
        f"- device: {env['device']}",
        f"- torch {env['torch']} ({env['build']}), "
        + "".join(f"{name} {env[name]}, " for name in backend_versions())
        + f"transformers {env['transformers']}",
        f"- {len(checks)} checks in {elapsed:.0f} s: {verdict}",
        "",
        "| check | result | status |",
        "|---|---|---|",
    ]
    lines += [
        f"| {c.name} | {' '.join(c.result.replace('|', '/').split())} | {c.status} |"
        for c in checks
    ]
    return "\n".join(lines) + "\n"


class Report:
    """``gpu_check.md`` and ``gpu_check.json`` of a check of ``total`` steps. ``write`` takes the rows and step
    timings so far; the context's commands call ``rewrite`` as each of them ends."""

    def __init__(self, ctx: Context, env: dict, total: int):
        self.ctx, self.env, self.total, self.began = ctx, env, total, time.perf_counter()
        self.checks: list[Check] = []
        self.timings: list[dict] = []
        self._lock = threading.Lock()  # commands side by side end in their own threads
        ctx.reporter = self

    def write(self, checks: list[Check], timings: list[dict]) -> str:
        self.checks, self.timings = list(checks), list(timings)
        return self.rewrite()

    def rewrite(self) -> str:
        with self._lock:
            return self._rewrite()

    def _rewrite(self) -> str:
        mode, out, elapsed = self.ctx.mode, self.ctx.out, time.perf_counter() - self.began
        finished = finished_steps(self.timings)
        text = markdown(mode, self.env, self.checks, elapsed, finished, self.total)
        write_atomic(out / "gpu_check.md", text)
        write_atomic(
            out / "gpu_check.json",
            json.dumps(
                {
                    "mode": mode.name,
                    **self.env,
                    "elapsed_s": elapsed,
                    "complete": finished == self.total,
                    "passed": not any(c.status == FAIL for c in self.checks),
                    "steps": self.timings,
                    "commands": list(self.ctx.commands),
                    "tolerances": {
                        "resume_rel": mode.resume_tolerance,
                        "eval_rel": mode.eval_tolerance,
                        "compare_rel": mode.compare_tolerance,
                    },
                    "checks": [asdict(c) for c in self.checks],
                },
                indent=1,
            ),
        )
        return text
