"""Cluster profiles (``cluster/<name>.yaml``): hardware and environment of one kind of node.

Used by ``mhf-dist plan`` (memory per rank, fit) and job submission; MFU uses
``peak_bf16_tflops`` when training on that cluster. The named profiles and the
job templates ship inside the package (``mhf_dist/clusters/``, which the
repository's ``cluster/`` links to).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mhf_dist.config import ConfigError

PROFILE_DIR = resources.files("mhf_dist") / "clusters"  # named profiles and job templates


class ClusterProfile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    gpus_per_node: int = Field(ge=1, description="ranks per node (GPUs, or CPU processes)")
    device_memory_gb: float = Field(gt=0)
    peak_bf16_tflops: float | None = Field(None, gt=0, description="dense bf16 peak per device; None: measured")
    backend: str = Field(description="torch.distributed backend: nccl (NCCL or RCCL) or gloo")
    partition: str | None = None
    account: str | None = None
    time: str = "24:00:00"
    cpus_per_task: int = Field(1, ge=1)
    env: dict[str, str] = Field(default_factory=dict, description="exported in every job")
    setup: list[str] = Field(default_factory=list, description="shell lines before launch (modules, venv, container)")


def load_profile(name_or_path: str) -> ClusterProfile:
    path = Path(name_or_path) if name_or_path.endswith((".yaml", ".yml")) else PROFILE_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        names = ", ".join(sorted(p.name.removesuffix(".yaml") for p in PROFILE_DIR.iterdir()
                                 if p.name.endswith(".yaml")))
        raise ConfigError(f"cluster profile {name_or_path!r} not found ({path}); use one of {names} or a .yaml path")
    try:
        return ClusterProfile.model_validate(yaml.safe_load(path.read_text()))
    except (ValidationError, yaml.YAMLError) as e:
        raise ConfigError(f"cluster profile {path} is invalid: {e}") from None
