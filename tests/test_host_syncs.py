"""Host syncs per training step, counted on CPU through a torch-function hook (docs/design-training.md, "Host syncs").

On a GPU, a host read of a device value (``item``, ``tolist``, ``float(t)``, ``bool(t)``, ``numpy``, ``cpu``), an op
whose output shape depends on the data (``nonzero``, boolean-mask indexing, ``unique``, ``masked_select``) and a
tensor built from Python data on the device (``torch.tensor(..., device=)``: a copy from pageable memory) make the host
wait for every kernel queued before them. On CPU nothing waits, but the same calls go through
``__torch_function__``, so ``SyncCounter`` records each with its call site. What it cannot see on a CPU:
``.to(device)`` copies from pageable host memory (every tensor is on the host here) and CUDA event waits; those are
listed in the docs.

A step of the training loop (its step, log and checkpoint phases; an ordinary step: not evaluated or saved) makes
**one** host sync of ours, logged or not: ``ScalarCollectives.read`` of the dp-averaged losses, the global
gradient norm and the stop/save flags (and on a logged step the health metrics, after the one all-reduce they add,
which the test counts beside the step's other collectives). DeepSpeed 0.19.8's ZeRO-3 step makes three of its own
(fp32): ``is_invalid_grad_norm`` (``bool``) and one ``torch.tensor(-1.0, device=)`` per parameter group in
``get_grad_norm_direct``. Host-memory Engram
tables add host-only ops on host tensors (``torch.unique`` of each micro-batch's host row ids, ``nonzero`` of the lazy
row mask), which are no syncs.
"""

from __future__ import annotations

import collections
import traceback
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

import mhf_dist
from helpers.ranks import run_ranks
from mhf_dist.config import load_config
from mhf_dist.model import build_model
from mhf_dist.vocab.engram_compression import CompressionTable
from mhf_dist.vocab.signatures import SignatureTable

PACKAGE = str(Path(mhf_dist.__file__).parent)
READS = {"item", "tolist", "__float__", "__int__", "__bool__", "__index__", "numpy", "cpu"}
DATA_DEPENDENT = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive"}
V = 300


class SyncCounter(TorchFunctionMode):
    """Counts the calls that make the host wait for a GPU, as ``{(op, site): count}``; the site is ``file:function``
    of the innermost frame in mhf_dist, or in DeepSpeed when the call is DeepSpeed's."""

    def __init__(self):
        super().__init__()
        self.calls: collections.Counter = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        sync = (
            name in READS
            or name in DATA_DEPENDENT
            or (name == "tensor" and kwargs.get("device") is not None)
        )
        if name in ("__getitem__", "__setitem__") and len(args) > 1:
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            sync = any(torch.is_tensor(i) and i.dtype == torch.bool for i in index)
        if sync:
            self.calls[(name, _site())] += 1
        return func(*args, **kwargs)


def _site() -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        for root in (PACKAGE, "site-packages/deepspeed"):
            if root in frame.filename:
                path = frame.filename[frame.filename.index(root) :].removeprefix(PACKAGE + "/")
                return f"{path.removeprefix('site-packages/')}:{frame.name}"
    return "?"


@pytest.mark.parametrize(
    "preset, overrides",
    [
        ("tiny-h4b16k", []),
        ("tiny-h4b16k", ["model.hash.p_inf_loss_weight=0.5"]),
        ("tiny-h4b16k", ["model.decoder_chunk_tokens=5"]),
        ("tiny-standard+engram", ["model.engram.table_size=97"]),
    ],
)
def test_the_training_forward_and_backward_never_wait_for_the_device(preset, overrides):
    """Ignored targets included: the loss weighs them out instead of selecting the rest."""
    cfg = load_config(preset, overrides=["model.hash.num_buckets=64", *overrides]).model
    codes = (
        SignatureTable.build([f"tok{i}" for i in range(V)], 4, 64, pad_id=0).codes
        if cfg.variant == "mhf"
        else None
    )
    torch.manual_seed(0)
    model = build_model(
        cfg, V, codes, compression=CompressionTable.identity(V) if cfg.engram else None
    )
    x = torch.randint(1, V, (2, 9))
    y = x[:, 1:].clone()
    y[1, -2:] = -100
    with SyncCounter() as counter:
        model(x[:, :-1], y).loss.backward()
    assert not counter.calls


COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "broadcast",
    "reduce",
    "all_to_all_single",
    "barrier",
)


def _collective_site() -> str:
    """The innermost frame in mhf_dist outside the collectives' helpers (parallel/scalars.py), or in DeepSpeed."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if PACKAGE in frame.filename and not frame.filename.endswith("parallel/scalars.py"):
            return f"{frame.filename[len(PACKAGE) + 1 :]}:{frame.name}"
        if "site-packages/deepspeed" in frame.filename:
            return "deepspeed"
    return "?"


def _loop_syncs(rank, world, run_dir, data, overrides):
    """Train 4 steps of 4 micro-batches with the counters on, logging every second step; the host syncs and the
    collectives made from the start of each step to the start of the next (the step, log, evaluation and checkpoint
    phases), as ``(syncs, collectives)`` per step."""
    import torch.distributed as dist

    from mhf_dist.train.loop import TrainingLoop
    from mhf_dist.train.preemption import StopSignal

    preset = (
        "tiny-h4b16k+engram"
        if any(o.startswith("model.engram") for o in overrides)
        else "tiny-h4b16k"
    )
    cfg = load_config(
        preset,
        overrides=[
            f"tokenizer.path={data['tokenizer']}",
            f"data.path={data['shards']}",
            "data.seq_len=64",
            "model.hash.num_buckets=256",
            "train.max_steps=4",
            "train.log_interval=2",
            "train.eval_interval=0",
            "train.global_batch_size=8",
            "train.micro_batch_size=2",
            "train.eval_sequences=8",
            *overrides,
        ],
    )
    loop = TrainingLoop(cfg, StopSignal())
    assert loop.setup(run_dir, "none")
    steps, step = [], loop.step

    def counting(name, call):
        def counted(*args, **kwargs):
            if steps:
                steps[-1][1][(name, _collective_site())] += 1
            return call(*args, **kwargs)

        return counted

    for name in COLLECTIVES:
        setattr(dist, name, counting(name, getattr(dist, name)))

    def counted_step(index):
        counter.calls = collections.Counter()
        steps.append((counter.calls, collections.Counter()))
        return step(index)

    loop.step = counted_step
    with SyncCounter() as counter:
        loop.run()
    return [(dict(syncs), dict(calls)) for syncs, calls in steps]


# losses, gradient norm and stop/save flags, in one transfer
OURS = {("tolist", "parallel/scalars.py:read"): 1}
DEEPSPEED_ZERO3 = {
    ("__bool__", "deepspeed/runtime/utils.py:is_invalid_grad_norm"): 1,
    ("tensor", "deepspeed/runtime/zero/stage3.py:get_grad_norm_direct"): 2,
}
HOST_ONLY = {  # host tensors only: token ids and row masks of the host-memory Engram tables
    ("unique", "model/host_tables.py:gather"): 4
    * 2,  # each micro-batch's rows of each of the 2 memories
    (
        "nonzero",
        "train/host_tables.py:before_step",
    ): 2,  # lazy update: the rows read, from each memory's mask
}


@pytest.mark.multirank
@pytest.mark.parametrize(
    "overrides",
    [
        [],
        [
            "model.engram.layers=[0,1]",
            "model.engram.table_size=1000",
            "model.engram.offload=true",
            "model.engram.offload_update=lazy",
        ],
        ["train.spike_factor=3", "train.grad_spike_factor=10", "train.on_spike=skip"],
        ["data.document_masking=true"],
    ],
    ids=["device-tables", "offload-lazy", "spike-skip", "document-masking"],
)
def test_an_ordinary_training_step_reads_the_device_once(tmp_path, data, overrides):
    """Under train.on_spike=skip too: the verdict stays on the device, read with the step's other numbers. A logged
    step's health metrics (train.health_metrics, on by default) add one all-reduce and no host read. Document
    masking adds one all-reduce to every step (the global batch's count of kept targets) and no host read."""
    steps = run_ranks(_loop_syncs, 1, tmp_path / "run", data, overrides)[0]
    assert len(steps) == 4
    expected = (
        OURS | DEEPSPEED_ZERO3 | (HOST_ONLY if "model.engram.offload=true" in overrides else {})
    )
    # steps 2 (logged) and 3: not the first
    (logged, logged_calls), (ordinary, ordinary_calls) = steps[1:3]
    # (DeepSpeed's first-step set-up) nor the last (evaluation and save)
    assert ordinary == logged == expected
    assert collections.Counter(logged_calls) - collections.Counter(ordinary_calls) == {
        ("all_reduce", "backend/deepspeed/health.py:summary"): 1
    }
    assert collections.Counter(ordinary_calls) <= collections.Counter(logged_calls)
    counted = ordinary_calls.get(("all_reduce", "backend/deepspeed/engine_trainer.py:loss_divisor"))
    assert counted == (1 if "data.document_masking=true" in overrides else None)
