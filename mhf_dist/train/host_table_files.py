"""The checkpoint files of host-memory Engram tables and their AdamW state (``model.engram.offload``).

Whole tables are one file, ``engram-host-tables.safetensors``, written by rank 0; sharded tables one file per slice of
rows (under a pipeline, per stage and slice), ``engram-host-tables-GGGGG-of-NNNNN.safetensors``, each recording in its
metadata the rows it holds. Tensors are
named ``layers.<i>.<weight|exp_avg|exp_avg_sq|step>``, every table tensor ``[T, rows, d]``. ``HostTableFiles`` reads any
range of rows from whichever files hold them, so a checkpoint resumes whole or sharded over any number of ranks.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

HOST_TABLES_FILE = "engram-host-tables.safetensors"
SHARD_FILE = "engram-host-tables-{:05d}-of-{:05d}.safetensors"


def shard_metadata(first: int, last: int, num_rows: int) -> dict[str, str]:
    """What a shard file records: it holds rows ``[first, last)`` of ``num_rows``."""
    return {"first_row": str(first), "last_row": str(last), "num_rows": str(num_rows)}


class HostTableFiles:
    """The host-table files of one checkpoint directory: each holds some layers' tables (under a pipeline, a stage's)
    over a range of rows. Raises FileNotFoundError when it holds none, or when a layer's rows are not held once."""

    def __init__(self, checkpoint: Path):
        paths = sorted(checkpoint.glob("engram-host-tables*.safetensors"))
        if not paths:
            raise FileNotFoundError(f"no {HOST_TABLES_FILE} nor its shards in {checkpoint}")
        self.files = []  # (open file, its layers, first row, last row)
        for path in paths:
            file = safe_open(str(path), "pt")
            meta, layers = file.metadata() or {}, self.layers(file)
            if "first_row" in meta:
                first, last = int(meta["first_row"]), int(meta["last_row"])
            else:  # whole tables
                first, last = 0, file.get_slice(f"layers.{layers[0]}.weight").get_shape()[1]
            self.files.append((file, layers, first, last))
        self.files.sort(key=lambda f: f[2])
        self.num_rows = max(last for *_, last in self.files)
        for layer in sorted({i for _, layers, _, _ in self.files for i in layers}):
            spans = [(first, last) for _, layers, first, last in self.files if layer in layers]
            starts = [first for first, _ in spans]
            if starts != [0] + [last for _, last in spans[:-1]] or spans[-1][1] != self.num_rows:
                raise FileNotFoundError(
                    f"the host-table files in {checkpoint} do not hold each of {self.num_rows} rows of layer "
                    f"{layer} once (its files' rows start at {starts})"
                )

    @staticmethod
    def layers(file) -> list[int]:
        return sorted({int(name.split(".")[1]) for name in file.keys()})

    def names(self) -> list[str]:
        """Every tensor's name."""
        return sorted({name for file, *_ in self.files for name in file.keys()})

    def read(self, name: str, first: int = 0, last: int | None = None) -> torch.Tensor:
        """Tensor ``name``: a table tensor's rows ``[first, last)`` (default: all), a scalar as it is."""
        holding = [(file, lo, hi) for file, _, lo, hi in self.files if name in file.keys()]
        file = holding[0][0]
        if not file.get_slice(name).get_shape():
            return file.get_tensor(name)
        last = self.num_rows if last is None else last
        return torch.cat(
            [
                file.get_slice(name)[:, max(first, lo) - lo : min(last, hi) - lo]
                for file, lo, hi in holding
                if max(first, lo) < min(last, hi)
            ],
            dim=1,
        )
