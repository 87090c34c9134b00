"""Tensor parallelism (docs/spec.md §7) equals the single-process model: loss, every gradient, log P_inf.

Each case builds the same full model from the same seed on every rank, applies the
tensor-parallel plan, and compares against tp = 1 computed in the test process.
"""

from __future__ import annotations

import pytest
import torch

from helpers.equivalence import INIT_STD, assert_tensor_close, step
from helpers.ranks import run_ranks
from mhf_dist.config import load_config
from mhf_dist.model import build_model
from mhf_dist.parallel.accounting import expected_collective_bytes
from mhf_dist.parallel.groups import ParallelGroups
from mhf_dist.parallel.state_dict import merge_state_dicts, shard_state_dict
from mhf_dist.parallel.tensor_parallel import apply_tensor_parallel, tp_split_dims
from mhf_dist.vocab.signatures import SignatureTable

V = 300
# (preset, buckets per tp[, overrides]): H4, H3 with an odd number of buckets per shard, and H4 trained with the
# log P_inf term, its vocabulary in chunks of 7 tokens (P_INF_CHUNK values per position), which do not divide V
CASES = {
    "h4": ("tiny-h4b16k", {2: 64, 4: 64}),
    "h3-odd": ("tiny-h3b10k", {2: 66, 4: 68}),
    "standard": ("tiny-standard", {2: 64, 4: 64}),
    "h4-p-inf": ("tiny-h4b16k", {2: 64, 4: 64}, ["model.hash.p_inf_loss_weight=0.5"]),
}
P_INF_CHUNK = 4 * 7


CHUNKS = (0, 5)  # the plain decoder, and the fused one with chunks that do not divide the 16 tokens


def case_config(name: str, tp: int, chunk: int = 0):
    preset, buckets, *extra = CASES[name]
    return load_config(
        preset,
        overrides=[
            f"model.hash.num_buckets={buckets[tp]}",
            f"parallel.tp={tp}",
            f"model.decoder_chunk_tokens={chunk}",
            f"model.init_std={INIT_STD}",
            *(extra[0] if extra else []),
        ],
    ).model


def make_case(name: str, tp: int, chunk: int = 0):
    cfg = case_config(name, tp, chunk)
    table = SignatureTable.build(
        [f"tok{i}" for i in range(V)], cfg.hash.num_hashes, cfg.hash.num_buckets, pad_id=0
    )
    torch.manual_seed(0)
    model = build_model(cfg, V, table.codes)
    model.vocab.p_inf_loss_chunk = P_INF_CHUNK
    batch = torch.randint(1, V, (2, 9), generator=torch.Generator().manual_seed(1))
    return cfg, model, batch


def tp_worker(rank, world, names):
    groups = ParallelGroups.create(tp=world)
    results = {}
    for name in names:
        for chunk in CHUNKS:
            cfg, model, batch = make_case(name, world, chunk)
            apply_tensor_parallel(model, groups.tp_group, groups.tp_rank, groups.tp)
            results[name, chunk] = step(model, batch)
    return results


@pytest.mark.multirank
@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_equals_single_process(tp):
    ranks = run_ranks(tp_worker, tp, list(CASES))
    for name in CASES:
        cfg, model, batch = make_case(name, tp)  # the single-process plain path is the reference
        ref = step(model, batch)
        torch.testing.assert_close(ref["eval"][1], ref["eval"][0], rtol=1e-5, atol=1e-5)
        for chunk in CHUNKS:
            for r in ranks:
                got = r[name, chunk]
                torch.testing.assert_close(
                    got["loss"], ref["loss"], rtol=1e-5, atol=0, msg=f"{name} loss"
                )
                torch.testing.assert_close(got["heads"], ref["heads"], rtol=1e-5, atol=0)
                torch.testing.assert_close(
                    got["logp"], ref["logp"], rtol=1e-5, atol=1e-5, msg=f"{name} log P_inf"
                )
                for sums in got[
                    "eval"
                ]:  # P_inf NLL, top-1/top-5 hits, NLL and slope at every τ: as one process
                    torch.testing.assert_close(
                        sums, ref["eval"][0], rtol=1e-5, atol=1e-5, msg=f"{name} eval sums"
                    )
            grads = merge_state_dicts(
                [r[name, chunk]["grads"] for r in ranks], tp_split_dims(cfg, tp)
            )
            assert grads.keys() == ref["grads"].keys()
            for key, g in ref["grads"].items():
                assert_tensor_close(grads[key], g, f"{name} grad {key}")
            # measured collective payload equals the documented analytic count (of this decoder path)
            expected = expected_collective_bytes(
                case_config(name, tp, chunk), batch[:, 1:].numel(), tp, vocab_size=V
            )
            assert ranks[0][name, chunk]["bytes"] == dict(expected), (name, chunk)


@pytest.mark.parametrize("tp", [2, 4])
def test_state_dict_round_trip_is_exact(tp):
    cfg, model, _ = make_case("h4", tp)
    full = model.state_dict()
    dims = tp_split_dims(cfg, tp)
    shards = [shard_state_dict(full, dims, r, tp) for r in range(tp)]
    assert shards[1]["vocab.tables.weight"].shape == (4, 64 // tp, 64)
    merged = merge_state_dicts(shards, dims)
    assert all(torch.equal(merged[k], v) for k, v in full.items())
    again = [shard_state_dict(merged, dims, r, tp) for r in range(tp)]
    assert all(torch.equal(a[k], b[k]) for a, b in zip(shards, again) for k in a)
    # a checkpoint saved at tp=2 loads at tp=4: merge, then re-shard
    to4 = [
        shard_state_dict(
            merge_state_dicts(
                [shard_state_dict(full, tp_split_dims(cfg, 2), r, 2) for r in range(2)],
                tp_split_dims(cfg, 2),
            ),
            tp_split_dims(cfg, 4),
            r,
            4,
        )
        for r in range(4)
    ]
    assert all(
        torch.equal(a[k], b[k])
        for a, b in zip(
            to4, [shard_state_dict(full, tp_split_dims(cfg, 4), r, 4) for r in range(4)]
        )
        for k in a
    )
