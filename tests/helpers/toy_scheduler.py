"""A toy scheduler, defined here and registered by the tests that use it: what a scheduler from outside the package
needs to be submitted to, rendered for and asked about, and nothing more. Its queue is this process's memory."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from mhf_dist.cluster.scheduler import JobState
from mhf_dist.errors import ConfigError

TEMPLATE = """#!/bin/bash
# toy job (profile ${profile}) on queue ${queue}: ${nodes} node(s) x ${tasks_per_node} rank(s), logs in ${log_dir}
set -uo pipefail
cd ${run_dir}
${setup}
${exports}
${python_check}
${launch}"""


class ToyOptions(BaseModel):
    """The toy's own options in a cluster profile (``scheduler_options.toy``)."""

    model_config = ConfigDict(extra="forbid")

    queue: str = "default"


class Toy:
    name = "toy"
    script_name = "job.toy"
    preemption_signal = None
    options = ToyOptions

    def __init__(self):
        self.queued: dict[str, str] = {}  # job id -> script, in the order submitted

    def template(self) -> str:
        return TEMPLATE

    def job_values(
        self, cfg, profile, *, nodes, run_dir, grace, depends_on, hostfile, min_nodes
    ) -> dict[str, object]:
        if min_nodes is not None:
            raise ConfigError("the toy scheduler runs jobs of a fixed size only")
        return {"queue": shlex.quote(profile.options_of(self).queue)}

    def launch_template(self, elastic: bool) -> str:
        return "${command} train ${train_args}\n"

    def in_container(self, profile) -> bool:
        return bool(profile.launcher)

    def submit(self, script: Path, *options: str) -> str:
        job = f"toy-{len(self.queued) + 1}"
        self.queued[job] = script.read_text()
        return job

    def query(self, job_id: str) -> JobState | None:
        return JobState("QUEUED", 0, "toy") if job_id in self.queued else None

    def task_env(self) -> dict[str, str]:
        return {}

    def how_to_submit(self, path: Path) -> str:
        return f"queue it with: toy-submit {path}"

    def manual_note(self, log_dir: Path) -> str | None:
        return None

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--toy-queue", help="the toy queue (instead of the profile's)")

    def with_arguments(self, profile, args: argparse.Namespace):
        if args.toy_queue is None:
            return profile
        return profile.with_options(
            self, profile.options_of(self).model_copy(update={"queue": args.toy_queue})
        )
