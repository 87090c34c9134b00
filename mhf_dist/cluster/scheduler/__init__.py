"""Schedulers: how a job script is written, submitted and queried, and what a task of a running job is told.

``Scheduler`` is what ``submit``, ``status`` and ``train`` ask of one; each scheduler is one module here with its job
template beside the cluster profiles (``slurm``: ``sbatch.template`` and ``prepare-data.template``; ``hostfile``:
DeepSpeed's launcher over a hostfile, whose template is the backend's). Every scheduler is in the registry by its name
(``register``): the shipped ones register themselves when imported; one from elsewhere registers before the command
line is built, and ``submit --scheduler`` and profiles (``scheduler``, ``scheduler_options``) name it as they name
the shipped ones. Nothing here imports torch: ``submit`` and ``status`` run on login nodes. See docs/design.md ("The
scheduler boundary").
"""

from __future__ import annotations

import argparse
import signal
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

if TYPE_CHECKING:
    from pydantic import BaseModel

    from mhf_dist.cluster.profile import ClusterProfile
    from mhf_dist.config import RunConfig


class JobState(NamedTuple):
    """What a scheduler knows of a job: its state, how often it restarted (None: not said) and the query that told."""

    state: str
    restarts: int | None
    source: str


@runtime_checkable
class Scheduler(Protocol):
    """One scheduler, as the rest of the package uses it."""

    name: str  # as --scheduler names it
    script_name: str  # the submitted training script, kept in the run's job directory
    # what it sends the ranks ahead of the time limit (None: nothing)
    preemption_signal: signal.Signals | None
    # its own options in a cluster profile (scheduler_options.<name>), with defaults for all
    options: type[BaseModel]

    def template(self) -> str:
        """The training job script, a ``string.Template`` of the values ``mhf_dist.cluster.submit`` and
        ``job_values`` give."""

    def job_values(
        self,
        cfg: RunConfig,
        profile: ClusterProfile,
        *,
        nodes: int,
        run_dir: Path,
        grace: int | None,
        depends_on: str | None,
        hostfile: str | None,
        min_nodes: int | None,
    ) -> dict[str, object]:
        """The template values of this scheduler's own part of a training job (its options, its signal's grace; an
        elastic job of ``min_nodes`` to ``nodes`` nodes when ``min_nodes`` is set); raises ConfigError for values it
        cannot take."""

    def launch_template(self, elastic: bool) -> str:
        """The part of the training job script that starts the ranks (``${launch}`` of ``template``), a
        ``string.Template`` of the same values; ``elastic``: the rounds of an elastic job."""

    def in_container(self, profile: ClusterProfile) -> bool:
        """Whether the profile starts the ranks in a container, which brings its own Python."""

    def submit(self, script: Path, *options: str) -> str:
        """Submit the script at ``script``; the job id (ConfigError when refused or the scheduler is not here)."""

    def query(self, job_id: str) -> JobState | None:
        """The job's state, or None when the scheduler does not know it or cannot be asked from here."""

    def task_env(self) -> dict[str, str]:
        """In a task of one of this scheduler's job steps: the rank's environment (RANK, LOCAL_RANK, WORLD_SIZE,
        GROUP_WORLD_SIZE: the job's nodes, and ``mhf_dist.storage.run_lock.JOB_ID_ENV``); empty elsewhere."""

    def how_to_submit(self, path: Path) -> str:
        """How a written script at ``path`` is submitted (or started) by hand."""

    def manual_note(self, log_dir: Path) -> str | None:
        """What submitting a printed script by hand needs besides (None: nothing)."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """This scheduler's own options of ``submit`` and ``submit-data``."""

    def with_arguments(self, profile: ClusterProfile, args: argparse.Namespace) -> ClusterProfile:
        """``profile`` with this scheduler's options from the command line (``add_arguments``)."""


SHIPPED = (
    "mhf_dist.cluster.scheduler.slurm",
    "mhf_dist.cluster.scheduler.hostfile",
)  # their modules, in this order
_REGISTRY: dict[str, Scheduler] = {}


def register(s: Scheduler) -> Scheduler:
    """Add ``s`` to the schedulers, under its name; ``s`` back (``PBS = register(Pbs())``). A scheduler that does not
    answer the whole protocol, or a second one of a registered name, is refused."""
    if not isinstance(s, Scheduler):
        raise TypeError(
            f"{s!r} is not a scheduler: it lacks some of {Scheduler.__module__}.Scheduler's members"
        )
    if _REGISTRY.setdefault(s.name, s) is not s:
        raise ValueError(f"another scheduler is registered as {s.name!r}")
    return s


def schedulers() -> dict[str, Scheduler]:
    """Every registered scheduler by name, the shipped ones included."""
    for module in SHIPPED:
        import_module(module)  # registers its scheduler, the first time
    return dict(_REGISTRY)


def scheduler(name: str) -> Scheduler:
    try:
        return schedulers()[name]
    except KeyError:
        raise ValueError(
            f"no scheduler {name!r}; the schedulers are {', '.join(schedulers())}"
        ) from None


def task_env() -> dict[str, str]:
    """The rank environment of this process when it is a task of a scheduler's job step; empty otherwise."""
    for s in schedulers().values():
        if env := s.task_env():
            return env
    return {}
