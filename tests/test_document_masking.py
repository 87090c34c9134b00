"""``data.document_masking``: documents packed in one row do not see each other (mhf_dist/model/documents.py).

A row holding documents A, B and C (each ended by EOS) must give B's and C's tokens what B and C give when each is fed
alone from position 0 to the model that does not mask: attention, RoPE positions and the Engram memory's N-grams and
convolution all restart at a document start. The loss leaves out each EOS's prediction of the next document's first
token (``targets_of``), and a trainer divides its sums by the global batch's count (``divisor``; every layout's
trainer: tests/test_engine.py). Without masking, the model runs as it always has.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers.equivalence import INIT_STD, assert_tensor_close, step
from helpers.ranks import run_ranks
from mhf_dist.config import load_config
from mhf_dist.model import build_model
from mhf_dist.model.documents import document_mask, document_positions, targets_of
from mhf_dist.model.modes import ModelModes
from mhf_dist.parallel.groups import ParallelGroups
from mhf_dist.parallel.state_dict import merge_state_dicts
from mhf_dist.parallel.tensor_parallel import apply_tensor_parallel, tp_split_dims
from mhf_dist.vocab.engram_compression import CompressionTable
from mhf_dist.vocab.signatures import SignatureTable

V = 300
EOS = 2
TOLERANCE = 1e-5
# preset and overrides of each model: MultiHashFormer, Standard, and both with Engram memories on both layers (the
# sigmoid gate, whose short convolution reaches back (kernel 4 - 1)·dilation 3 = 9 positions, and the softmax gate)
MODELS = {
    "mhf": ("tiny-h4b16k", []),
    "standard": ("tiny-standard", []),
    "mhf+engram": (
        "tiny-h4b16k+engram",
        ["model.engram.layers=[0,1]", "model.engram.table_size=97"],
    ),
    "standard+engram-softmax": (
        "tiny-standard+engram",
        [
            "model.engram.layers=[0,1]",
            "model.engram.table_size=97",
            "model.engram.gate=softmax",
            "model.engram.hash=keyed",
        ],
    ),
}


def compression() -> CompressionTable:
    """A many-to-one table onto 200 compressed ids (EOS keeps its own), pad id 0."""
    gen = torch.Generator().manual_seed(2)
    old_to_new = torch.cat([torch.arange(200), torch.randint(0, 200, (V - 200,), generator=gen)])
    return CompressionTable(
        old_to_new=old_to_new.int(),
        keys=tuple(map(str, range(200))),
        pad_id=0,
        tokenizer_fingerprint="test",
    )


def make_models(name: str, tp: int = 1):
    """(the model without masking, the same weights masking documents ended by ``EOS``, config)."""
    preset, overrides = MODELS[name]
    cfg = load_config(
        preset,
        overrides=[
            "model.hash.num_buckets=64",
            f"model.init_std={INIT_STD}",  # weights large enough that other documents change the outputs
            f"parallel.tp={tp}",
            *overrides,
        ],
    ).model
    codes = None
    if cfg.variant == "mhf":
        codes = SignatureTable.build([f"tok{i}" for i in range(V)], 4, 64, pad_id=0).codes
    table = compression() if cfg.engram else None
    plain = build_model(cfg, V, codes, table, seed=3)
    masked = build_model(cfg, V, codes, table, seed=3, modes=ModelModes(document_eos=EOS))
    masked.load_state_dict(plain.state_dict())
    return plain, masked, cfg


def max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest ``|got - want|``; log P_inf is ``-inf`` at the same tokens in both (the pad token's)."""
    assert torch.equal(got.isinf(), want.isinf())
    finite = want.isfinite()
    return (got[finite] - want[finite]).abs().max().item()


def document(length: int, seed: int) -> torch.Tensor:
    """``length`` random tokens other than EOS, then EOS."""
    ids = torch.randint(EOS + 1, V, (length,), generator=torch.Generator().manual_seed(seed))
    return torch.cat([ids, torch.tensor([EOS])])


def packed_documents():
    """A, B and C packed in one row (C without its final EOS, cut off as a row's end cuts a document), and where B
    and C begin. B is shorter than the short convolution's reach, so its N-grams and taps all start inside A."""
    a, b, c = document(11, 0), document(6, 1), document(13, 2)[:-1]
    return torch.cat([a, b, c])[None], {"B": (len(a), b), "C": (len(a) + len(b), c)}


def test_document_positions_restart_after_each_eos():
    ids = torch.tensor([[5, 6, EOS, 7, EOS, EOS, 8, 9], [EOS, 5, 6, 7, 8, 9, 10, EOS]])
    assert document_positions(ids, EOS).tolist() == [
        [0, 1, 2, 0, 1, 0, 0, 1],
        [0, 0, 1, 2, 3, 4, 5, 6],
    ]
    mask = document_mask(document_positions(ids, EOS))
    assert mask.shape == (2, 1, 8, 8)
    # each query sees its document up to itself; row 0: documents 0-2, 3-4, 5, 6-7; row 1: 0, 1-7
    seen = [[[u for u in range(8) if mask[b, 0, t, u]] for t in range(8)] for b in range(2)]
    assert seen[0] == [[0], [0, 1], [0, 1, 2], [3], [3, 4], [5], [6], [6, 7]]
    assert seen[1] == [[0]] + [list(range(1, t + 1)) for t in range(1, 8)]


@pytest.mark.parametrize("name", list(MODELS))
def test_each_packed_document_scores_as_if_alone(name):
    """B's and C's log P_inf (every token's, so the logits up to a constant) in the packed row equal those of B and C
    fed alone to the model that does not mask; the same model without masking differs there."""
    plain, masked, _ = make_models(name)
    row, docs = packed_documents()
    with torch.no_grad():
        packed = masked.log_p_inf(row)[0]
        unmasked = plain.log_p_inf(row)[0]
        for doc, (start, ids) in docs.items():
            alone = plain.log_p_inf(ids[None])[0]
            got = packed[start : start + len(ids)]
            err = max_error(got, alone)
            assert err <= TOLERANCE, (name, doc, err)
            leak = max_error(unmasked[start : start + len(ids)], alone)
            assert leak > 1e-3, (name, doc, leak)
        # A, the first document, sees nothing before it either way
        a = packed[: docs["B"][0]]
        assert max_error(a, unmasked[: docs["B"][0]]) <= TOLERANCE


@pytest.mark.parametrize("name", ["mhf", "mhf+engram"])
def test_training_loss_and_gradients_see_each_document_alone(name):
    """The training loss over the packed row is the token-weighted mean of the documents' losses alone, and so are
    its gradients (the backward pass through the mask, the positions and the memory's convolution)."""
    plain, masked, _ = make_models(name)
    row, docs = packed_documents()
    targets = torch.cat(
        [row[:, 1:], torch.full((1, 1), -100)], dim=1
    )  # the last token predicts nothing
    masked(row, targets).loss.backward()
    starts = [0, docs["B"][0], docs["C"][0], row.shape[1]]
    for lo, hi in zip(
        starts, starts[1:]
    ):  # each document alone, its tokens predicting what follows in the row
        weight = (targets[:, lo:hi] >= 0).sum().item() / (targets >= 0).sum().item()
        (plain(row[:, lo:hi], targets[:, lo:hi]).loss * weight).backward()
    # 1e-4: fp32 sums in another order, which the sigmoid gate's sqrt(|g|) (steep near g = 0) amplifies in its
    # memory's gradients to 5e-5 of their largest entry; a document that saw another would be off by 1e-3 or more
    for (n, p), q in zip(masked.named_parameters(), plain.parameters()):
        assert_tensor_close(p.grad, q.grad, f"{name} grad {n}", rel=1e-4)


def test_targets_leave_out_what_an_eos_predicts():
    batch = torch.tensor([[5, 6, EOS, 7, EOS, EOS, 8, 9], [EOS, 5, 6, 7, 8, 9, 10, EOS]])
    assert targets_of(batch, EOS).tolist() == [
        [6, EOS, -1, EOS, -1, -1, 9],
        [-1, 6, 7, 8, 9, 10, EOS],  # the row's last EOS is a target, and so counted
    ]
    plain = targets_of(batch, None)  # without masking: the next tokens themselves
    assert plain.data_ptr() == batch[:, 1:].data_ptr() and torch.equal(plain, batch[:, 1:])


@pytest.mark.parametrize("name", ["standard", "mhf+engram"])
def test_the_loss_leaves_out_the_targets_of_eos_inputs(name):
    """The loss of a packed row is the mean over the positions whose input is not EOS of the heads' NLLs summed,
    by hand: for the Standard model ``-log P_inf(target)`` itself (its one head's softmax), for MultiHashFormer each
    head's NLL from the decoder; EOS positions are no part of it, in value or in gradient."""
    _, masked, _ = make_models(name)
    row, _ = packed_documents()
    batch = torch.cat([row, row.flip(1)])  # two rows with their EOS at other positions
    inputs, targets = batch[:, :-1], targets_of(batch, EOS)
    keep = inputs != EOS
    assert keep.sum() < keep.numel() - 2  # the row ends its first two documents
    out = masked(inputs, targets)
    with torch.no_grad():
        if name == "standard":
            logp = masked.log_p_inf(inputs)
            nll = -logp.gather(-1, batch[:, 1:, None])  # [B, S, 1]
        else:
            vocab, h = masked.vocab, masked.hidden(inputs).flatten(0, 1)
            codes = vocab.codes[batch[:, 1:].flatten()]
            nll = vocab.decoder.nll_and_log_probs(h, vocab.tables, codes)[0].view(*keep.shape, -1)
    want = nll[keep].mean(0)
    assert_tensor_close(out.head_losses.detach(), want, f"{name} head losses", rel=1e-6, floor=0)
    everything = nll.flatten(0, 1).mean(0)  # every position counted, EOS ones too
    assert (everything - want).abs().max() > 1e-3 * want.abs().max()
    # the gradient: the EOS positions' hidden states receive none
    h = masked.hidden(inputs).detach().requires_grad_()
    masked.vocab.loss(h, targets).loss.backward()
    assert torch.equal(h.grad[~keep], torch.zeros_like(h.grad[~keep]))
    assert h.grad[keep].abs().amax(-1).min() > 0


def test_a_divisor_divides_the_sums_in_fp32_whatever_the_loss_dtype():
    """``divisor``: a trainer's share of the global batch's count. The heads' sums over the kept tokens divided by
    it: the count itself gives the mean, bit for bit, in fp32 and in bf16, and twice the count half of it (halving
    is exact); in bf16 the sums are divided in fp32 and rounded once."""
    _, model, _ = make_models("mhf")
    row, _ = packed_documents()
    inputs, targets = row[:, :-1], targets_of(row, EOS)
    count = (targets >= 0).sum()
    for dtype in (torch.float32, torch.bfloat16):
        model = model.to(dtype)
        with torch.no_grad():
            mean = model(inputs, targets, z_loss_weight=1e-3)
            same = model(inputs, targets, z_loss_weight=1e-3, divisor=count.double())
            half = model(inputs, targets, z_loss_weight=1e-3, divisor=2 * count.double())
        for field in ("loss", "head_losses", "z_loss"):
            a, b, c = getattr(mean, field), getattr(same, field), getattr(half, field)
            assert torch.equal(a, b) and torch.equal(a / 2, c), (dtype, field, a, b, c)


@pytest.mark.parametrize("name", ["mhf", "mhf+engram"])
def test_without_masking_the_model_runs_as_before(name, monkeypatch):
    """Masking off: causal attention over the whole row (``is_causal``, no mask) at positions 0..S-1, as always; the
    masked model agrees with it on a row without EOS, and differs on one with EOS."""
    plain, masked, _ = make_models(name)
    calls = []
    sdpa = F.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, is_causal=False, **kwargs):
        calls.append((attn_mask is None, is_causal))
        return sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    one = torch.randint(EOS + 1, V, (2, 17), generator=torch.Generator().manual_seed(4))
    row, _ = packed_documents()
    with torch.no_grad():
        h = plain.hidden(one)
        assert calls == [(True, True)] * 2
        calls.clear()
        assert (masked.hidden(one) - h).abs().max().item() <= TOLERANCE
        assert calls == [(False, False)] * 2
        assert (masked.hidden(row) - plain.hidden(row)).abs().max().item() > 1e-3
    # the RoPE tables the blocks receive without masking: those of 0..S-1, [S, head_dim]
    inputs = plain.backbone.block_inputs(h, one)
    assert inputs.positions is None and inputs.mask is None and inputs.cos.shape == (17, 16)


def tp_worker(rank, world, names):
    groups = ParallelGroups.create(tp=world)
    row, _ = packed_documents()
    batch = torch.cat([row, row.flip(1)])  # two rows whose documents start at different positions
    results = {}
    for name in names:
        _, model, _ = make_models(name, tp=world)
        apply_tensor_parallel(model, groups.tp_group, groups.tp_rank, groups.tp)
        results[name] = step(model, batch)
    return results


@pytest.mark.multirank
def test_tensor_parallel_masks_documents_as_one_process():
    names = ["mhf+engram", "standard"]
    ranks = run_ranks(tp_worker, 2, names)
    row, _ = packed_documents()
    batch = torch.cat([row, row.flip(1)])
    for name in names:
        _, model, cfg = make_models(name, tp=2)
        ref = step(model, batch)
        for r in ranks:
            assert_tensor_close(r[name]["loss"], ref["loss"], f"{name} loss")
            assert max_error(r[name]["logp"], ref["logp"]) <= TOLERANCE, name
        grads = merge_state_dicts([r[name]["grads"] for r in ranks], tp_split_dims(cfg, 2))
        for key, g in ref["grads"].items():
            assert_tensor_close(grads[key], g, f"{name} grad {key}")


def test_offloaded_memory_prefetches_the_rows_the_masked_forward_reads():
    """``model.engram.offload``: the trainer gathers a micro-batch's rows before its forward (``prefetch``, on the
    host), and the lookup then reads those rows by position, so the prefetch must mask the N-grams as the forward does:
    the offloaded memory gives what the dense one gives."""
    cfg = load_config(
        "tiny-standard+engram",
        overrides=["model.engram.table_size=97", "model.engram.layers=[0,1]"],
    ).model
    modes = ModelModes(document_eos=EOS)
    dense = build_model(cfg, V, compression=compression(), seed=3, modes=modes)
    offload = cfg.model_copy(update={"engram": cfg.engram.model_copy(update={"offload": True})})
    host = build_model(offload, V, compression=compression(), seed=3, modes=modes)
    host.load_state_dict(dense.state_dict())
    row, _ = packed_documents()
    for layer in host.backbone.layers:
        layer.engram.prefetch(row)
        layer.engram.tables.advance()
    with torch.no_grad():
        assert (host.hidden(row) - dense.hidden(row)).abs().max().item() <= TOLERANCE
