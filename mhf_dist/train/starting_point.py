"""Where a run starts: the checkpoint it resumes from (``--resume``), and the layout a checkpoint records, which a
resume compares to load it as it is; or, for a new run, the weights file it initialises from (``train.init_from``)."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from mhf_dist.config import RunConfig
from mhf_dist.model.lm import LanguageModel
from mhf_dist.parallel.construct import FileValues, full_shapes
from mhf_dist.parallel.layout import Layout
from mhf_dist.parallel.stages import layer_costs, pipeline_bounds
from mhf_dist.train.checkpoint import Checkpointer, CheckpointError


def checkpoint_layout(cfg: RunConfig, layout: Layout, vocab_rows: int) -> dict:
    """The layout a checkpoint records, and a resume compares to load it as it is: tp, pp, dp and, with a pipeline,
    its cut (layers per stage), which also follows from the model and the sequence length: a checkpoint of another
    cut holds other layers' optimizer state in each stage's files, so it loads through a conversion."""
    recorded = {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp}
    if layout.pp > 1:
        recorded["stages"] = pipeline_bounds(
            layer_costs(cfg.model, cfg.data.seq_len, vocab_rows), layout.pp
        )
    return recorded


def resume_path(resume: str, checkpointer: Checkpointer) -> Path | None:
    """The checkpoint ``--resume`` names: ``auto``, the newest that verifies (None: none yet); ``none``, none (refused
    where the run has checkpoints); else the path given."""
    if resume == "auto":
        return checkpointer.resumable()
    if resume == "none":
        if checkpointer.latest() is not None:
            raise CheckpointError(
                f"{checkpointer.dir} holds checkpoints; resume (--resume auto) or use a new run dir"
            )
        return None
    return checkpointer.store.resolve(resume)


def init_weights_file(path: Path, model: LanguageModel, tp: int) -> FileValues:
    """``train.init_from``: every parameter from a full state dict (our names), each rank reading its shards."""
    if not path.is_file():
        raise CheckpointError(
            f"train.init_from: {path} does not exist; point it at a model.safetensors "
            "(mhf-dist export, import-hf or expand-vocab write one)"
        )
    try:
        return FileValues(path, full_shapes(model, tp))
    except Exception as e:  # truncated file, or weights of another architecture
        raise CheckpointError(
            f"train.init_from: {path} cannot initialise this model ({e}); "
            "use weights exported from a run with the same model config"
        ) from e


class ResumePoint(NamedTuple):
    """The checkpoint a run resumes from."""

    asked: Path  # the checkpoint named by --resume (or the newest, under auto)
    load: Path  # what is loaded: that checkpoint, or its conversion to this layout
    universal: bool  # converted to this layout
