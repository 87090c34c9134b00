"""What differs on GPUs, checked on CPU: device binding, the process group and the accelerator on a GPU host (a CPU
run there included), the rank's GPU generator state, the fused head's compiled kernels and their fallback, where
profile's tensor-parallel model ends up, and deletions that no rank waits for (a collective's wait is bounded by the
process group's timeout; converting for another layout is tested in test_checkpoint)."""

from __future__ import annotations

import functools
import logging
import os
import random
import traceback
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import mhf_dist.model.fused_head as fused_head
from helpers.ranks import run_ranks
from mhf_dist.cluster.profile import load_profile
from mhf_dist.cluster.scheduler.slurm import SLURM
from mhf_dist.cluster.submit import render
from mhf_dist.config import load_config
from mhf_dist.errors import MhfError
from mhf_dist.parallel.devices import bind_gpu, device_index
from mhf_dist.train import checkpoint
from test_model import test_fused_decoder_equals_plain


# ---------------------------------------------------------------------------------------------------- binding
def test_local_ranks_map_onto_the_gpus_each_task_sees():
    # every task sees the node's 8 GPUs
    assert [device_index(r, 8) for r in range(8)] == list(range(8))
    assert [device_index(r, 1) for r in range(8)] == [
        0
    ] * 8  # --gpus-per-task=1: each task sees its own, as 0
    assert [device_index(r, 2) for r in range(4)] == [0, 1, 0, 1]  # more ranks than GPUs share them
    with pytest.raises(MhfError, match="no GPU is visible"):
        device_index(0, 0)


def test_a_bound_rank_drives_its_one_gpu_and_tells_deepspeed(monkeypatch):
    chosen = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("LOCAL_RANK", "5")
    assert bind_gpu(5) == torch.device("cuda", 0)
    # DeepSpeed places parameters on cuda:$LOCAL_RANK
    assert chosen == [0] and os.environ["LOCAL_RANK"] == "0"


def test_profile_binding_one_gpu_per_task_renders_into_the_job_script():
    cfg = load_config("1b-h4b16k", overrides=["data.path=/shared/data"])
    default = load_profile("a100-80g").model_copy(update={"partition": "gpu", "time": "1:00:00"})
    bound = default.model_copy(update={"gpus_per_task": 1})
    kwargs = dict(
        preset="1b-h4b16k", config=None, overrides=["data.path=/shared/data"], python="/opt/py"
    )
    plain = render(SLURM, cfg, default, nodes=2, run_dir=Path("/shared/run"), **kwargs)
    script = render(SLURM, cfg, bound, nodes=2, run_dir=Path("/shared/run"), **kwargs)
    assert (
        "#SBATCH --gpus-per-node=8" in plain
        and "--gpus-per-task" not in plain
        and "--gpu-bind" not in plain
    )
    assert "#SBATCH --gpus-per-task=1" in script and "--gpus-per-node" not in script
    assert "srun --cpus-per-task=16 --kill-on-bad-exit=1 --gpu-bind=closest " in script


# ---------------------------------------------------------------------------------------------------- deletions
def test_checkpoints_are_deleted_in_the_background_and_leftovers_at_the_next_start(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    olds = [checkpoints / f"step-{s:08d}" for s in (1, 2)]
    for old in olds:
        (old / "sub").mkdir(parents=True)
        (old / "sub" / "shard.pt").write_bytes(b"x" * 1000)
    leftover = checkpoints / checkpoint.DELETING / "step-00000000-1"  # a deletion an exit cut short
    leftover.mkdir(parents=True)
    (leftover / "shard.pt").write_bytes(b"y")
    deleter = checkpoint.BackgroundDeleter(checkpoints)
    for old in olds:
        deleter.discard(old)
        assert not old.exists()  # gone from the run's view as soon as it is discarded
    deleter.finish()
    assert sorted(p.name for p in checkpoints.iterdir()) == []  # everything deleted, .deleting/ too


# ---------------------------------------------------------------------------------------------------- RNG state
class FakeGpus:
    """torch.cuda's generator functions for ``count`` visible GPUs, the current one ``current``."""

    def __init__(self, monkeypatch, count: int, current: int):
        self.states = {i: torch.full((16,), i, dtype=torch.uint8) for i in range(count)}
        self.current = current
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: self.states[self.current].clone())
        monkeypatch.setattr(
            torch.cuda, "get_rng_state_all", lambda: [self.states[i] for i in range(count)]
        )
        monkeypatch.setattr(torch.cuda, "set_rng_state", self.set_state)
        monkeypatch.setattr(torch.cuda, "set_rng_state_all", self.set_all)

    def set_state(self, state):
        self.states[self.current] = state.clone()

    def set_all(self, states):
        assert len(states) <= len(self.states), "more states than visible GPUs"
        for i, s in enumerate(states):
            self.states[i] = s


def host_states() -> dict:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }


def test_rng_state_holds_the_ranks_own_gpu_and_resumes_seeing_fewer(tmp_path, monkeypatch):
    # a task that sees the node's 8 GPUs, driving cuda:3
    saved = FakeGpus(monkeypatch, count=8, current=3)
    (tmp_path / "rng.safetensors").write_bytes(checkpoint.rng_state_bytes(cuda=True))
    state = checkpoint.read_rng_state(tmp_path / "rng.safetensors")
    assert torch.equal(state["cuda"], saved.states[3])
    resumed = FakeGpus(monkeypatch, count=1, current=0)  # the resume binds one GPU to each task
    checkpoint.set_rng_state(state, cuda=True)
    assert torch.equal(resumed.states[0], saved.states[3])


def test_rng_files_with_every_visible_gpus_state_still_load(tmp_path, monkeypatch):
    # checkpoints once saved cuda.0 .. cuda.N-1; a resume seeing fewer GPUs must not fail on them
    state = host_states()
    every = {f"cuda.{i}": torch.full((16,), 10 + i, dtype=torch.uint8) for i in range(8)}
    FakeGpus(monkeypatch, count=8, current=0)
    # for its python/numpy metadata
    (tmp_path / "new.safetensors").write_bytes(checkpoint.rng_state_bytes(cuda=True))
    from safetensors import safe_open

    with safe_open(str(tmp_path / "new.safetensors"), framework="pt") as f:
        metadata, tensors = f.metadata(), {"torch": f.get_tensor("torch")}
    save_file(tensors | every, str(tmp_path / "old.safetensors"), metadata=metadata)
    read = checkpoint.read_rng_state(tmp_path / "old.safetensors")
    for count, current, want in ((8, 5, 15), (1, 0, 10)):
        gpus = FakeGpus(monkeypatch, count=count, current=current)
        checkpoint.set_rng_state(read, cuda=True)
        assert gpus.states[current][0].item() == want
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


# ---------------------------------------------------------------------------------------------------- compile
@pytest.mark.parametrize("preset", ["tiny-h4b16k", "tiny-standard"])
def test_fused_head_compiled_kernels_equal_eager(preset):
    """``train.fused_head_kernel=compiled``: the passes as GPUs run them, here compiled for CPU."""
    test_fused_decoder_equals_plain(preset, 64, kernels="compiled")


def test_a_failed_compile_falls_back_to_eager_with_one_warning(monkeypatch, caplog):
    compiles = []

    def broken_compile(fn, **kwargs):
        compiles.append(fn.__name__)

        def run(*args):
            raise RuntimeError(
                "Cannot find a working triton installation. Either the package is not installed or "
                "it is too old.\nMore details"
            )

        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    monkeypatch.setattr(fused_head, "_on_gpu", lambda x: True)  # auto compiles on GPUs only
    with caplog.at_level(logging.WARNING, logger=fused_head.__name__):
        # the eager results, after the failure (one fused model: a model's passes share one policy)
        test_fused_decoder_equals_plain("tiny-h4b16k", 64, kernels="auto", chunks=(5,))
    warnings = [r for r in caplog.records if "runs eagerly" in r.getMessage()]
    assert (
        len(warnings) == 1
        and "Cannot find a working triton installation" in warnings[0].getMessage()
    )
    assert "More details" not in warnings[0].getMessage()
    assert len(compiles) == 1  # the first failure switches every pass to eager: no retries

    with pytest.raises(RuntimeError, match="triton"):  # forced: a failure stops the run
        test_fused_decoder_equals_plain("tiny-h4b16k", 64, kernels="compiled")

    compiles.clear()
    test_fused_decoder_equals_plain("tiny-h4b16k", 64, kernels="eager")
    assert compiles == []


# ---------------------------------------------------------------------------------------------------- profile
def _probe_placement(rank, world, device, dtype):
    from mhf_dist.profiling.training import probe_model

    cfg = load_config(
        "tiny-h4b16k", overrides=["model.hash.num_buckets=256", "parallel.tp=2"]
    ).model
    model, params = probe_model(cfg, world, torch.device(device), dtype)
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    return params, {n: (str(t.device), t.dtype) for n, t in tensors.items()}


@pytest.mark.multirank
def test_profile_model_at_tp2_is_wholly_on_the_device_and_dtype():
    # the meta device stands in for a GPU: a module left on the host (the tensor-parallel ones are built there)
    # would be "cpu" here, as it would stay on the host beside a CUDA model
    for params, placement in run_ranks(_probe_placement, 2, "meta", torch.bfloat16):
        assert params > 0 and any("vocab.tables" in n for n in placement)
        wrong = {
            n: p
            for n, p in placement.items()
            if p[0] != "meta" or (p[1].is_floating_point and p[1] != torch.bfloat16)
        }
        assert not wrong, wrong


# ---------------------------------------------------------------------------------------------------- device choice
class CudaAccelerator:
    """DeepSpeed's accelerator as it is on a CUDA host (the CPU one underneath for everything else)."""

    def __init__(self, real):
        self.real = real

    def device_name(self, index=None):
        return "cuda" if index is None else f"cuda:{index}"

    def device(self, index=None):
        return torch.device("cuda", index)

    def communication_backend_name(self):
        return "nccl"

    def __getattr__(self, name):
        return getattr(self.real, name)


class Joined(Exception):
    """Raised by a stand-in for torch.distributed.init_process_group once it has recorded its call."""


@pytest.mark.parametrize("backend, bound", [("gloo", None), ("nccl", torch.device("cuda", 1))])
def test_on_a_cuda_host_only_an_nccl_group_is_bound_to_the_ranks_device(
    monkeypatch, backend, bound
):
    # a gloo group bound to a device makes torch split it for each new subgroup, which only NCCL implements
    import deepspeed.accelerator.real_accelerator as real
    import deepspeed.comm.comm as comm

    from mhf_dist.backend import init_distributed

    calls = []

    # its signature: DeepSpeed reads it for device_id
    @functools.wraps(torch.distributed.init_process_group)
    def init_process_group(backend, **kwargs):
        calls.append((backend, kwargs))
        raise Joined

    monkeypatch.setattr(real, "ds_accelerator", CudaAccelerator(real.get_accelerator()))
    monkeypatch.setattr(comm, "cdb", None)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "init_process_group", init_process_group)
    for key, value in dict(
        RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29999"
    ).items():
        monkeypatch.setenv(key, value)
    with pytest.raises(Joined):
        init_distributed(backend, timedelta(seconds=30), torch.device("cuda", 1))
    assert [(b, kwargs.get("device_id")) for b, kwargs in calls] == [(backend, bound)]
    assert calls[0][1]["timeout"] == timedelta(seconds=30)


def test_a_backend_loaded_for_another_device_is_refused_by_name(monkeypatch):
    import deepspeed.accelerator.real_accelerator as real

    from mhf_dist.backend import init_distributed

    monkeypatch.setattr(real, "ds_accelerator", CudaAccelerator(real.get_accelerator()))
    with pytest.raises(
        MhfError,
        match="DeepSpeed computes on cuda but this rank trains on cpu .*DS_ACCELERATOR=cpu",
    ):
        init_distributed("gloo", timedelta(seconds=30), torch.device("cpu"))


class VisibleGpu:
    """torch.cuda reporting one GPU, each question recorded (a CPU build answers nothing else)."""

    def __init__(self, monkeypatch):
        self.asked = []
        monkeypatch.setattr(
            torch.cuda, "is_available", lambda: self.asked.append("is_available") or True
        )
        monkeypatch.setattr(
            torch.cuda, "device_count", lambda: self.asked.append("device_count") or 1
        )


def test_a_cpu_run_on_a_gpu_host_sets_the_cpu_accelerator_before_its_ranks_load(
    monkeypatch, tmp_path
):
    import deepspeed.accelerator.real_accelerator as real

    from mhf_dist.cli import RANK_PRELOAD, main
    from mhf_dist.cluster import launch

    gpu = VisibleGpu(monkeypatch)
    # DeepSpeed chooses again, as in a fresh launcher
    monkeypatch.setattr(real, "ds_accelerator", None)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    preloaded, started, import_module = [], [], launch.importlib.import_module

    def preload(name, package=None):
        if (
            name in RANK_PRELOAD
        ):  # what the ranks import, and the accelerator DeepSpeed would load for them now
            preloaded.append(
                (name, os.environ.get("DS_ACCELERATOR"), real.get_accelerator().device_name())
            )
        return import_module(name, package)

    monkeypatch.setattr(launch.importlib, "import_module", preload)
    monkeypatch.setattr(launch.RankSupervisor, "run", lambda self, envs: started.extend(envs) or 0)
    assert (
        main(
            [
                "train",
                "--preset",
                "tiny-h4b16k",
                "--nproc-per-node",
                "2",
                "--run-dir",
                str(tmp_path / "run"),
                "--set",
                "train.device=cpu",
            ]
        )
        == 0
    )
    assert {name for name, *_ in preloaded} == set(RANK_PRELOAD)
    assert {(env, chosen) for _, env, chosen in preloaded} == {("cpu", "cpu")}
    assert [env["DS_ACCELERATOR"] for env in started] == ["cpu", "cpu"]
    assert gpu.asked == []  # the launcher asked CUDA nothing, so its ranks can be forked


def _train_beside_a_visible_gpu(args: list[str], out: Path) -> None:
    """In a forked child: ``mhf-dist ARGS`` as a rank started without mhf-dist's launcher, on a host whose torch
    sees a GPU and whose DeepSpeed has not chosen its accelerator yet."""
    import deepspeed.accelerator.real_accelerator as real

    from mhf_dist.cli import main

    code = 1
    try:
        torch.set_num_threads(1)
        torch.cuda.is_available = lambda: True
        torch.cuda.device_count = lambda: 1
        real.ds_accelerator = None
        os.environ.pop("DS_ACCELERATOR", None)
        code = main(args)
        out.write_text(real.get_accelerator().device_name())
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


@pytest.mark.multirank
def test_a_cpu_rank_on_a_gpu_host_trains_on_the_cpu_and_saves_no_gpu_generator(tmp_path, data):
    import multiprocessing

    from helpers.runs import train_args

    run, out = tmp_path / "run", tmp_path / "accelerator"
    args = train_args(run, data, 1, "train.device=cpu", "train.checkpoint_interval=2", steps=2)
    args.remove("--nproc-per-node")
    args.remove("1")
    child = multiprocessing.get_context("fork").Process(
        target=_train_beside_a_visible_gpu, args=(args, out)
    )
    child.start()
    child.join(300)
    assert child.exitcode == 0 and out.read_text() == "cpu"
    from safetensors import safe_open

    with safe_open(
        str(run / "checkpoints" / "step-00000002" / checkpoint.RNG_FILE.format(0)), "pt"
    ) as f:
        assert set(f.keys()) == {"torch"}  # no GPU generator state
