"""Checkpoints: atomic, sharded, verified saves and exact resume (preemption, crash and disk-full safe).

- ``index``: which checkpoints a run directory holds, the ``complete.json`` marker and
  the file checks against it (no torch: ``status`` reads it);
- ``rng``: the per-rank RNG state files;
- ``writers``: the writers of a save's files, synchronous and in the background;
- ``lineage``: ``latest``, the checkpoints a resume sets aside, retention and the
  background deletes;
- ``reading``: which checkpoint a resume continues from, the verification, the
  conversion for another layout and the load (a base of ``Checkpointer``);
- ``store``: where the checkpoints are kept: ``RUN/checkpoints``, or object storage (``train.checkpoint_dir``);
- ``checkpointer``: ``Checkpointer``, which saves, commits, verifies and loads.

How a save is made atomic and verified, and why: docs/design-training.md, "Checkpoints". The names below are
importable from here; they load on first use, so that importing ``index`` loads no torch.
"""

import importlib

PUBLIC = {  # name: the module that defines it
    "Checkpointer": "checkpointer",
    "_as_written_now": "reading",
    "CheckpointError": "index",
    "MARKER": "index",
    "LATEST": "index",
    "checkpoint_bytes": "index",
    "RNG_FILE": "rng",
    "LEGACY_RNG_FILE": "rng",
    "rng_state_bytes": "rng",
    "read_rng_state": "rng",
    "read_legacy_rng_state": "rng",
    "set_rng_state": "rng",
    "RecordingWriter": "writers",
    "HostSnapshot": "writers",
    "UNIVERSAL": "lineage",
    "DELETING": "lineage",
    "BackgroundDeleter": "lineage",
    "CheckpointStore": "store",
    "checkpoint_store": "store",
}

__all__ = [name for name in PUBLIC if not name.startswith("_")]


def __getattr__(name: str):
    if name in PUBLIC:
        return getattr(importlib.import_module(f"{__name__}.{PUBLIC[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *PUBLIC])
