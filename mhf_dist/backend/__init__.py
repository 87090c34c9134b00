"""The training backend's boundary (docs/design.md, "The backend boundary").

A backend builds the engine that holds this rank's part of the model and its optimizer, steps it, evaluates with it
and writes and reads its checkpoint files. What the rest of the package uses of it is :class:`Trainer`: the training
loop steps, evaluates and logs through it, the checkpointer saves and loads through it (:class:`FileWriter` is how
the backend's files reach the checkpointer's integrity logic), and the host-memory Engram tables
(:class:`~mhf_dist.train.host_tables.HostTablesStep`) read the optimizer step through it.

The one backend is DeepSpeed's, :mod:`mhf_dist.backend.deepspeed`: the only package that imports DeepSpeed or calls
into it. This module imports no backend.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from mhf_dist.data.reader import ShardReader
    from mhf_dist.train.host_tables import HostTablesStep

TrainingFlags = Callable[[], Sequence[bool]]  # the loop's flags, asked for at the end of a step


@dataclass
class StepStats:
    loss: float  # mean over the global batch
    head_losses: list[float]
    grad_norm: float | None  # DeepSpeed reports none without ZeRO
    p_inf_loss: float | None = None  # mean -log P_inf(target) of the loss's term (model.hash.p_inf_loss_weight > 0)
    flags: list[bool] | None = None  # train_step's ``flags``, each raised on any rank (None when not asked)


class FileWriter(Protocol):
    """Where a backend's checkpoint files go during one save (:class:`~mhf_dist.train.checkpoint.RecordingWriter`:
    it fsyncs and digests each file and records a failed write instead of raising it)."""

    def save(self, state: object, path: Path, save_file: Callable[[object, Path], None]) -> None:
        """Have ``save_file(state, path)`` write ``state`` to ``path``: now, or later from a copy taken now."""


class Trainer(Protocol):
    """One rank's engine, as the training loop, the checkpointer and the host tables use it."""

    host_tables: HostTablesStep | None  # model.engram.offload: the Engram tables in host memory, stepped beside
    device: torch.device  # where this rank computes
    optimizer: torch.optim.Optimizer  # the torch optimizer under the backend's (its groups hold the hyperparameters)
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler

    @property
    def lr(self) -> float:
        """The learning rate of the next step."""

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped so far (a gradient overflow)."""

    def train_step(self, reader: ShardReader, flags: TrainingFlags | None = None) -> StepStats:
        """One optimizer step on the global batch; ``flags`` come back agreed over all ranks."""

    def evaluate(self, reader: ShardReader, batches: int) -> dict:
        """The ``val_*`` metrics over ``batches`` micro-batches on each data-parallel rank."""

    def local_parameters(self) -> Iterator[torch.Tensor]:
        """The values this rank holds of its parameters (a ZeRO-3 partition, or its pipeline stage's)."""

    def gradient_clipping(self) -> float:
        """The gradient norm the step clips to (0: none)."""

    def step_skipped(self) -> bool:
        """Whether the last optimizer step was skipped (a gradient overflow)."""

    def global_grad_norm(self) -> float:
        """The global gradient norm the last optimizer step clipped with (a host read)."""

    def save_files(self, path: Path, client: dict, writer: FileWriter) -> None:
        """This rank's model, optimizer and scheduler files of checkpoint directory ``path``, ``client`` inside them,
        every file through ``writer``."""

    def load_files(self, path: Path, universal: bool) -> dict | None:
        """Model, optimizer and scheduler from checkpoint directory ``path`` (``universal``: a layout-free
        conversion); the ``client`` state saved with them, None when the backend could not load them."""
