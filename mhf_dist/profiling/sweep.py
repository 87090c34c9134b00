"""The sweep: every (layout, hash configuration) profiled in its own set of local processes, one per
tensor-parallel rank (``mhf-dist profile-worker``), so peak memory is each configuration's own."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from mhf_dist.config import load_config
from mhf_dist.errors import MhfError
from mhf_dist.parallel.devices import bind_gpu
from mhf_dist.parallel.layout import backend_name
from mhf_dist.profiling.timing import torch_dtype
from mhf_dist.profiling.training import TrainRow, profile_training
from mhf_dist.train.host_allocator import keep_freed_host_memory
from mhf_dist.train.throughput import measured_peak_flops


def worker_main(rows_file: str, spec_json: str) -> int:
    """One rank of a tensor-parallel layout: profile one configuration; rank 0 writes its row to ``rows_file``."""
    spec = json.loads(spec_json)
    device = torch.device(spec.pop("device"))
    if device.type == "cuda":  # each local rank on its GPU (LOCAL_RANK, as launch_local sets it)
        device = bind_gpu(int(os.environ.get("LOCAL_RANK", 0)))
    keep_freed_host_memory(device)  # as a training rank's
    if spec["tp"] > 1:
        # train.dist_backend of the profiled configuration (--set): gloo lets two ranks share one GPU
        cfg = load_config(f"{spec['size']}-{spec['hash_name']}", overrides=spec["overrides"])
        backend = backend_name(cfg.train.dist_backend, device.type)
        dist.init_process_group(backend, device_id=device if backend == "nccl" else None)
    trace = spec.pop("trace_dir")
    row = profile_training(device=device, trace_dir=Path(trace) if trace else None, **spec)
    if not dist.is_initialized() or dist.get_rank() == 0:
        Path(rows_file).write_text(json.dumps(asdict(row)))
    if dist.is_initialized():
        dist.barrier()  # no rank tears its connections down while another still uses them
        dist.destroy_process_group()
    return 0


def profile_lost_work() -> str:
    """What a profile stopped by a dead rank or a second Ctrl-C loses: the configuration being measured."""
    return "profile saves nothing mid-configuration: rerun the command to measure it again"


def run_sweep(
    size: str,
    hashes: list[str],
    tps: list[int],
    *,
    steps: int,
    warmup: int,
    seq_len: int,
    micro: int,
    dtype: str,
    out: Path,
    peak_nominal: float | None,
    overrides: list[str],
    trace: bool,
) -> list[TrainRow]:
    """Every (tp, hash configuration) in ``tps`` × ``hashes``, each in fresh processes; their rows in that order."""
    from tqdm.auto import tqdm

    from mhf_dist.cluster.launch import launch_local

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    peak = measured_peak_flops(device, torch_dtype(dtype))
    rows = []
    combos = [(tp, h) for tp in tps for h in hashes]
    for i, (tp, hash_name) in enumerate(tqdm(combos, desc="profile", unit="config")):
        # every configuration in fresh processes, so peak memory is its own
        spec = dict(
            size=size,
            hash_name=hash_name,
            tp=tp,
            steps=steps,
            warmup=warmup,
            seq_len=seq_len,
            micro=micro,
            dtype=dtype,
            peak_measured=peak,
            peak_nominal=peak_nominal,
            overrides=overrides,
            trace_dir=str(out / "trace") if trace and i == 0 else None,
        )
        rows_file = out / f"rows-tp{tp}-{hash_name}.json"
        rc = launch_local(
            tp,
            [
                "profile-worker",
                "--rows",
                str(rows_file),
                "--spec",
                json.dumps(spec | {"device": device.type}),
            ],
            profile_lost_work,
        )
        if rc:
            raise MhfError(
                f"profiling {size}-{hash_name} at tp={tp} failed (exit {rc}): its ranks' errors are above"
            )
        rows.append(TrainRow(**json.loads(rows_file.read_text())))
        rows_file.unlink()
    return rows
