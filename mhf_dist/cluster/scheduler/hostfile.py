"""No scheduler: a script that starts the ranks on the nodes of a hostfile with DeepSpeed's launcher (over ssh or
pdsh), rendered from the backend's template. It is started, not submitted; nothing can be asked about it, and its
ranks are told their ranks by the launcher itself."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

from mhf_dist.backend import hostfile_template
from mhf_dist.cluster.files import no_control_characters
from mhf_dist.cluster.scheduler import JobState, register, scheduler
from mhf_dist.errors import ConfigError

if TYPE_CHECKING:
    from mhf_dist.cluster.profile import ClusterProfile
    from mhf_dist.config import RunConfig


class HostfileOptions(BaseModel):
    """No options of its own: the nodes are the hostfile's (``--hostfile``), the rest is the profile's."""

    model_config = ConfigDict(extra="forbid")


class Hostfile:
    """DeepSpeed's launcher over a hostfile (see the module's docstring)."""

    name = "hostfile"
    script_name = "launch.sh"
    preemption_signal = None
    options = HostfileOptions

    def template(self) -> str:
        return hostfile_template()

    def in_container(self, profile: ClusterProfile) -> bool:
        # the launcher, or another scheduler's container options in the profile (SLURM's srun_args), which the
        # hostfile launcher cannot start
        return bool(profile.launcher) or any(
            scheduler(name).in_container(profile)
            for name in profile.scheduler_options
            if name != self.name
        )

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
        if min_nodes is not None:
            raise ConfigError(
                "an elastic job (--nodes MIN-MAX, min_nodes) needs SLURM: DeepSpeed's hostfile launcher "
                "cannot continue on the nodes left; give --nodes N"
            )
        if self.in_container(profile):
            raise ConfigError(
                f"profile {profile.name} runs in a container (launcher/srun_args), which DeepSpeed's "
                "hostfile launcher does not start; submit through SLURM, or use a profile without them"
            )
        if not hostfile:
            raise ConfigError(
                "a job of the hostfile scheduler needs --hostfile FILE: the nodes to start the ranks on"
            )
        return dict(
            launcher_env="\n".join(
                f"{k}={no_control_characters(k, v)}" for k, v in profile.env.items()
            ),
            # absolute: the script runs in the run directory
            hostfile=shlex.quote(
                str(Path(no_control_characters("--hostfile", hostfile)).resolve())
            ),
        )

    def launch_template(self, elastic: bool) -> str:
        return ""  # the template starts DeepSpeed's launcher itself

    def submit(self, script: Path, *options: str) -> str:
        raise ConfigError(f"a hostfile job is started, not submitted: bash {script}")

    def query(self, job_id: str) -> JobState | None:
        return None

    def task_env(self) -> dict[str, str]:
        return {}  # DeepSpeed's launcher sets RANK, LOCAL_RANK and WORLD_SIZE itself

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        pass

    def with_arguments(self, profile: ClusterProfile, args: argparse.Namespace) -> ClusterProfile:
        return profile

    def how_to_submit(self, path: Path) -> str:
        return f"start it with: bash {path}"

    def manual_note(self, log_dir: Path) -> str | None:
        return None


HOSTFILE = register(Hostfile())
