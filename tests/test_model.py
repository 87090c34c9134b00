"""Model equations (docs/spec.md §2–§5) against loop-based references written from the specification."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from helpers.equivalence import INIT_STD, assert_tensor_close
from mhf_dist.config import load_config
from mhf_dist.model import MultiHashFormer, build_model
from mhf_dist.model.modes import ModelModes
from mhf_dist.model.tables import BucketTables, TableGradients
from mhf_dist.vocab.signatures import SignatureTable

V = 300


@pytest.fixture
def table():
    return SignatureTable.build(
        [f"tok{i}" for i in range(V)], num_hashes=4, num_buckets=64, pad_id=0
    )


@pytest.fixture
def model(tiny_cfg, table):
    m = build_model(tiny_cfg, V, table.codes).double()
    with torch.no_grad():  # non-trivial biases so the references check them too
        for name, p in m.named_parameters():
            if name.endswith("bias"):
                p.normal_(std=0.1)
    return m


def ref_encoder(m, codes_row):
    """e(w) = (Σ_i α_i u_i) W_s + b_s, α = softmax_i(σ(u_i W1 + b1) W2 + b2) — one token at a time."""
    E = m.vocab.tables.weight
    s0, s2, out = (
        m.vocab.encoder.scorer[0],
        m.vocab.encoder.scorer[2],
        m.vocab.encoder.output_proj[0],
    )
    u = [E[i, codes_row[i]] for i in range(len(codes_row))]
    a = torch.stack(
        [F.silu(ui @ s0.weight.T + s0.bias) @ s2.weight.T + s2.bias for ui in u]
    ).squeeze(-1)
    alpha = torch.softmax(a, dim=0)
    return sum(alpha[i] * u[i] for i in range(len(u))) @ out.weight.T + out.bias


def ref_decoder(m, h_t, target_row=None):
    """Cascade for one position: returns per-head log-prob vectors (and NLLs of target_row)."""
    E = m.vocab.tables.weight
    c, logps = h_t, []
    for i in range(E.shape[0]):
        o = E[i] @ c
        p = torch.softmax(o, dim=0)
        logps.append(torch.log(p))
        if i < E.shape[0] - 1:
            e_bar = E[i].T @ p
            dn, up = m.vocab.decoder.cascade_mixer[i][0], m.vocab.decoder.cascade_mixer[i][2]
            c = c + F.silu(torch.cat([c, e_bar]) @ dn.weight.T + dn.bias) @ up.weight.T + up.bias
    nll = (
        None
        if target_row is None
        else torch.stack([-logps[i][target_row[i]] for i in range(len(logps))])
    )
    return logps, nll


def test_encoder_matches_reference(model, table):
    ids = torch.tensor([[1, 5, 17, 0, 299]])
    got = model.vocab.embed(ids)
    for j, v in enumerate(ids[0].tolist()):
        torch.testing.assert_close(
            got[0, j], ref_encoder(model, table.codes[v].long()), rtol=1e-5, atol=1e-5
        )


def test_loss_matches_reference(model, table):
    torch.manual_seed(1)
    x = torch.randint(1, V, (2, 9))
    out = model(x[:, :-1], x[:, 1:])
    h = model.hidden(x[:, :-1])
    nlls = torch.stack(
        [
            ref_decoder(model, h[b, t], table.codes[x[b, t + 1]].long())[1]
            for b in range(2)
            for t in range(8)
        ]
    )
    torch.testing.assert_close(out.head_losses, nlls.mean(0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.loss, nlls.mean(0).sum(), rtol=1e-5, atol=1e-5)


def test_ignored_targets_do_not_count(model):
    x = torch.randint(1, V, (1, 9))
    y = x[:, 1:].clone()
    full = model(x[:, :-1], y)
    y[0, 4:] = -100
    part = model(x[:, :-1], y)
    h = model.hidden(x[:, :-1])[0, :4]
    ref = model.vocab.decoder.nll(h, model.vocab.tables, model.vocab.codes[x[0, 1:5]]).mean(0)
    torch.testing.assert_close(part.head_losses, ref)
    assert not torch.allclose(full.loss, part.loss)


def test_p_inf_matches_dense_reference(model, table):
    x = torch.randint(1, V, (1, 5))
    got = model.log_p_inf(x)[0]
    h = model.hidden(x)[0]
    for t in range(5):
        logps, _ = ref_decoder(model, h[t])
        scores = torch.stack(
            [
                sum(logps[i][table.codes[w, i]] for i in range(4))
                if w != 0
                else torch.tensor(-torch.inf)
                for w in range(V)
            ]
        )
        ref = scores - torch.logsumexp(scores, 0)
        torch.testing.assert_close(got[t], ref.to(got.dtype), rtol=1e-5, atol=1e-5)
    assert torch.allclose(got.exp().sum(-1), torch.ones(5, dtype=got.dtype))
    assert (got[:, 0] == -torch.inf).all()  # the pad row is never scored


def test_p_inf_chunked_equals_unchunked(model):
    x = torch.randint(1, V, (2, 6))
    torch.testing.assert_close(model.log_p_inf(x, chunk_size=7), model.log_p_inf(x), rtol=0, atol=0)
    torch.testing.assert_close(model.log_p_inf(x, last_only=True), model.log_p_inf(x)[:, -1])


class _DetachedRetrieval(BucketTables):
    def _retrieve(self, weight, probs, table):
        return probs @ weight[table].detach()


class _DetachedLookup(BucketTables):
    def _lookup(self, weight, rows):
        w = weight.detach()
        return w[torch.arange(w.shape[0]), rows]


@pytest.mark.parametrize("variant", [_DetachedRetrieval, _DetachedLookup])
def test_gradients_reach_tables_through_lookup_and_retrieval(model, variant):
    model.vocab.decoder.chunk_tokens = (
        0  # the plain path, whose retrieval the variant cuts (fused == plain below)
    )
    x = torch.randint(1, V, (2, 9))
    model(x[:, :-1], x[:, 1:]).loss.backward()
    full = model.vocab.tables.weight.grad.clone()
    model.zero_grad()
    model.vocab.tables.__class__ = variant  # same weights, one gradient path cut
    model(x[:, :-1], x[:, 1:]).loss.backward()
    cut = model.vocab.tables.weight.grad
    assert full.abs().sum() > 0
    assert (full - cut).abs().max() > 1e-6, f"{variant.__name__}: that path carries no gradient"


def test_standard_lm_is_tied_softmax_over_real_vocabulary():
    cfg = load_config("tiny-standard").model
    m = build_model(cfg, V).double()
    assert m.vocab.tables.weight.shape[1] == 384  # padded to a multiple of 128
    x = torch.randint(0, V, (2, 7))
    h = m.hidden(x[:, :-1])
    W = m.vocab.tables.weight[0, :V]
    torch.testing.assert_close(m.vocab.embed(x), W[x])
    logits = h @ W.T
    torch.testing.assert_close(
        m(x[:, :-1], x[:, 1:]).loss, F.cross_entropy(logits.reshape(-1, V), x[:, 1:].reshape(-1))
    )
    torch.testing.assert_close(m.log_p_inf(x[:, :-1]), logits.log_softmax(-1))


def test_build_model_dispatch(tiny_cfg, table):
    assert isinstance(build_model(tiny_cfg, V, table.codes), MultiHashFormer)
    with pytest.raises(ValueError, match="signature table"):
        build_model(tiny_cfg, V)


def test_target_p_inf_streams_over_the_vocabulary(model):
    x = torch.randint(1, V, (2, 9))
    out = model.evaluation(x[:, :-1], x[:, 1:])
    dense = model.log_p_inf(x[:, :-1]).gather(-1, x[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(out.p_inf_nll, -dense.mean())
    from mhf_dist.model.scoring import target_log_p_inf

    h = model.hidden(x[:, :-1]).reshape(-1, 64)
    scores = model.vocab.decoder.scores(h, model.vocab.tables)
    chunked = target_log_p_inf(
        scores,
        model.vocab.signature_columns(),
        model.vocab.registered,
        model.vocab.tables,
        x[:, 1:].reshape(-1),
        chunk_size=7,
    )
    torch.testing.assert_close(chunked, dense.reshape(-1))


@pytest.mark.parametrize(
    "preset, buckets", [("tiny-h4b16k", 64), ("tiny-h3b10k", 66), ("tiny-standard", 64)]
)
def test_fused_decoder_equals_plain(preset, buckets, kernels="auto", chunks=(5, 64)):
    """Loss, every gradient and log P_inf, with a chunk that does not divide the token count, and with one chunk
    (where a head that retrieves nothing keeps its logits for backward); the fused heads' passes run as ``kernels``
    says (ModelModes.kernels). ``chunks``: the fused models built, each compared with the plain one (0)."""
    results = {}
    for chunk in (0, *chunks):
        cfg = load_config(
            preset,
            overrides=[
                f"model.hash.num_buckets={buckets}",
                f"model.decoder_chunk_tokens={chunk}",
                f"model.init_std={INIT_STD}",
            ],
        ).model
        table = SignatureTable.build(
            [f"tok{i}" for i in range(V)], cfg.hash.num_hashes, buckets, pad_id=0
        )
        torch.manual_seed(0)
        m = build_model(cfg, V, table.codes, modes=ModelModes(kernels=kernels))
        # 16 targets, chunk 5
        x = torch.randint(1, V, (2, 9), generator=torch.Generator().manual_seed(3))
        out = m(x[:, :-1], x[:, 1:])
        out.loss.backward()
        results[chunk] = (
            out.loss,
            out.head_losses,
            {n: p.grad for n, p in m.named_parameters()},
            m.log_p_inf(x[:, :-1]),
        )
    loss0, heads0, grads0, logp0 = results[0]
    for chunk in chunks:
        loss, heads, grads, logp = results[chunk]
        torch.testing.assert_close(loss, loss0, rtol=1e-5, atol=0)
        torch.testing.assert_close(heads, heads0, rtol=1e-5, atol=0)
        torch.testing.assert_close(logp, logp0, rtol=1e-5, atol=1e-5)
        for name, g in grads0.items():
            assert_tensor_close(grads[name], g, f"{name} (chunk {chunk})")


@pytest.mark.parametrize("preset", ["tiny-h4b16k", "tiny-standard"])
def test_fused_heads_fill_one_table_gradient(preset, monkeypatch):
    """The fused heads write their tables' gradients into one shared buffer, which becomes the tables'
    gradient as it is (no [T, R, d] stack), and the split still stacks gradients that other uses produce."""
    cfg = load_config(
        preset, overrides=["model.hash.num_buckets=64", "model.decoder_chunk_tokens=5"]
    ).model
    table = SignatureTable.build([f"tok{i}" for i in range(V)], cfg.hash.num_hashes, 64, pad_id=0)
    vocab = build_model(cfg, V, table.codes).vocab
    buffers = []
    slot = TableGradients.slot

    def recording_slot(self, i, like):
        out = slot(self, i, like)
        # (a reference would stop autograd taking the buffer as .grad)
        buffers.append(self.buffer.data_ptr())
        return out

    monkeypatch.setattr(TableGradients, "slot", recording_slot)
    h = torch.randn(16, cfg.d_model)
    vocab.loss(
        h, torch.randint(1, V, (16,))
    ).loss.backward()  # the decoder alone: its gradient is the buffer's
    assert len(buffers) == vocab.decoder.num_heads and len(set(buffers)) == 1
    assert vocab.tables.weight.grad.data_ptr() == buffers[0]

    weight = vocab.tables.weight.detach().requires_grad_()
    tables = BucketTables(*weight.shape)
    tables.weight = torch.nn.Parameter(weight)
    views = tables.per_table().tables
    (views[-1] * 2).sum().backward()  # only the last table is used, and not by a fused head
    expected = torch.zeros_like(weight)
    expected[-1] = 2
    torch.testing.assert_close(tables.weight.grad, expected, rtol=0, atol=0)


def test_compiled_blocks_equal_eager(tiny_cfg, table):
    """``train.compile``: the compiled backbone gives the eager loss and gradients (fp32)."""
    x = torch.randint(0, V, (2, 17), generator=torch.Generator().manual_seed(1))
    results = []
    for compiled in (False, True):
        m = build_model(tiny_cfg, V, table.codes)
        if compiled:
            m.backbone.compile_blocks()
        out = m(x[:, :-1], x[:, 1:])
        out.loss.backward()
        results.append((out.loss.detach(), {n: p.grad for n, p in m.named_parameters()}))
    (loss, grads), (loss_c, grads_c) = results
    torch.testing.assert_close(loss_c, loss, rtol=1e-5, atol=0)
    for name, g in grads.items():
        assert_tensor_close(grads_c[name], g, name, floor=1e-7)


# ---------------------------------------------------------------- initial weights (mhf_dist.model.init)
def test_a_parameter_of_at_most_one_block_is_one_stream_as_before():
    """A parameter (a table, for stacks) of at most BLOCK elements is drawn whole from the one generator seeded from
    ``(seed, name[, table])``: the values the model started from before parameters were drawn in blocks (the numbers
    below were computed with that code)."""
    import hashlib

    from mhf_dist.model import init

    def generator(key: str) -> torch.Generator:
        digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
        return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))

    w = torch.empty(192, 64)
    init.initial_shard("backbone.layers.0.mlp.gate_proj.weight", w.shape, w, std=0.02, seed=1234)
    assert torch.equal(
        w,
        torch.empty(192, 64).normal_(
            0.0, 0.02, generator=generator("1234/backbone.layers.0.mlp.gate_proj.weight")
        ),
    )
    assert w.view(-1)[[0, 1, 2, 12287]].tolist() == [
        -0.015405993908643723,
        -0.013752768747508526,
        -0.009411449544131756,
        -0.018609963357448578,
    ]
    t = torch.empty(4, 16384, 64)  # tiny-h4b16k's bucket tables: one stream per table
    init.initial_shard("vocab.tables.weight", t.shape, t, std=0.02, seed=1234)
    table = torch.empty(16384, 64).normal_(
        0.0, 0.02, generator=generator("1234/vocab.tables.weight/2")
    )
    assert torch.equal(t[2], table)
    assert t[2].reshape(-1)[[0, 1, 2**20 - 1]].tolist() == [
        0.009206878021359444,
        -0.023869337514042854,
        0.025392940267920494,
    ]
    assert t[0, 0, 0].item() == -0.010589882731437683
    # the tiny presets' largest stream: one block
    assert init.BLOCK == 2**20 and t[2].numel() == init.BLOCK
    b = torch.empty(init.BLOCK)
    init.initial_shard("x.weight", b.shape, b, std=1.0, seed=5)
    assert b[[0, init.BLOCK - 1]].tolist() == [-0.789883553981781, 0.028049500659108162]


INIT_SHAPES = [
    ("a.weight", (24, 40)),
    ("b.weight", (1000,)),
    ("c.weight", (6, 5, 7)),
    ("vocab.tables.weight", (4, 30, 8)),
]


@pytest.mark.parametrize("name,shape", INIT_SHAPES, ids=[n for n, _ in INIT_SHAPES])
def test_a_rank_draws_only_the_blocks_of_its_partition(monkeypatch, name, shape):
    """With blocks of 64 elements: a rank's ZeRO-3 partition of its tensor-parallel chunk (a range of the chunk
    flattened, ``ceil(numel / dp)`` elements from ``rank · that``) gets the same values as that range of the whole
    parameter, for every dp and split dim; and the rank draws its range plus at most a block at each end — when the
    chunk is strided in the full value (split along a later dim), the full rows its range touches instead, plus a
    block at each end (for each table of a stack)."""
    from mhf_dist.model import init

    block = 64
    monkeypatch.setattr(init, "BLOCK", block)
    drawn = []
    real = init.draw_block
    monkeypatch.setattr(
        init, "draw_block", lambda out, *a: (drawn.append(out.numel()), real(out, *a))
    )
    whole = torch.empty(shape)
    init.initial_shard(name, shape, whole, std=1.0, seed=3)
    # blocks: different streams
    assert not torch.equal(whole.view(-1)[:block], whole.view(-1)[block : 2 * block])
    tables = name == "vocab.tables.weight"
    for dim in [None, *range(len(shape))]:
        for tp in [1] if dim is None else [2, 3]:
            for tp_rank, chunk in enumerate(whole.chunk(tp, dim) if dim is not None else [whole]):
                # a table's chunk, or the whole chunk
                per = chunk[0].numel() if tables else chunk.numel()
                if dim is not None and dim > (
                    1 if tables else 0
                ):  # strided: runs of `width` in rows of `stride`
                    inner = math.prod(shape[dim + 1 :])
                    stride, width = shape[dim] * inner, chunk.shape[dim] * inner
                else:
                    stride = width = 1
                chunk = chunk.contiguous().view(-1)
                for dp in (1, 2, 3, 4, 7):
                    size = -(-chunk.numel() // dp)
                    for dp_rank in range(dp):
                        start = size * dp_rank
                        n = max(0, min(size, chunk.numel() - start))
                        held = torch.full((n,), float("nan"), dtype=torch.bfloat16)
                        drawn.clear()
                        init.initial_shard(
                            name,
                            shape,
                            held,
                            std=1.0,
                            seed=3,
                            dim=dim,
                            rank=tp_rank,
                            parts=tp,
                            buffer=torch.empty(block),
                            start=start,
                        )
                        assert torch.equal(held, chunk[start : start + n].bfloat16()), (dim, tp, dp)
                        # tables touched
                        spans = (start + n - 1) // per - start // per + 1 if n else 0
                        slack = 2 * block + (2 * stride if stride > 1 else 0)
                        bound = -(-n * stride // width) + spans * slack
                        assert sum(drawn) <= bound, (
                            dim,
                            tp,
                            tp_rank,
                            dp,
                            dp_rank,
                            sum(drawn),
                            bound,
                        )


def test_a_second_backward_through_a_head_that_kept_its_logits_is_refused():
    """A head that keeps its logits for backward turns them into its gradient in place: a second backward through
    the same graph (``retain_graph=True``) stops at autograd's check of its saved tensors, never reading the spent
    buffer as logits."""
    cfg = load_config(
        "tiny-standard", overrides=["model.hash.num_buckets=64", f"model.init_std={INIT_STD}"]
    ).model
    table = SignatureTable.build([f"tok{i}" for i in range(V)], cfg.hash.num_hashes, 64, pad_id=0)
    m = build_model(cfg, V, table.codes)
    x = torch.randint(1, V, (2, 9), generator=torch.Generator().manual_seed(3))
    loss = m(x[:, :-1], x[:, 1:]).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
