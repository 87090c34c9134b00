"""What the training loop reads through: ``TrainingData``, the protocol of one data-parallel rank's training
data, which the shard reader (one directory, ``data.path``) and the mixture reader (``data.sources``) both implement,
and ``DataPosition``, that data's part of a checkpoint (its position, with ``data.restart``'s exception)."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    import torch

    from mhf_dist.data.reader import ShardReader


class Validation(NamedTuple):
    """One validation split of a run's data, as an evaluation reads it."""

    label: str | None  # the source's label in a mixture (None: the run's one directory)
    weight: float  # its share of the mixture (1.0 for one directory)
    reader: ShardReader  # this rank's reader of the split, from its start


class TrainingData(Protocol):
    """One data-parallel rank's batches of a run's training split, their position (identical on every rank, saved in
    checkpoints) and the validation splits beside them."""

    name: str  # what the run's logs call this data

    def next_batch(self, micro_batch: int, pin: bool = False) -> torch.Tensor:
        """This rank's next ``micro_batch`` samples ``[micro_batch, seq_len + 1]``, in pinned memory with ``pin``."""

    def state_dict(self) -> dict:
        """The position of the next unread sample (JSON-serialisable)."""

    def state_mismatch(self, state: dict) -> str | None:
        """Why ``state`` is a position in other data, or None when it is one of this data's."""

    def load_state_dict(self, state: dict) -> None:
        """Continue at ``state``'s position (the rank count may differ from the saving run's)."""

    def validation(self) -> list[Validation]:
        """Readers of the validation splits, each from its start (none where the data has none)."""

    def consumed(self) -> dict[str, int]:
        """Samples read so far from each source, by its label, over all ranks (one directory has no sources)."""
        return {}

    def describe(self, samples: int, tokens: int) -> list[str]:
        """What a start says of the data for a run of ``samples`` samples (``tokens`` tokens): nothing but for a
        mixture, each source's share and epochs."""
        return []

    def close(self) -> None:
        """Stop reading ahead; the next batch continues where the data stands."""


class DataPosition:
    """The data's part of a checkpoint's client state, ``reader``: its position. With ``data.restart`` (``restart``),
    a position in other data (another data.path, shuffle seed or window) is dropped on load and the data is read from
    its beginning; ``dropped`` says why."""

    def __init__(self, data: TrainingData, restart: bool):
        self.data, self.restart = data, restart
        self.dropped: str | None = None  # the last load's position was in other data: this mismatch

    def state_dict(self) -> dict:
        return {"reader": self.data.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        mismatch = self.data.state_mismatch(state["reader"])
        self.dropped = mismatch if self.restart else None
        if self.dropped is None:
            # refuses another stream's position, naming data.restart
            self.data.load_state_dict(state["reader"])
