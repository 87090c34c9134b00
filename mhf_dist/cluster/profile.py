"""Cluster profiles (``cluster/<name>.yaml``): hardware and environment of one kind of node.

Used by ``mhf-dist plan`` (memory per rank, fit) and job submission; MFU uses ``peak_bf16_tflops`` when training on
that cluster. The named profiles and the job templates ship inside the package (``mhf_dist.cluster.files.PROFILE_DIR``).
Where the code runs on the nodes: ``python`` (unset: the Python that ran ``submit``), optionally inside a container:
``launcher``, a command prefix for each rank (``[apptainer, exec, --nv, IMAGE]``, ``[enroot, start, ..., IMAGE]``), or
a scheduler's own container options (in ``scheduler_options``). ``scheduler`` is the one ``submit`` uses;
``scheduler_options`` holds each one's own options by its name, and a scheduler's given at the top level (the older
flat form) are moved there. Every field: docs/clusters.md; the boundary: docs/design.md ("The scheduler
boundary").
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from mhf_dist.cluster.files import PROFILE_DIR
from mhf_dist.cluster.scheduler import Scheduler, scheduler
from mhf_dist.cluster.scheduler.slurm import SLURM
from mhf_dist.config import ConfigError


class ClusterProfile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    gpus_per_node: int = Field(ge=1, description="ranks per node (GPUs, or CPU processes)")
    cores_per_node: int = Field(
        ge=1, description="CPU cores of one node; each rank gets cores_per_node // gpus_per_node"
    )
    memory_gb_per_node: float | None = Field(None, gt=0, description="host memory of one node")
    device_memory_gb: float = Field(gt=0)
    peak_bf16_tflops: float | None = Field(
        None, gt=0, description="dense bf16 peak per device; None: measured"
    )
    backend: str = Field(description="torch.distributed backend: nccl (NCCL or RCCL) or gloo")
    storage_gb_per_s: float = Field(
        1.0,
        gt=0,
        description="write rate of one node to the run directory's filesystem, GB/s (the default is "
        "cautious: measure yours, or read it off a run's save lines); plan and submit size checkpoint saves and the "
        "grace period before the time limit from it",
    )
    upload_gb_per_s: float = Field(
        0.5,
        gt=0,
        description="upload rate of one node to object storage, GB/s: a save into a URL "
        "train.checkpoint_dir writes into train.checkpoint_staging, then uploads, and plan and submit count both "
        "(the default is cautious: read yours off a run's save lines)",
    )
    hardware_only: bool = Field(
        False,
        description="the profile holds only what is true of the hardware (the shipped GPU profiles): a "
        "scheduled job needs the site's partition and time limit too, from submit's flags or a site profile that "
        "extends it",
    )
    partition: str | None = Field(
        None, description="the scheduler's partition; None: the cluster's default"
    )
    account: str | None = None
    qos: str | None = None
    time: str | None = Field(None, description="the job's time limit, e.g. 24:00:00 or 2-00:00:00")
    gpus_per_task: Literal[1] | None = Field(
        None,
        description="1: bind each rank to its own GPU (the job's --gpus-per-task=1, its tasks' "
        "--gpu-bind=gpu_bind), so every rank sees one device; None: ask for gpus_per_node per node and let every rank "
        "see them all",
    )
    gpu_bind: str = Field(
        "closest",
        description="the tasks' --gpu-bind value when gpus_per_task is set (closest: "
        "the GPU nearest the rank's cores; per_task:1 on sites whose topology SLURM does not know)",
    )
    exclusive: bool = Field(
        False, description="the job's --exclusive: whole nodes, shared with no other job"
    )
    min_nodes: int | None = Field(
        None,
        ge=1,
        description="submit's elastic minimum: a job of more nodes asks for min_nodes-N (--no-kill) and "
        "continues on the nodes left, at least min_nodes, when one is lost; None: a lost node ends the job",
    )
    all_memory: bool = Field(
        False, description="the job's --mem=0: it may use all of each node's memory"
    )
    python: str | None = Field(
        None,
        description="Python on the nodes (absolute, or a name inside the container); "
        "None: the Python that runs submit, which must be on storage every node sees",
    )
    launcher: list[str] = Field(
        default_factory=list, description="command prefix for each rank (containers)"
    )
    env: dict[str, str] = Field(default_factory=dict, description="exported in every job")
    setup: list[str] = Field(
        default_factory=list, description="shell lines before launch (modules, site setup)"
    )
    scheduler: str = Field(
        SLURM.name,
        description="the scheduler submit uses unless --scheduler (or --hostfile) names another",
    )
    scheduler_options: dict[str, Any] = Field(
        default_factory=dict,
        description="each scheduler's own options, by its name; a scheduler not named here "
        "takes its defaults",
    )

    @property
    def cpus_per_task(self) -> int:
        """Cores per rank."""
        return self.cores_per_node // self.gpus_per_node

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        for key in env:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
                raise ValueError(f"env: {key!r} is not a shell variable name")
        return env

    @model_validator(mode="before")
    @classmethod
    def _flat_options(cls, raw: Any) -> Any:
        return _nested(raw) if isinstance(raw, dict) else raw

    @field_validator("scheduler")
    @classmethod
    def _known(cls, name: str) -> str:
        scheduler(name)  # a ValueError naming the schedulers there are
        return name

    @field_validator("scheduler_options")
    @classmethod
    def _own_options(cls, options: dict[str, Any]) -> dict[str, BaseModel]:
        return {
            name: scheduler(name).options.model_validate(value) for name, value in options.items()
        }

    def options_of(self, s: Scheduler) -> BaseModel:
        """``s``'s own options: the profile's, else its defaults."""
        own = self.scheduler_options.get(s.name)
        return s.options() if own is None else own

    def with_options(self, s: Scheduler, options: BaseModel) -> ClusterProfile:
        """This profile with ``options`` as ``s``'s own."""
        return self.model_copy(
            update={"scheduler_options": {**self.scheduler_options, s.name: options}}
        )

    @model_validator(mode="after")
    def _cores(self) -> "ClusterProfile":
        if self.cores_per_node < self.gpus_per_node:
            raise ValueError(
                f"cores_per_node={self.cores_per_node} is fewer than one core for each of the "
                f"gpus_per_node={self.gpus_per_node} ranks: set cores_per_node to the node's CPU cores"
            )
        return self


def load_profile(name_or_path: str) -> ClusterProfile:
    """A named profile or a ``.yaml`` path. A site profile may start from another (``extends: a100-80g``): its
    fields replace the other's (``env`` is merged, the site's values winning), and it is no longer hardware only."""
    path, raw = _read_profile(name_or_path)
    base = raw.pop("extends", None)
    inherited = None if base is None else _read_profile(str(base))[1]
    try:
        if inherited is not None:
            inherited.pop("extends", None)
            raw, inherited = _nested(raw), _nested(inherited)
            env = {**(inherited.get("env") or {}), **(raw.get("env") or {})}
            options = _merged(inherited.get("scheduler_options"), raw.get("scheduler_options"))
            raw = {
                **inherited,
                "hardware_only": False,
                **raw,
                "env": env,
                "scheduler_options": options,
            }
        return ClusterProfile.model_validate(raw)
    except ValueError as e:  # pydantic's ValidationError among them
        raise ConfigError(f"cluster profile {path} is invalid: {e}") from None


def _nested(raw: dict) -> dict:
    """``raw`` with SLURM's options given at its top level (the older flat form) moved into ``scheduler_options``."""
    flat = {key: raw[key] for key in SLURM.options.model_fields if key in raw}
    options = raw.get("scheduler_options") or {}
    if (
        not flat
        or not isinstance(options, dict)
        or not isinstance(options.get(SLURM.name) or {}, dict)
    ):
        return raw  # nothing to move, or a malformed mapping that validation names
    own = options.get(SLURM.name) or {}
    if twice := sorted(flat.keys() & own.keys()):
        raise ValueError(
            f"{', '.join(twice)}: given both at the top level and in scheduler_options.{SLURM.name}; "
            "give each once"
        )
    rest = {key: value for key, value in raw.items() if key not in flat}
    return rest | {"scheduler_options": {**options, SLURM.name: {**own, **flat}}}


def _merged(base: Any, site: Any) -> Any:
    """A site profile's scheduler options over those it extends: its values replace theirs one by one, as its fields
    replace the others'."""
    base, site = base or {}, site or {}
    if not isinstance(site, dict) or not isinstance(base, dict):
        return base if isinstance(site, dict) else site  # the malformed one, which validation names
    both = [
        name for name in site if isinstance(site[name], dict) and isinstance(base.get(name), dict)
    ]
    return {**base, **site} | {name: {**base[name], **site[name]} for name in both}


def _read_profile(name_or_path: str) -> tuple[Path, dict]:
    path = (
        Path(name_or_path)
        if name_or_path.endswith((".yaml", ".yml"))
        else PROFILE_DIR / f"{name_or_path}.yaml"
    )
    if not path.is_file():
        names = ", ".join(
            sorted(
                p.name.removesuffix(".yaml")
                for p in PROFILE_DIR.iterdir()
                if p.name.endswith(".yaml")
            )
        )
        raise ConfigError(
            f"cluster profile {name_or_path!r} not found ({path}); use one of {names} or a .yaml path"
        )
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"cluster profile {path} is invalid: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"cluster profile {path} must hold a mapping of its fields")
    return path, raw
