"""What a checkpoint holds of the run beside the engine's files and the RNG states: the client state, each part of it
registered by the component it belongs to, under keys of its own.

A save writes every part's ``state_dict``; a resume and a rollback load every part from the same
dict, through ``ClientState.load_state_dict``. The keys are those checkpoints have always held (``step``,
``tokens``, ``reader``, ``config``, ..., ``loss_watch``), so older checkpoints load; a part whose keys a checkpoint
lacks (saved before that part kept its state) loads the state it had when registered, its start.
"""

from __future__ import annotations

import copy
from typing import Protocol


class Stateful(Protocol):
    def state_dict(self) -> dict:
        """This part's keys of the client state, and their values."""

    def load_state_dict(self, state: dict) -> None:
        """Take the values of this part's keys, from a checkpoint."""


class ClientState:
    """The registered parts, in the order their keys are saved."""

    def __init__(self):
        self.parts: list[tuple[Stateful, dict]] = []  # each part with its state when registered

    def register(self, part: Stateful) -> None:
        initial = copy.deepcopy(part.state_dict())  # kept apart from the part's own lists
        taken = {key for _, first in self.parts for key in first}
        if clash := sorted(taken & initial.keys()):
            raise ValueError(f"client state keys {clash} are registered twice")
        self.parts.append((part, initial))

    def state_dict(self) -> dict:
        return {key: value for part, _ in self.parts for key, value in part.state_dict().items()}

    def load_state_dict(self, client: dict) -> None:
        for part, initial in self.parts:
            if initial:
                part.load_state_dict(
                    {key: client.get(key, value) for key, value in initial.items()}
                )
