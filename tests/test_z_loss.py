"""The z-loss (``train.z_loss_weight``, docs/spec.md §5): off it changes nothing; on, the plain decoder's loss and
gradients equal autograd of ``Σ_i mean NLL_i + w · Σ_i mean (log Z_i)²`` over the raw logits, the fused heads equal the
plain ones, tensor parallel equals one process with no more communication, and ``status`` shows the logged term. (The
engines, tp=2 and pp=2 against one process: tests/test_engine.py.)"""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from helpers.equivalence import (
    INIT_STD,
    assert_tensor_close,
    batch_with_ignored_targets,
    loss_and_grads,
)
from helpers.ranks import run_ranks
from mhf_dist.cli import main
from mhf_dist.config import ConfigError, load_config
from mhf_dist.model import build_model
from mhf_dist.parallel.accounting import expected_collective_bytes
from mhf_dist.parallel.comm import count_collectives
from mhf_dist.parallel.groups import ParallelGroups
from mhf_dist.parallel.state_dict import merge_state_dicts
from mhf_dist.parallel.tensor_parallel import apply_tensor_parallel, tp_split_dims
from mhf_dist.storage.run_dir import RunDir
from mhf_dist.train.resume import resume_config
from mhf_dist.vocab.signatures import SignatureTable

V = 300
WEIGHT = 0.1  # far above a training run's 1e-4, so that the term's gradient is not lost under the tolerance
# preset and overrides: H4; the Standard head, whose 84 padding rows are masked out of log Z; H4 with the log P_inf term
CASES = {
    "h4": ("tiny-h4b16k", []),
    "standard": ("tiny-standard", []),
    "h4-p-inf": ("tiny-h4b16k", ["model.hash.p_inf_loss_weight=0.5"]),
}


def model_config(name: str, chunk_tokens: int = 0, tp: int = 1):
    preset, extra = CASES[name]
    return load_config(
        preset,
        overrides=[
            "model.hash.num_buckets=64",
            f"model.init_std={INIT_STD}",
            f"model.decoder_chunk_tokens={chunk_tokens}",
            f"parallel.tp={tp}",
            *extra,
        ],
    ).model


def make_model(name: str, chunk_tokens: int = 0, tp: int = 1):
    cfg = model_config(name, chunk_tokens, tp)
    table = SignatureTable.build(
        [f"tok{i}" for i in range(V)], cfg.hash.num_hashes, cfg.hash.num_buckets, pad_id=0
    )
    torch.manual_seed(0)
    model = build_model(cfg, V, table.codes)
    model.vocab.p_inf_loss_chunk = 4 * 7  # vocabulary chunks of 7 tokens, which do not divide V
    return model


def batch():
    return batch_with_ignored_targets(V)


def head_logits(model):
    """Each head's raw logits ``o_i [N, R]`` at the kept positions and their targets' rows ``[N, H]``."""
    x, y = batch()
    keep = y >= 0
    h, t = model.hidden(x)[keep], y[keep]
    return model.vocab.decoder.scores(h, model.vocab.tables), model.vocab.codes[t]


def z_term(model, weight: float) -> torch.Tensor:
    """``weight · Σ_i mean (logsumexp o_i)²`` over the kept positions."""
    logits, _ = head_logits(model)
    return weight * sum(o.logsumexp(-1).square().mean() for o in logits)


def formula(model, weight: float) -> torch.Tensor:
    """``Σ_i mean (log Z_i − o_i[target_i]) + weight · Σ_i mean (log Z_i)²``, ``log Z_i = logsumexp o_i``, every
    step under autograd."""
    logits, rows = head_logits(model)
    nll = sum(
        (o.logsumexp(-1) - o.gather(1, rows[:, i, None]).squeeze(1)).mean()
        for i, o in enumerate(logits)
    )
    return nll + z_term(model, weight)


def one_thread(fn):
    """CPU kernels split their sums over threads in an order that need not match between two calls."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("chunk_tokens", [0, 5])
@pytest.mark.parametrize("name", list(CASES))
def test_weight_zero_leaves_loss_and_gradients_bit_identical(name, chunk_tokens):
    def check():
        model = make_model(name, chunk_tokens)
        x, y = batch()
        off = model(x, y, z_loss_weight=0.0)
        assert off.z_loss is None and off.logged_loss.equal(off.loss)
        loss, grads = loss_and_grads(model, lambda m: m(x, y, z_loss_weight=0.0).loss)
        ref_loss, ref_grads = loss_and_grads(model, lambda m: m(x, y).loss)
        assert torch.equal(loss, ref_loss) and loss.dtype == ref_loss.dtype
        assert grads.keys() == ref_grads.keys()
        assert all(torch.equal(grads[k], ref_grads[k]) for k in grads)

    one_thread(check)


@pytest.mark.parametrize("name", ["h4", "standard"])
def test_plain_gradient_equals_autograd_of_the_formula(name):
    model = make_model(name)
    x, y = batch()
    out = model(x, y, z_loss_weight=WEIGHT)
    loss, grads = loss_and_grads(model, lambda m: m(x, y, z_loss_weight=WEIGHT).loss)
    ref_loss, ref_grads = loss_and_grads(model, lambda m: formula(m, WEIGHT))
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    assert grads.keys() == ref_grads.keys()
    for key, g in ref_grads.items():
        assert_tensor_close(grads[key], g, f"grad {key}", rel=1e-6)
    # the logged numbers: the term apart, and a loss that leaves it out (the cross-entropy)
    with torch.no_grad():
        term = z_term(model, WEIGHT)
    torch.testing.assert_close(out.z_loss, term, rtol=1e-6, atol=0)
    torch.testing.assert_close(out.logged_loss, out.head_losses.sum(), rtol=1e-6, atol=0)
    assert not out.z_loss.requires_grad and out.z_loss > 0
    # the term's gradient is real: it moves the tables' gradient well past the tolerance
    _, plain = loss_and_grads(model, lambda m: formula(m, 0.0))
    assert (grads["vocab.tables.weight"] - plain["vocab.tables.weight"]).abs().max() > 1e-3


def test_with_the_p_inf_term_it_adds_the_formula():
    """Beside ``model.hash.p_inf_loss_weight`` (tested against brute force in tests/test_p_inf_loss.py) the z-loss
    adds its formula's value and gradient, and the logged loss keeps the P_inf term."""
    model = make_model("h4-p-inf")
    x, y = batch()
    out = model(x, y, z_loss_weight=WEIGHT)
    loss, grads = loss_and_grads(model, lambda m: m(x, y, z_loss_weight=WEIGHT).loss)
    ref_loss, ref_grads = loss_and_grads(model, lambda m: m(x, y).loss + z_term(m, WEIGHT))
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    for key, g in ref_grads.items():
        assert_tensor_close(grads[key], g, f"grad {key}", rel=1e-6)
    torch.testing.assert_close(
        out.logged_loss, out.head_losses.sum() + 0.5 * out.p_inf_nll, rtol=1e-6, atol=0
    )


@pytest.mark.parametrize("name", list(CASES))
def test_fused_heads_equal_the_plain_heads(name):
    """Chunks of 5 tokens, which do not divide the 16, against the plain decoder; with the head entropies too."""
    x, y = batch()
    results = []
    for chunk_tokens in (0, 5):
        model = make_model(name, chunk_tokens)
        out = model(x, y, entropy=True, z_loss_weight=WEIGHT)
        results.append((out, loss_and_grads(model, lambda m: out.loss)[1]))
    (plain, plain_grads), (fused, fused_grads) = results
    for field in ("loss", "z_loss", "head_losses", "head_entropy", "logged_loss"):
        torch.testing.assert_close(
            getattr(fused, field), getattr(plain, field), rtol=1e-6, atol=0, msg=field
        )
    assert fused_grads.keys() == plain_grads.keys()
    for key, g in plain_grads.items():
        assert_tensor_close(fused_grads[key], g, f"grad {key}")


def tp_step(model, x, y):
    with count_collectives() as log:
        out = model(x, y, z_loss_weight=WEIGHT)
        out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return out.loss.detach(), out.z_loss, grads, dict(log.bytes)


def tp_worker(rank, world, names):
    groups = ParallelGroups.create(tp=world)
    results = {}
    for name in names:
        for chunk_tokens in (0, 5):
            model = make_model(name, chunk_tokens, world)
            apply_tensor_parallel(model, groups.tp_group, groups.tp_rank, groups.tp)
            results[name, chunk_tokens] = tp_step(model, *batch())
    return results


@pytest.mark.multirank
def test_tensor_parallel_equals_one_process_with_no_more_communication():
    """tp = 2, plain and fused: loss, z-loss and every gradient as one process; the collectives move exactly the
    bytes they move without the z-loss (each head's log Z is already reduced over the bucket shards)."""
    tp = 2
    ranks = run_ranks(tp_worker, tp, list(CASES))
    for name in CASES:
        loss, z_loss, ref_grads, _ = tp_step(make_model(name), *batch())
        for chunk_tokens in (0, 5):
            for got in ranks:
                got_loss, got_z, _, _ = got[name, chunk_tokens]
                torch.testing.assert_close(got_loss, loss, rtol=1e-5, atol=0, msg=name)
                torch.testing.assert_close(got_z, z_loss, rtol=1e-5, atol=0, msg=name)
            grads = merge_state_dicts(
                [r[name, chunk_tokens][2] for r in ranks], tp_split_dims(model_config(name), tp)
            )
            assert grads.keys() == ref_grads.keys()
            for key, g in ref_grads.items():
                assert_tensor_close(grads[key], g, f"{name} chunk {chunk_tokens} grad {key}")
            expected = expected_collective_bytes(
                model_config(name, chunk_tokens, tp), batch()[1].numel(), tp, vocab_size=V
            )
            assert ranks[0][name, chunk_tokens][3] == dict(expected), (name, chunk_tokens)


def test_setting_is_a_non_negative_finite_train_key():
    assert load_config("tiny-h4b16k").train.z_loss_weight == 0.0
    assert load_config("tiny-h4b16k", overrides=["train.z_loss_weight=1e-4"]).train.z_loss_weight
    for bad in ("-1e-4", "inf", "nan"):
        with pytest.raises(ConfigError, match="z_loss_weight"):
            load_config("tiny-h4b16k", overrides=[f"train.z_loss_weight={bad}"])


def test_status_shows_the_logged_z_loss(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(
        yaml.safe_dump(load_config("tiny-h4b16k").model_dump(mode="json"))
    )
    record = {"step": 3, "loss": 7.5, "head_losses": [3.5, 4.0], "z_loss": 0.0123, "lr": 1e-3}
    (run / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    assert main(["status", str(run)]) == 0
    assert "(heads 3.5000, 4.0000) (z-loss 0.0123)" in capsys.readouterr().out
    assert main(["status", str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["z_loss"] == 0.0123


def test_a_resume_may_turn_the_term_on_but_not_change_the_model(tmp_path):
    """A run whose logits drift turns the z-loss on at a checkpoint; the model's own settings stay fixed."""
    cfg = load_config("tiny-h4b16k")
    run = RunDir(tmp_path / "run")
    run.save_config(cfg)
    step = run.checkpoints_dir / "step-00000004"
    step.mkdir(parents=True)
    marker = {
        "step": 4,
        "tokens": 0,
        "reason": "interval",
        "files": {"weights": 1},
        "model": cfg.model.model_dump(mode="json"),
        "layout": {"tp": 1, "pp": 1, "dp": 1},
        "signatures_hash": None,
        "config": cfg.model_dump(mode="json"),
    }
    (step / "complete.json").write_text(json.dumps(marker))
    resumed = resume_config(run.path, ["train.z_loss_weight=1e-4"], "auto")
    assert resumed.train.z_loss_weight == 1e-4
    with pytest.raises(ConfigError, match="model.hash.p_inf_loss_weight"):
        resume_config(run.path, ["model.hash.p_inf_loss_weight=0.5"], "auto")
