"""Benchmark: the data-parallel reductions of host-memory Engram tables (model.engram.offload, dp > 1).

Usage: python tools/bench_host_reductions.py [--rows 525312] [--dim 96] [--read 0.01 0.2] [--repeats 5] [--ranks 2]
On local gloo ranks (CPU), with one memory's tables of ``--rows`` rows (default: 100m-h4b16k+engram's 8 × 65,664) of
width ``--dim``, each rank reads a random ``--read`` share of the rows, and each reduction is timed two ways, the way
the trainer did it before and the way it does it now (the results must agree):

- the row mask's union (lazy update): the bool mask as fp32 averaged with ``ScalarCollectives.mean_into`` then
  ``> 0``, against ``ScalarCollectives.max_into`` on its bytes (uint8 MAX);
- the gradient's average (dense update): the whole ``[rows, dim]`` fp32 gradient all-reduced, against the mask's
  union (uint8 MAX) and then only the union's rows (``index_select``, all-reduce, ``index_copy_``).

Times are medians over ``--repeats`` of the slowest rank. On a GPU these reductions go through NCCL and pinned staging
buffers, which this tool does not reach.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mhf_dist.parallel.scalars import ScalarCollectives
from mhf_dist.train.host_tables import ALL_REDUCE_ROWS


def mask_fp32_mean(s, mask, grad, chunk):
    flags = mask.float()
    s.mean_into(flags, chunk=chunk)
    torch.gt(flags, 0, out=mask)
    return mask


def mask_uint8_max(s, mask, grad, chunk):
    s.max_into(mask, chunk=chunk)
    return mask


def grad_whole(s, mask, grad, chunk):
    s.mean_into(grad, chunk=chunk)
    return grad


def grad_union_rows(s, mask, grad, chunk):
    s.max_into(mask, chunk=chunk)
    rows = mask.nonzero().squeeze(1)
    selected = grad.index_select(0, rows)
    s.mean_into(selected, chunk=chunk)
    grad.index_copy_(0, rows, selected)
    return grad


CASES = {
    "row mask": (("fp32 mean", mask_fp32_mean), ("uint8 max", mask_uint8_max)),
    "gradient": (("whole table", grad_whole), ("union's rows", grad_union_rows)),
}


def worker(rank, world, init, args, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    s, chunk, times = ScalarCollectives(), ALL_REDUCE_ROWS * args.dim, {}
    for share in args.read:
        gen = torch.Generator().manual_seed(rank)
        marks = torch.rand(args.rows, generator=gen) < share
        # rows not read: no gradient
        grads = torch.randn(args.rows, args.dim, generator=gen) * marks[:, None]
        for case, ways in CASES.items():
            results = []
            for name, reduce in ways:
                samples = []
                for _ in range(args.repeats):
                    mask, grad = marks.clone(), grads.clone()
                    dist.barrier()
                    began = time.perf_counter()
                    result = reduce(s, mask, grad, chunk)
                    samples.append(time.perf_counter() - began)
                slowest = torch.tensor(samples)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                times[(share, case, name)] = statistics.median(slowest.tolist())
                results.append(result)
            assert torch.allclose(results[0], results[1], rtol=1e-6, atol=0), case
    if rank == 0:
        torch.save(times, out)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=8 * 65_664)
    parser.add_argument("--dim", type=int, default=96)
    parser.add_argument(
        "--read",
        type=float,
        nargs="+",
        default=[0.01, 0.2],
        help="share of the rows each rank reads",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.pt")
        mp.spawn(
            worker,
            args=(args.ranks, os.path.join(tmp, "init"), args, out),
            nprocs=args.ranks,
            join=True,
        )
        times = torch.load(out)
    print(
        f"{args.rows:,} rows × {args.dim}, {args.ranks} gloo ranks; median ms of the slowest rank"
    )
    print(f"{'read':>6}  {'reduction':<10}{'before':>26}{'now':>26}{'speed-up':>10}")
    for share in args.read:
        for case, ((before, _), (now, _)) in CASES.items():
            b, n = times[(share, case, before)], times[(share, case, now)]
            print(
                f"{share:>6.0%}  {case:<10}{f'{before} {b * 1e3:.1f}':>26}{f'{now} {n * 1e3:.1f}':>26}{b / n:>10.2f}"
            )


if __name__ == "__main__":
    main()
