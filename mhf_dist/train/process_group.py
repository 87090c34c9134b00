"""This rank in the job's process group: its place in the job (``Job``), the device it computes on, joining the
group over the configured backend (and the backend's own prints while it starts), leaving it, and what a failed
collective says."""

from __future__ import annotations

import contextlib
import io
import os
import sys
import warnings
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from mhf_dist.backend import accelerator_env
from mhf_dist.backend import init_distributed as init_backend_distributed
from mhf_dist.config import RunConfig
from mhf_dist.parallel.devices import bind_gpu, device_type
from mhf_dist.parallel.groups import ParallelGroups
from mhf_dist.parallel.layout import Layout, backend_name
from mhf_dist.parallel.rendezvous import free_port
from mhf_dist.parallel.scalars import ScalarCollectives
from mhf_dist.train.host_allocator import keep_freed_host_memory
from mhf_dist.train.preflight import preflight


@dataclass(frozen=True)
class Job:
    """This rank's place in the job."""

    rank: int
    world: int
    layout: Layout
    ds_config: dict  # the engine's config for this layout
    device: torch.device  # where this rank computes
    groups: ParallelGroups
    scalars: ScalarCollectives


def join_job(cfg: RunConfig, verbose: bool = False) -> Job:
    """Resolve the layout and the engine config (every config error before any collective), then join the job's
    process group and its parallel groups (``verbose``: with the backend's start-up lines)."""
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    layout, ds_config = preflight(cfg, world, device_type(cfg), ranks_per_node=per_node)
    device = resolve_device(cfg, int(os.environ.get("LOCAL_RANK", 0)))
    keep_freed_host_memory(device)
    with backend_prints(verbose):
        init_distributed(cfg, device)
    return Job(
        rank,
        world,
        layout,
        ds_config,
        device,
        ParallelGroups.create(layout.tp, layout.pp),
        ScalarCollectives(),
    )


def leave_process_group() -> None:
    """Shut this rank's process group down (its communication threads end here, not at interpreter exit)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def collective_failure(e: BaseException) -> str | None:
    """What a failed collective reports (another rank ended, or stopped answering: gloo's closed or reset
    connection, a backend's error), in one line; None for any other error."""
    gloo = isinstance(e, RuntimeError) and "/gloo/" in str(e)
    if not (gloo or isinstance(e, dist.DistError)):
        return None
    # gloo's message starts with its source location
    text = str(e).split("] ", 1)[-1] if gloo else str(e)
    return f"a collective failed, as another rank ended or stopped answering ({text.split('. ', 1)[0].strip()})"


def resolve_device(cfg: RunConfig, local_rank: int) -> torch.device:
    return bind_gpu(local_rank) if device_type(cfg) == "cuda" else torch.device("cpu")


def init_distributed(cfg: RunConfig, device: torch.device) -> None:
    """Join the job's process group (a one-rank group when started without a launcher) over ``train.dist_backend``,
    with ``train.dist_timeout_minutes`` as its timeout."""
    # torch's deprecation notices about the collectives DeepSpeed calls
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    # The pipeline engine broadcasts the tied bucket tables between the first and last stage; torch warns that the
    # broadcast has no autograd kernel. The tables' gradients are summed over the tie by DeepSpeed itself, and the
    # pipeline tests show them equal to one process's, so the warning is known not to apply.
    warnings.filterwarnings(
        "ignore", message=r"c10d::broadcast_: an autograd kernel was not registered"
    )
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0",
            LOCAL_RANK="0",
            WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
        )
    # a rank not started by mhf-dist train, before the backend loads
    os.environ.update(accelerator_env(device.type))
    init_backend_distributed(
        backend_name(cfg.train.dist_backend, device.type),
        timedelta(minutes=cfg.train.dist_timeout_minutes),
        device,
    )


@contextlib.contextmanager
def backend_prints(shown: bool):
    """The backend's own ``print`` lines while it starts (its op builds, ``SEED_LAYERS=...``, ``Using topology:
    ...``, once per rank) are held back unless ``shown`` (``train --verbose``); they are shown after all if the
    start fails."""
    if shown:
        yield
        return
    held = io.StringIO()
    try:
        with contextlib.redirect_stdout(held):
            yield
    except BaseException:
        sys.stderr.write(held.getvalue())
        raise
