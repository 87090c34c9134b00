"""DeepSpeed's checkpoint I/O: the engine's ``save_checkpoint`` with every file it writes handed to the
checkpointer's writer, and its ``load_checkpoint``.

The engine writes each file through its checkpoint engine (``engine.checkpoint_engine.save(state_dict, path)``); for
one save that attribute is replaced by ``WriterHook``, which hands each file to the
``FileWriter`` (fsynced and digested there, or written later by an asynchronous save), written
by the real checkpoint engine still, and each directory too. The recovery scripts the engine copies beside the step
directories go through the writer as well, so that a failure anywhere in a save is recorded, never raised.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import deepspeed.utils
import torch

from mhf_dist.backend import FileWriter

RECOVERY_SCRIPTS = (
    "zero_to_fp32.py",
    "zero_to_torch.py",
)  # what DeepSpeed copies (tests/test_deepspeed_contract.py)


class WriterHook:
    """Stands in for DeepSpeed's checkpoint engine during one save: each file goes to ``writer``, which has the real
    engine write it; everything else (makedirs, create, commit, is_decoupled, ...) is the real engine's."""

    def __init__(self, real, writer: FileWriter):
        self.real, self.writer = real, writer

    def save(self, state_dict, path) -> None:
        self.writer.save(state_dict, Path(path), lambda state, p: self.real.save(state, str(p)))

    def makedirs(self, path, exist_ok=False) -> None:
        # the engine would log a failure as an error and go on to write into the missing directory
        self.writer.makedirs(Path(path))

    def __getattr__(self, name):
        return getattr(self.real, name)


def save_checkpoint(engine, path: Path, client: dict, writer: FileWriter) -> None:
    """The engine's files of checkpoint directory ``path`` (its tag is the directory's name), ``client`` inside them,
    through ``writer``; ``latest`` is the checkpointer's to write."""
    real = engine.checkpoint_engine
    engine.checkpoint_engine = WriterHook(real, writer)
    # the engine copies its recovery scripts with shutil, whose failure would end the save on this rank alone
    engine._copy_recovery_script = lambda save_dir: copy_recovery_scripts(Path(save_dir), writer)
    try:
        engine.save_checkpoint(
            str(path.parent), tag=path.name, client_state=client, save_latest=False
        )
    finally:
        engine.checkpoint_engine = real
        del engine._copy_recovery_script


def copy_recovery_scripts(directory: Path, writer: FileWriter) -> None:
    """DeepSpeed's scripts that rebuild a model from a checkpoint's ZeRO files, into ``directory`` through
    ``writer``."""
    source = Path(deepspeed.utils.__file__).parent
    for name in RECOVERY_SCRIPTS:
        writer.save((source / name).read_bytes(), directory / name, _write_script)


def _write_script(data: bytes, path: Path) -> None:
    """Whole or not at all (through a temporary file beside it), executable as DeepSpeed makes it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        tmp.chmod(tmp.stat().st_mode | stat.S_IEXEC)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def load_checkpoint(
    engine, optimizer: torch.optim.Optimizer, path: Path, universal: bool
) -> dict | None:
    """The engine's model, optimizer and scheduler from checkpoint directory ``path``; its client state, None when
    DeepSpeed could not load it. ``universal``: DeepSpeed's universal loading leaves AdamW's bias-correction step
    count unset for ZeRO-3 sources; every parameter took every optimizer step, so it is the client's global step."""
    _, client = engine.load_checkpoint(str(path.parent), tag=path.name, load_module_strict=True)
    if client is not None and universal:
        set_adam_steps(optimizer, client["step"])
    return client


def set_adam_steps(optimizer: torch.optim.Optimizer, step: int) -> None:
    """Every parameter's AdamW step count set to ``step``."""
    for state in optimizer.state.values():
        if "step" in state:
            state["step"] = (
                torch.full_like(state["step"], step) if torch.is_tensor(state["step"]) else step
            )
