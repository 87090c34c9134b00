"""The optional training term ``λ × mean(-log P_inf(target))`` (``model.hash.p_inf_loss_weight``): off it changes
nothing; on, its value and gradients equal a brute-force ``[N, V]`` log-softmax under autograd. (Tensor parallel
equivalence with the term: tests/test_tensor_parallel.py; the pipeline engine: tests/test_engine.py.)"""

from __future__ import annotations

import pytest
import torch

from helpers.equivalence import (
    INIT_STD,
    assert_tensor_close,
    batch_with_ignored_targets,
    loss_and_grads,
)
from mhf_dist.config import ConfigError, load_config
from mhf_dist.model import build_model
from mhf_dist.model.scoring import log_normaliser, side_by_side, signature_columns, signature_scores
from mhf_dist.model.tables import BucketTables
from mhf_dist.vocab.signatures import SignatureTable

V = 300
CHUNK = 4 * 7  # values per position: 7 tokens per chunk, which does not divide V


def make_model(weight: float, chunk_tokens: int = 0):
    cfg = load_config(
        "tiny-h4b16k",
        overrides=[
            "model.hash.num_buckets=64",
            f"model.init_std={INIT_STD}",
            f"model.decoder_chunk_tokens={chunk_tokens}",
            f"model.hash.p_inf_loss_weight={weight}",
        ],
    ).model
    table = SignatureTable.build([f"tok{i}" for i in range(V)], 4, 64, pad_id=0)
    torch.manual_seed(0)
    model = build_model(cfg, V, table.codes)
    model.vocab.p_inf_loss_chunk = CHUNK
    return model


def batch():
    return batch_with_ignored_targets(V)


def reference_loss(model, weight: float) -> torch.Tensor:
    """Σ_i mean head NLL (the plain decoder) + λ · mean -log P_inf(target), the latter from the full ``[N, V]``
    log-softmax of the signature scores, every step under autograd."""
    x, y = batch()
    keep = y >= 0
    h, t = model.hidden(x)[keep], y[keep]
    vocab = model.vocab
    head_loss = vocab.decoder.nll(h, vocab.tables, vocab.codes[t]).mean(0).sum()
    scores = signature_scores(
        side_by_side(vocab.decoder.scores(h, vocab.tables)),
        vocab.signature_columns(),
        vocab.registered,
        vocab.tables,
    )
    return head_loss + weight * -scores.log_softmax(-1).gather(1, t[:, None]).mean()


@pytest.mark.parametrize("chunk_tokens", [0, 5])
def test_weight_zero_leaves_loss_and_gradients_bit_identical(chunk_tokens):
    # one thread: CPU kernels split their sums over threads in an order that need not match between the two calls
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _weight_zero_is_bit_identical(chunk_tokens)
    finally:
        torch.set_num_threads(threads)


def _weight_zero_is_bit_identical(chunk_tokens):
    model = make_model(0.0, chunk_tokens)
    x, y = batch()

    def today(
        m,
    ):  # the training loss as it is without the term: the decoder's head NLLs, nothing else
        keep = y >= 0
        h = m.hidden(x)[keep]
        return m.vocab.decoder.nll(h, m.vocab.tables, m.vocab.codes[y[keep]]).mean(0).sum()

    out = model(x, y)
    assert out.p_inf_nll is None
    loss, grads = loss_and_grads(model, lambda m: m(x, y).loss)
    ref_loss, ref_grads = loss_and_grads(model, today)
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    assert all(torch.equal(grads[k], ref_grads[k]) for k in grads)


@pytest.mark.parametrize("chunk_tokens", [0, 5])
def test_term_matches_brute_force_log_softmax(chunk_tokens):
    weight = 0.7
    model = make_model(weight, chunk_tokens)
    x, y = batch()
    out = model(x, y)
    loss, grads = loss_and_grads(model, lambda m: m(x, y).loss)
    ref_loss, ref_grads = loss_and_grads(model, lambda m: reference_loss(m, weight))
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    assert grads.keys() == ref_grads.keys()
    for key, g in ref_grads.items():
        assert_tensor_close(grads[key], g, f"grad {key}")
    # the logged term is the evaluation's mean -log P_inf of the same targets
    with torch.no_grad():
        evaluated = make_model(0.0).evaluation(x, y)
    torch.testing.assert_close(out.p_inf_nll, evaluated.p_inf_nll, rtol=1e-6, atol=0)
    torch.testing.assert_close(
        out.loss, out.head_losses.sum() + weight * out.p_inf_nll, rtol=1e-6, atol=0
    )
    # the term's gradient is real: the weight changes the decoder's and backbone's gradients
    _, plain = loss_and_grads(model, lambda m: reference_loss(m, 0.0))
    assert (grads["vocab.tables.weight"] - plain["vocab.tables.weight"]).abs().max() > 1e-3


@pytest.mark.parametrize("chunk_size", [4, CHUNK, 4 * V])
def test_log_normaliser_matches_autograd_over_the_full_vocabulary(chunk_size):
    """Value and gradient of ``log Z`` against ``logsumexp`` of the ``[N, V]`` scores, with chunks of 1, 7 and all
    tokens, unregistered tokens and a non-uniform upstream gradient."""
    gen = torch.Generator().manual_seed(2)
    heads, rows, n = 4, 16, 6
    codes = torch.randint(1, rows, (V, heads), generator=gen)
    codes[[0, 17]] = 0  # two unregistered tokens (all-zero signatures)
    registered = (codes != 0).any(dim=1)
    tables = BucketTables(heads, rows, 2)
    columns = signature_columns(codes, tables)
    scores = [(3 * torch.randn(n, rows, generator=gen)).requires_grad_() for _ in range(heads)]
    upstream = torch.rand(n, generator=gen) + 0.5
    got = log_normaliser(scores, columns, registered, tables, chunk_size)
    got_grads = torch.autograd.grad((got * upstream).sum(), scores)
    ref = signature_scores(side_by_side(scores), columns, registered, tables).logsumexp(-1)
    ref_grads = torch.autograd.grad((ref * upstream).sum(), scores)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    for g, r in zip(got_grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7)
    # deterministic: a second use gives the same gradients bit for bit
    again = torch.autograd.grad(
        (log_normaliser(scores, columns, registered, tables, chunk_size) * upstream).sum(), scores
    )
    assert all(torch.equal(a, b) for a, b in zip(again, got_grads))


def test_an_unregistered_target_is_infinitely_unlikely():
    model = make_model(0.5)
    x, y = batch()
    y[0, 0] = 0  # the pad token: no P_inf mass, as evaluation scores it
    assert model(x, y).p_inf_nll == float("inf")


def test_weight_is_validated():
    assert load_config("tiny-h4b16k").model.hash.p_inf_loss_weight == 0.0
    for value, message in [("-0.1", "greater than or equal to 0"), (".nan", "finite number")]:
        with pytest.raises(ConfigError, match=message):
            load_config("tiny-h4b16k", overrides=[f"model.hash.p_inf_loss_weight={value}"])
    with pytest.raises(ConfigError, match="p_inf_loss_weight=0.1 with model.variant=standard"):
        load_config("tiny-standard", overrides=["model.hash.p_inf_loss_weight=0.1"])
