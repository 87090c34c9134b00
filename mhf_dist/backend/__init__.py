"""The training backend's boundary (docs/design.md, "The backend boundary").

A backend builds the engine that holds this rank's part of the model and its optimizer, steps it, evaluates with it
and writes and reads its checkpoint files. What the rest of the package uses of it is ``Trainer``: the training
loop steps, evaluates and logs through it, the checkpointer saves and loads through it (``FileWriter`` is how
the backend's files reach the checkpointer's integrity logic), and the host-memory Engram tables read the optimizer
step through it. What the backend needs of the code above it, it names here: where its batches come from
(``BatchSource``), how its optimizer is made (``OptimizerFactory``) and the tables it steps beside its
engine (``HostTableStep``).

The functions below are the rest of what the package asks of a backend: its config for a run and what is read from
it, joining the process group, building the trainer, partitioning parameters as construction makes them, and
converting checkpoints between layouts. The one backend is DeepSpeed's, ``mhf_dist.backend.deepspeed``: the only
package that imports DeepSpeed or calls into it. Its config readers need neither torch nor DeepSpeed (``plan`` and
``submit`` use them on a login node); the rest loads them when called.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from mhf_dist.config import ModelConfig, RunConfig
    from mhf_dist.model.lm import LanguageModel
    from mhf_dist.parallel.construct import Partitioner
    from mhf_dist.parallel.groups import ParallelGroups
    from mhf_dist.parallel.layout import Layout

__all__ = [
    "checkpoint_interval",
    "engine_config",
    "fp32_accumulation",
    "grad_accum_dtype",
    "zero_stage",
    "engine_buffer_bytes",
    "hostfile_template",
    "versions",
    "RANK_MODULES",
    "StepStats",
    "BatchSource",
    "HostTableStep",
    "OptimizerFactory",
    "SpikeLimits",
    "HostTableFactory",
    "LossWrapper",
    "FileWriter",
    "Trainer",
    "accelerator_env",
    "init_distributed",
    "build_trainer",
    "partitions_parameters",
    "parameter_partitioner",
    "consolidate",
    "convert_for_layout",
    "universal_info",
]

TrainingFlags = Callable[[], Sequence[bool]]  # the loop's flags, asked for at the end of a step

# What a training rank imports besides the loop, some of it only when first used (the engine and what its config
# and process group start load; torch's compiler, which the optimizer and DeepSpeed's ZeRO optimizers load when they
# first run), and DeepSpeed's probe of its ops: a launcher that forks its ranks imports these once, before it forks
# (mhf_dist.cluster.launch).
RANK_MODULES = (
    "mhf_dist.backend.deepspeed.trainer",
    "mhf_dist.backend.deepspeed.op_probe",
    "deepspeed.runtime.zero.muon.muon_optimizer",
    "deepspeed.module_inject.auto_ep_config",
    "deepspeed.module_inject.auto_ep_layer",
    "torch._dynamo",
    "torch.utils.cpp_extension",
    "torch.utils.tensorboard",
)


@dataclass
class StepStats:
    loss: float  # mean over the global batch
    head_losses: list[float]
    grad_norm: float | None  # DeepSpeed reports none without ZeRO
    p_inf_loss: float | None = (
        None  # mean -log P_inf(target) of the loss's term (model.hash.p_inf_loss_weight > 0)
    )
    flags: list[bool] | None = (
        None  # train_step's ``flags``, each raised on any rank (None when not asked)
    )
    skipped: bool = False  # past train_step's ``limits``: the step applied no update
    health: dict[str, float] | None = (
        None  # the health metrics, when train_step measured them (``health``)
    )
    # the z-loss term the objective added, mean over the global batch (train.z_loss_weight > 0; ``loss`` leaves it out)
    z_loss: float | None = None


@dataclass(frozen=True)
class SpikeLimits:
    """What a step may reach and still update the weights (``train.on_spike=skip``): its global mean loss at most
    ``loss`` and its global gradient norm at most ``grad_norm`` (``inf``: no limit). A step past either, or with a
    non-finite one, is left out on every rank: the optimizer applies no update (weights, moments and step counts stay
    as they were), the learning-rate schedule still advances."""

    loss: float = math.inf
    grad_norm: float = math.inf


class BatchSource(Protocol):
    """Where a trainer's micro-batches come from (the training loop's shard reader, or a mixture's)."""

    def next_batch(self, micro_batch: int, pin: bool = False) -> torch.Tensor:
        """This rank's next ``micro_batch`` samples ``[micro_batch, seq_len + 1]``, in pinned memory with ``pin``."""


class HostTableStep(Protocol):
    """Tables in host memory that a trainer steps beside its engine (``model.engram.offload``), in the order its step
    calls them: each micro-batch's rows gathered ahead of its forward, then the host gradients readied before the
    engine's optimizer step, whose global gradient norm includes theirs, then their own update."""

    def prefetch(self, input_ids: torch.Tensor) -> None:
        """Start gathering the rows ``input_ids`` read (the next micro-batch's)."""

    def advance(self) -> None:
        """Move to the next gathered micro-batch."""

    def host_norm_on(self, like: torch.Tensor) -> torch.Tensor:
        """The host gradients' norm, on ``like``'s device and dtype."""

    def before_step(self) -> None:
        """At the accumulation boundary, before the engine's optimizer step."""

    def norm_in_step_on(self, like: torch.Tensor) -> torch.Tensor:
        """``before_step``, then ``host_norm_on``: asked from inside the optimizer step of an engine whose schedule
        runs that step itself (the pipeline's)."""

    def after_step(self, global_norm: float | None = None) -> None:
        """After the engine's step: clip with ``global_norm`` and update the host tables."""


OptimizerFactory = Callable[
    ["list[tuple[str, nn.Parameter]]", Callable[["nn.Parameter"], int]],
    "tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]",
]
"""``(named, ndim) -> (optimizer, scheduler)`` for the trainable parameters of ``named`` (``(name, parameter)``, the
name in ``LanguageModel``'s naming whatever the engine's module calls it); ``ndim`` gives a
parameter's dimensions (the backend's, where it has replaced parameters by flat partitions). The optimizer leaves a
step out where its ``skip_if`` says so: the backend sets it for a step with ``SpikeLimits``, to a callable that
returns a device scalar, 1.0 to apply no update (``skippable``)."""

HostTableFactory = Callable[["nn.Module", "Trainer"], HostTableStep]
"""``(model, trainer) -> the host tables' step`` of a model whose Engram tables are in host memory."""

LossWrapper = Callable[["torch.Tensor"], "torch.Tensor"]
"""What a trainer built with one makes of each training micro-batch's loss before its backward, and reports as the
step's loss: a change to the step's numbers from outside the model (the test suite injects loss spikes so)."""


class FileWriter(Protocol):
    """Where a backend's checkpoint files go during one save (``RecordingWriter``:
    it fsyncs and digests each file and records a failed write instead of raising it)."""

    def save(self, state: object, path: Path, save_file: Callable[[object, Path], None]) -> None:
        """Have ``save_file(state, path)`` write ``state`` to ``path``: now, or later from a copy taken now."""

    def makedirs(self, path: Path) -> None:
        """Create directory ``path`` and its parents (a failure is recorded as a failed write's)."""


class Trainer(Protocol):
    """One rank's engine, as the training loop, the checkpointer and the host tables use it."""

    # model.engram.offload: the Engram tables in host memory, stepped beside
    host_tables: HostTableStep | None
    # the backbone blocks this rank computes (None: all; pp > 1: its stage's)
    layers: Sequence[int] | None
    device: torch.device  # where this rank computes
    # the torch optimizer under the backend's (its groups hold the hyperparameters)
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler

    @property
    def lr(self) -> float:
        """The learning rate of the next step."""

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped so far for a gradient overflow (those past ``SpikeLimits`` are the loop's)."""

    def train_step(
        self,
        reader: BatchSource,
        flags: TrainingFlags | None = None,
        limits: SpikeLimits | None = None,
        health: bool = False,
    ) -> StepStats:
        """One optimizer step on the global batch; ``flags`` come back agreed over all ranks; past ``limits`` the
        step applies no update (``StepStats.skipped``). ``health``: measure the health metrics
        (``mhf_dist.model.health``; with ``train.health_metrics``), read with the step's numbers after one more
        all-reduce, into ``StepStats.health``."""

    def evaluate(
        self, reader: BatchSource, batches: int, progress: Callable[[], None] = lambda: None
    ) -> dict:
        """The ``val_*`` metrics over ``batches`` micro-batches on each data-parallel rank; ``progress`` is called
        as the work goes on (the hang watchdog's sign of life)."""

    def score(
        self,
        batches: list[tuple[torch.Tensor, torch.Tensor]],
        progress: Callable[[], None] = lambda: None,
    ) -> torch.Tensor:
        """Per row of this data-parallel rank's micro-batches ``(inputs, targets)`` (as many on every rank), the
        sum of ``-log P_inf`` over its targets ``>= 0``, their top-1 hits and count: float64 ``[dp, rows, 3]``,
        every dp rank's, on every rank (a downstream task's requests, ``mhf_dist.train.downstream``)."""

    def local_parameters(self) -> Iterator[torch.Tensor]:
        """The values this rank holds of its parameters (a ZeRO-3 partition, or its pipeline stage's)."""

    def gradient_clipping(self) -> float:
        """The gradient norm the step clips to (0: none)."""

    def step_skipped(self) -> bool:
        """Whether the last optimizer step applied no update (a gradient overflow, or past its limits)."""

    def global_grad_norm(self) -> float:
        """The global gradient norm the last optimizer step clipped with (a host read)."""

    def save_files(self, path: Path, client: dict, writer: FileWriter) -> None:
        """This rank's model, optimizer and scheduler files of checkpoint directory ``path``, ``client`` inside them,
        every file through ``writer``."""

    def load_files(self, path: Path, universal: bool) -> dict | None:
        """Model, optimizer and scheduler from checkpoint directory ``path`` (``universal``: a layout-free
        conversion); the ``client`` state saved with them, None when the backend could not load them."""


# The run's engine config and what is read from it, from the modules that define them when first asked for:
# torch-free, for plan and submit on a login node.
_CONFIG_READERS = {
    "engine_config": "config",
    "zero_stage": "config",
    "grad_accum_dtype": "config",
    "fp32_accumulation": "config",
    "checkpoint_interval": "config",
    "engine_buffer_bytes": "memory",
}


def __getattr__(name: str):
    if name in _CONFIG_READERS:
        return getattr(
            importlib.import_module(f"mhf_dist.backend.deepspeed.{_CONFIG_READERS[name]}"), name
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def hostfile_template() -> str:
    """The job script (a ``string.Template``) that starts a run's ranks on the nodes of a hostfile, without a
    scheduler: ``mhf-dist submit --hostfile`` renders it (``mhf_dist.cluster.submit`` fills its fields)."""
    from importlib import resources

    return (resources.files("mhf_dist.backend.deepspeed") / "hostfile.template").read_text()


def versions() -> dict[str, str]:
    """The installed version of each package the backend is made of (``"not installed"`` when missing)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return {"deepspeed": version("deepspeed")}
    except PackageNotFoundError:
        return {"deepspeed": "not installed"}


def accelerator_env(device_type: str) -> dict[str, str]:
    """The environment that has the backend compute on ``device_type`` (cpu, cuda; ROCm GPUs are cuda devices too),
    for a process that has not loaded it yet: a launcher sets it before it imports what its ranks import, and the
    ranks it starts inherit it. Without it the backend picks a GPU wherever one is visible, and a process that has
    asked CUDA anything cannot fork its CPU ranks."""
    return {"DS_ACCELERATOR": device_type}


def init_distributed(backend: str, timeout: timedelta, device: torch.device) -> None:
    """Join the job's process group over ``backend`` (gloo, nccl) for a rank computing on ``device``, as the
    backend's engines expect it; raises MhfError when the backend was loaded for another device type."""
    from mhf_dist.backend.deepspeed.distributed import init_distributed as join

    join(backend, timeout, device)


def build_trainer(
    cfg: RunConfig,
    model: LanguageModel,
    groups: ParallelGroups,
    *,
    config: dict,
    layout: Layout,
    optimizer: OptimizerFactory,
    materialise: Callable[[nn.Module], nn.Module] | None = None,
    load_universal: bool = False,
    host_tables: HostTableFactory | None = None,
    wrap_loss: LossWrapper | None = None,
) -> Trainer:
    """This rank's trainer of ``model`` (a skeleton that ``materialise`` makes real, part by part) under the
    engine ``config``, with the optimizer ``optimizer`` makes and, for host-memory tables, the step ``host_tables``
    makes; ``load_universal``: its checkpoint will be loaded from a ``convert_for_layout`` copy; ``wrap_loss``:
    what each training micro-batch's loss becomes (``LossWrapper``)."""
    from mhf_dist.backend.deepspeed.trainer import build_trainer as build

    return build(
        cfg,
        model,
        groups,
        ds_config=config,
        layout=layout,
        make_optimizer=optimizer,
        materialise=materialise,
        load_universal=load_universal,
        host_tables=host_tables,
        wrap_loss=wrap_loss,
    )


def partitions_parameters(config: dict, layout: Layout) -> bool:
    """Whether the engine keeps only this rank's partition of each parameter: ZeRO-3 without a pipeline."""
    from mhf_dist.backend.deepspeed.config import zero_stage

    return layout.pp == 1 and zero_stage(config) == 3


def parameter_partitioner(
    config: dict, layout: Layout, groups: ParallelGroups
) -> Partitioner | None:
    """What partitions each leaf as construction makes it (``partitions_parameters``); None otherwise."""
    if not partitions_parameters(config, layout):
        return None
    from mhf_dist.backend.deepspeed.zero import Zero3Partitioner, training_dtype

    return Zero3Partitioner(config, groups, training_dtype(config))


def consolidate(checkpoint: Path, pipeline: bool) -> dict[str, torch.Tensor]:
    """One full fp32 state dict, in the model's names, from a checkpoint of any layout."""
    from mhf_dist.backend.deepspeed.universal import consolidate as read

    return read(checkpoint, pipeline)


def convert_for_layout(
    checkpoint: Path,
    out: Path,
    source_pipeline: bool,
    target_pipeline: bool,
    cfg: ModelConfig,
    zero3_tp: int = 1,
) -> Path:
    """A copy of ``checkpoint`` in ``out`` that an engine of another tp/pp/dp layout loads (``load_universal``);
    ``zero3_tp``: that engine's tensor-parallel size when it partitions parameters (ZeRO-3)."""
    from mhf_dist.backend.deepspeed.universal import convert_for_layout as convert

    return convert(checkpoint, out, source_pipeline, target_pipeline, cfg, zero3_tp)


def universal_info(param_names: list[str], cfg: ModelConfig, tp: int, pipeline: bool) -> dict:
    """What a checkpoint records for ``convert_for_layout``: how each parameter is split over tp."""
    from mhf_dist.backend.deepspeed.universal import universal_info as info

    return info(param_names, cfg, tp, pipeline)
