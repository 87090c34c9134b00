"""The RNG state files of a checkpoint, one per rank: python's, numpy's, torch's and the rank's own GPU generator,
as safetensors with JSON metadata (read without pickle), and the ``rng-rank*.pt`` of older checkpoints, unpickled with
``weights_only=True``. docs/design-training.md, "Checkpoints", says why."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save

from mhf_dist.train.checkpoint.index import CheckpointError

RNG_FILE = "rng-rank{:05d}.safetensors"
LEGACY_RNG_FILE = "rng-rank{:05d}.pt"


def rng_state_bytes(cuda: bool) -> bytes:
    """This process's generator states as a file's content, without pickle: torch's and, for a rank on a GPU
    (``cuda``), its GPU's (uint8 tensors) as safetensors, python's and numpy's (integers and a float) as JSON in its
    metadata. A rank on the CPU asks CUDA nothing, also where a GPU is visible."""
    version, internal, gauss_next = random.getstate()
    generator, key, pos, has_gauss, cached_gaussian = np.random.get_state()
    metadata = {
        "python": json.dumps([version, list(internal), gauss_next]),
        "numpy": json.dumps(
            [generator, key.tolist(), int(pos), int(has_gauss), float(cached_gaussian)]
        ),
    }
    tensors = {"torch": torch.get_rng_state()}
    if cuda:  # the rank's own GPU only: a resume may see fewer GPUs (one bound to each task)
        tensors["cuda"] = torch.cuda.get_rng_state()
    return save(tensors, metadata=metadata)


def read_rng_state(path: Path) -> dict:
    """The states of a file holding ``rng_state_bytes``, in the form ``set_rng_state`` takes."""
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
        version, internal, gauss_next = json.loads(metadata["python"])
        generator, key, pos, has_gauss, cached_gaussian = json.loads(metadata["numpy"])
        state = {
            "python": (version, tuple(internal), gauss_next),
            "numpy": (generator, np.array(key, dtype=np.uint32), pos, has_gauss, cached_gaussian),
            "torch": tensors["torch"],
        }
    except Exception as e:  # a damaged header (SafetensorError), missing or malformed states
        raise CheckpointError(
            f"{path} is not a readable RNG state ({e}); resume from another checkpoint"
        ) from e
    if "cuda" in tensors:
        state["cuda"] = tensors["cuda"]
    elif any(
        k.startswith("cuda.") for k in tensors
    ):  # saved with every visible GPU's state, cuda.0, cuda.1, ...
        state["cuda"] = [
            tensors[k]
            for k in sorted(
                (k for k in tensors if k.startswith("cuda.")), key=lambda k: int(k.split(".")[1])
            )
        ]
    return state


def read_legacy_rng_state(path: Path) -> dict:
    """An ``rng-rank*.pt`` of a checkpoint saved before RNG states were safetensors, unpickled with
    ``weights_only=True``: tensors, tuples and numpy arrays only, so the file cannot run code."""
    # numpy.core.multiarray's (numpy 1) or numpy._core's (numpy 2)
    reconstruct = np.array(0).__reduce__()[0]
    allowed = [(reconstruct, f"numpy.{core}.multiarray._reconstruct") for core in ("core", "_core")]
    allowed += [np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    try:
        with torch.serialization.safe_globals(allowed):
            state = torch.load(path, weights_only=True)
        if not (isinstance(state, dict) and {"python", "numpy", "torch"} <= state.keys()):
            raise ValueError("not a dict of python, numpy and torch states")
    except (
        Exception
    ) as e:  # the unpickler refuses anything else with UnpicklingError, RuntimeError or others
        raise CheckpointError(
            f"{path} is not a plain RNG state ({_refusal(e)}), so it was not loaded (unpickling it without "
            "restrictions could run code from it): resume from a checkpoint from a trusted source"
        ) from e
    return state


def _refusal(error: Exception) -> str:
    """The line of a ``weights_only`` refusal that names what the file holds (not torch's advice to unpickle it)."""
    lines = str(error).splitlines()
    named = [line.strip() for line in lines if "GLOBAL" in line or "Unsupported" in line]
    if named:
        return named[0][:200]
    return (
        "refused by the restricted unpickler"
        if "weights_only" in str(error)
        else (lines or ["?"])[0][:200]
    )


def set_rng_state(state: dict, cuda: bool) -> None:
    """Restore ``state``; its GPU generator's only for a rank on a GPU (``cuda``)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and cuda:
        torch.cuda.set_rng_state(current_device_rng(state["cuda"]))


def current_device_rng(cuda: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    """This rank's GPU generator state from a checkpoint: the one saved state, or, from checkpoints that saved every
    visible GPU's, the entry of the current device (the first when the resume sees fewer GPUs than the save did)."""
    if torch.is_tensor(cuda):
        return cuda
    index = torch.cuda.current_device()
    return cuda[index] if index < len(cuda) else cuda[0]
