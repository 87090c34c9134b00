"""The run's bookkeeping collectives: right values on every rank, built on the communication device only.

On GPUs the process group is NCCL, which refuses host tensors; gloo (these tests) accepts both. So the values
are checked on real ranks here, and the rule that keeps host tensors out of collectives is checked on the source.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from helpers.ranks import run_ranks
from mhf_dist.parallel import scalars
from mhf_dist.parallel.scalars import ScalarCollectives, communication_device

PACKAGE = Path(scalars.__file__).resolve().parents[1]
TENSOR_COLLECTIVES = {
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "gather",
    "scatter",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
}
# the model's tensor-parallel collectives (on activations and gradients, already on the device), the helper, and the
# sharded host tables' exchange (host tensors on a gloo group of their own)
ALLOWED = {"parallel/comm.py", "parallel/scalars.py", "parallel/sharded_host_tables.py"}


def _calls(tree: ast.AST):
    return (
        n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
    )


def test_only_the_helper_and_the_model_layers_call_tensor_collectives():
    callers = set()
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for call in _calls(tree):
            if (
                call.func.attr in TENSOR_COLLECTIVES
                and getattr(call.func.value, "id", None) == "dist"
            ):
                callers.add(str(path.relative_to(PACKAGE)))
    assert callers == ALLOWED


def test_the_helper_builds_every_tensor_on_its_device():
    """Every tensor the helper makes is on its communication device, except host staging buffers (the ones with a
    ``pin_memory`` argument: pinned on CUDA, so their copies to the device need not block the host); every move goes to
    the communication device."""
    tree = ast.parse(Path(scalars.__file__).read_text())
    factories = [
        c
        for c in _calls(tree)
        if getattr(c.func.value, "id", None) == "torch"
        and c.func.attr in {"tensor", "zeros", "ones", "full", "empty", "as_tensor", "arange"}
    ]
    staging = [c for c in factories if any(k.arg == "pin_memory" for k in c.keywords)]
    moves = [c for c in _calls(tree) if c.func.attr == "to"]
    assert factories and staging and moves
    for call in [c for c in factories if c not in staging] + moves:
        where = [k.value for k in call.keywords if k.arg == "device"] + call.args[:1] * (
            call.func.attr == "to"
        )
        assert where and ast.unparse(where[0]) == "self.device", ast.unparse(call)
    for call in staging:
        assert not any(k.arg == "device" for k in call.keywords), ast.unparse(call)


@pytest.mark.parametrize(
    "backend, device", [("nccl", "cuda:3"), ("cpu:gloo,cuda:nccl", "cuda:3"), ("gloo", "cpu")]
)
def test_communication_device_follows_the_backend(monkeypatch, backend, device):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert communication_device(backend) == torch.device(device)


def _reductions(rank, world):
    s = ScalarCollectives()
    pair = dist.new_group([0, 1])
    return {
        "device": s.device,
        "any": s.any(rank == 2, False),
        "from_rank0": s.from_rank0(10.0 + rank),
        "sum": s.sum(torch.tensor([rank, 1.0], dtype=torch.float32)),
        "mean_all": s.mean([float(rank)]),
        "mean_pair": s.mean(torch.tensor([2.0 * rank]), pair) if rank < 2 else None,
        # one transfer for several results left on the device
        "read": s.read(
            s.mean_tensor(torch.tensor([float(rank), 3.0])),
            s.any_tensor(rank == 1, False),
            s.sum_tensor([1.0]),
        ),
        **_host_buffers(s, rank),
    }


def _host_buffers(s: ScalarCollectives, rank: int) -> dict:
    """Host buffers reduced in place, in chunks (here of 2 and 3 elements) that do not divide their length."""
    rows = torch.arange(7)
    mask = rows % 4 == rank  # rank r marks rows r and r + 4; no rank marks row 3
    s.max_into(mask, chunk=2)
    flags = torch.tensor([0, rank, 2 * rank, 1, 0], dtype=torch.uint8)
    s.max_into(flags, chunk=2)
    # rows of a gradient, as the host tables'
    grads = torch.arange(10, dtype=torch.float32).view(5, 2) * (rank + 1)
    s.mean_into(grads, chunk=3)
    return {"mask": mask, "flags": flags, "grads": grads}


@pytest.mark.multirank
def test_reductions_agree_on_every_rank():
    results = run_ranks(_reductions, 3)
    for rank, r in enumerate(results):
        assert r["device"] == torch.device("cpu")  # gloo
        assert r["any"] == [True, False]
        assert r["from_rank0"] == 10.0
        assert r["sum"] == [3.0, 3.0]
        assert r["mean_all"] == [1.0]
        if rank < 2:
            assert r["mean_pair"] == [1.0]
        assert r["read"] == [1.0, 3.0, 1.0, 0.0, 3.0]
        assert r["mask"].dtype == torch.bool and r["mask"].tolist() == [
            True,
            True,
            True,
            False,
            True,
            True,
            True,
        ]
        assert r["flags"].tolist() == [0, 2, 4, 1, 0]
        # mean of ×1, ×2, ×3
        assert torch.equal(r["grads"], torch.arange(10, dtype=torch.float32).view(5, 2) * 2)
