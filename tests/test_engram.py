"""Engram memory (docs/spec.md §8): compression, N-gram hashes, gates, causality, parallel equivalence, training.

Expected values are computed here from docs/spec.md §8's formulas, one position at a time in plain Python.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import sympy
import torch
import torch.nn.functional as F

from helpers.equivalence import assert_tensor_close, step
from helpers.ranks import run_ranks
from helpers.runs import metrics, run_cli, train_args, train_run
from mhf_dist.backend.deepspeed.pipeline import canonical_name, pipeline_name
from mhf_dist.backend.deepspeed.universal import universal_info
from mhf_dist.config import ConfigError, EngramConfig, load_config
from mhf_dist.model import build_model
from mhf_dist.model.engram import EngramMemory, SoftmaxGate
from mhf_dist.model.engram_sizes import table_sizes
from mhf_dist.model.flops import forward_flops
from mhf_dist.model.ngram_hash import NgramHash
from mhf_dist.parallel.accounting import expected_collective_bytes
from mhf_dist.parallel.groups import ParallelGroups
from mhf_dist.parallel.state_dict import merge_state_dicts
from mhf_dist.parallel.tensor_parallel import apply_tensor_parallel, tp_split_dims
from mhf_dist.profiling.training import profile_training
from mhf_dist.storage.run_dir import RunDir
from mhf_dist.vocab.engram_compression import CompressionError, CompressionTable, normalize
from mhf_dist.vocab.signatures import SignatureTable
from mhf_dist.vocab.tokenizers import load_tokenizer, train_bpe

V = 300


def wrap(x: int) -> int:
    """Two's-complement int64 wrap-around of a Python integer."""
    return (x + 2**63) % 2**64 - 2**63


def random_compression(vocab: int, num_ids: int, seed: int) -> CompressionTable:
    """A many-to-one table onto all of ``0..num_ids-1``, pad id 0."""
    gen = torch.Generator().manual_seed(seed)
    old_to_new = torch.cat(
        [torch.arange(num_ids), torch.randint(0, num_ids, (vocab - num_ids,), generator=gen)]
    )
    return CompressionTable(
        old_to_new=old_to_new.int(),
        keys=tuple(map(str, range(num_ids))),
        pad_id=0,
        tokenizer_fingerprint="test",
    )


# ---------------------------------------------------------------- tokenizer compression
def deepseek_normalizer():
    """The normaliser of DeepSeek's public demo (``CompressedTokenizer``), from the ``tokenizers`` package: an
    independent implementation of docs/spec.md §8's NFKC, accent stripping, lower-casing and whitespace collapsing."""
    from tokenizers import Regex, normalizers

    sentinel = "\ue000"
    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), sentinel),
            normalizers.Strip(),
            normalizers.Replace(sentinel, " "),
        ]
    )


def test_normalization_matches_deepseek():
    reference = deepseek_normalizer()
    for text in [
        "Ｃafé",
        " The",
        "THE\n\n",
        "\t \n",
        " ",
        "Ǆemal ﬁ",
        "naïve  résumé ",
        "İstanbul",
        "ÅNGSTRÖM\r\n",
    ]:
        assert normalize(text) == reference.normalize_str(text), text


def test_compression_merges_tokens_equal_after_normalization(bpe):
    table = CompressionTable.build(bpe)
    tokens, reference = bpe.convert_ids_to_tokens(list(range(len(bpe)))), deepseek_normalizer()
    decoded = [bpe.decode([v]) for v in range(len(bpe))]
    # a partial UTF-8 piece keeps its own string; text that normalises to nothing keeps its decoding
    keys = [
        tokens[v] if "\ufffd" in text else reference.normalize_str(text) or text
        for v, text in enumerate(decoded)
    ]
    by_key = {}
    for v, key in enumerate(keys):
        by_key.setdefault(key, table.old_to_new[v].item())
        assert table.old_to_new[v].item() == by_key[key], (v, tokens[v], key)
    # shared ids exactly for equal keys; the vocabulary shrinks
    assert table.num_ids == len(by_key) < len(bpe)
    assert sorted(set(table.old_to_new.tolist())) == list(range(table.num_ids))
    the = [
        bpe.convert_tokens_to_ids(t) for t in ("the", "Ġthe", "The", "ĠThe") if t in bpe.get_vocab()
    ]
    # " the" and "the" merge
    assert len(the) >= 2 and len({table.old_to_new[v].item() for v in the}) == 1
    assert table.pad_id == table.old_to_new[bpe.pad_token_id].item()
    assert abs(table.ratio - table.num_ids / len(bpe)) < 1e-12 and "ratio" in table.summary()


def test_compression_is_persisted_and_verified(tmp_path, bpe):
    run = RunDir(tmp_path / "run")
    built = run.ensure_compression(bpe)
    assert (run.engram_dir / "compression.safetensors").is_file()
    loaded = run.ensure_compression(bpe)
    assert (
        torch.equal(loaded.old_to_new, built.old_to_new)
        and loaded.content_hash == built.content_hash
    )
    other_dir = tmp_path / "other"
    train_bpe(["a small other corpus, with other words"] * 20, 300, other_dir)
    with pytest.raises(
        CompressionError, match=r"built for another tokenizer .* delete .*engram to rebuild"
    ):
        run.ensure_compression(load_tokenizer(other_dir))
    meta_path = run.engram_dir / "compression.json"
    meta = json.loads(meta_path.read_text())
    meta["keys"][5] = "tampered"
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CompressionError, match=r"fails its content check.*delete"):
        run.ensure_compression(bpe)


# ---------------------------------------------------------------- N-gram hashes
def reference_indices(
    hasher: NgramHash, ids: list[int], compression: CompressionTable, mode: str
) -> tuple[list, bool]:
    """docs/spec.md §8 at each position t of one sequence; also whether some int64 product wrapped around."""
    x = [compression.old_to_new[i].item() for i in ids]
    moduli, vp, pad = hasher.moduli.tolist(), compression.num_ids, compression.pad_id
    wrapped = False

    def times(a, b):
        nonlocal wrapped
        wrapped |= wrap(a * b) != a * b
        return wrap(a * b)

    rows = []
    for t in range(len(x)):
        # x_t, x_{t-1}, ...
        back = [x[t - j] if t - j >= 0 else pad for j in range(hasher.max_ngram)]
        row = []
        for n in range(2, hasher.max_ngram + 1):
            if mode == "keyed":
                v = 0
                for tok in reversed(back[:n]):  # v = a·V' + b for (a, b) = (x_{t-1}, x_t)
                    v = wrap(times(v, vp) + tok)
                for key, m in zip(hasher.keys[n - 2].tolist(), moduli[n - 2]):
                    row.append((times(v, key) ^ key) % m)
            else:
                mix = 0
                for j in range(n):
                    mix ^= times(back[j], hasher.multipliers[j].item())
                row += [mix % m for m in moduli[n - 2]]
        rows.append(row)
    return rows, wrapped


@pytest.mark.parametrize("mode", ["keyed", "engram"])
def test_hash_indices_match_spec_formulas(mode):
    cfg = EngramConfig(hash=mode, max_ngram=4, heads=3, table_size=5000, seed=7)
    sizes = table_sizes(cfg, [2, 5])
    primes = [m for layer in sizes.values() for order in layer for m in order]
    assert len(primes) == 2 * 3 * 3 == len(set(primes)) and all(
        sympy.isprime(m) and m >= 5000 for m in primes
    )
    # V' large enough that 3- and 4-gram products wrap
    compression = random_compression(50_000, 40_000, seed=0)
    hasher = NgramHash(
        cfg, 5, sizes[5], compression.old_to_new, compression.num_ids, compression.pad_id
    )
    ids = torch.randint(0, 50_000, (3, 11), generator=torch.Generator().manual_seed(1))
    got = hasher(ids)
    assert got.shape == (3, 11, 3 * 3) and got.dtype == torch.long
    any_wrapped = False
    for b in range(3):
        expected, wrapped = reference_indices(hasher, ids[b].tolist(), compression, mode)
        assert got[b].tolist() == expected
        any_wrapped |= wrapped
    if mode == "keyed":
        assert any_wrapped  # v·key leaves int64: the wrap-around is exercised
        assert ((hasher.keys >= 1) & (hasher.keys < 2**31)).all()
    else:  # DeepSeek's per-layer multipliers: odd, from default_rng(seed + 10007·layer), x·m never overflows
        half = (2**63 - 1) // compression.num_ids // 2
        expected_m = (
            np.random.default_rng(7 + 10007 * 5).integers(0, half, size=4, dtype=np.int64) * 2 + 1
        )
        assert hasher.multipliers.tolist() == expected_m.tolist()
    other = NgramHash(
        cfg, 2, sizes[2], compression.old_to_new, compression.num_ids, compression.pad_id
    )
    assert not torch.equal(other(ids), got)  # other layer, other constants and tables


# ---------------------------------------------------------------- gates
def test_softmax_gate_equals_hand_computation():
    d = 4
    h = [0.3, 0.4, -0.05, 0.25]
    u = [[0.2, 0.5, -0.1, 0.3], [0.4, -0.2, 0.6, -0.4], [-0.3, 0.1, 0.2, 0.7]]
    w_o = torch.randn(d, d, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    scores = [sum(hi * ui for hi, ui in zip(h, row)) / math.sqrt(d) for row in u]
    for threshold in (None, sorted(scores)[1], max(scores) + 1):
        gate = SoftmaxGate(d, threshold).double()
        with torch.no_grad():
            gate.out_proj.weight.copy_(w_o)
        keep = [threshold is None or s >= threshold for s in scores]
        z = sum(math.exp(s) for s, k in zip(scores, keep) if k)
        weights = [math.exp(s) / z if k else 0.0 for s, k in zip(scores, keep)]
        fused = [sum(w * row[i] for w, row in zip(weights, u)) for i in range(d)]
        out = [sum(w_o[i, j].item() * fused[j] for j in range(d)) for i in range(d)]
        th, tu = torch.tensor(h, dtype=torch.float64), torch.tensor(u, dtype=torch.float64)
        torch.testing.assert_close(gate.weights(th, tu), torch.tensor(weights, dtype=torch.float64))
        torch.testing.assert_close(gate(th, tu), torch.tensor(out, dtype=torch.float64))
    assert sum(keep) == 0 and out == [0.0] * d  # every head masked: the memory reads nothing


def memory_case(gate: str, mode: str, **extra) -> tuple[EngramMemory, CompressionTable]:
    cfg = load_config(
        "tiny-standard+engram",
        overrides=[
            f"model.engram.gate={gate}",
            f"model.engram.hash={mode}",
            "model.engram.table_size=97",
        ]
        + [f"model.engram.{k}={v}" for k, v in extra.items()],
    ).model
    compression = random_compression(V, 200, seed=2)
    torch.manual_seed(0)
    model = build_model(cfg, V, compression=compression).double()
    return model.backbone.layers[1].engram, compression


def test_softmax_memory_reads_hashed_rows():
    memory, _ = memory_case("softmax", "keyed", threshold=0.0)
    ids = torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(3))
    h = torch.randn(2, 7, 64, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    idx, table = memory.hash(ids), memory.tables.weight
    got = memory(h, ids)
    for b in range(2):
        for t in range(7):
            u = torch.stack([table[k, idx[b, t, k]] for k in range(idx.shape[-1])])
            torch.testing.assert_close(got[b, t], memory.gate(h[b, t], u))


def test_sigmoid_gate_equals_formula():
    memory, _ = memory_case("sigmoid", "engram")
    gate, d, S = memory.gate, 64, 9
    with torch.no_grad():
        for p in gate.parameters():
            p.normal_(std=0.5)  # norms and conv taps away from their initial values
    ids = torch.randint(0, V, (1, S), generator=torch.Generator().manual_seed(5))
    h = torch.randn(1, S, d, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    got = memory(h, ids)[0]
    # concatenated head vectors
    e = memory.tables.weight[torch.arange(8), memory.hash(ids)[0]].reshape(S, -1)

    def rms(x, gain):
        return x / torch.sqrt((x * x).mean() + 1e-6) * gain

    v = []
    for t in range(S):
        g = (
            rms(gate.key_proj.weight @ e[t], gate.key_norm.weight)
            * rms(h[0, t], gate.query_norm.weight)
        ).sum()
        g = g / math.sqrt(d)
        alpha = torch.sigmoid(torch.sign(g) * torch.sqrt(g.abs()))
        v.append(alpha * (gate.value_proj.weight @ e[t]))
    conv, taps, dilation = gate.short_conv.conv.weight[:, 0], 4, 3
    for t in range(S):  # causal depthwise conv: tap j reads position t - (taps-1-j)·dilation
        y = sum(
            conv[:, j] * rms(v[t - (taps - 1 - j) * dilation], gate.short_conv.norm.weight)
            for j in range(taps)
            if t - (taps - 1 - j) * dilation >= 0
        )
        torch.testing.assert_close(got[t], v[t] + F.silu(y))


@pytest.mark.parametrize("gate, mode", [("softmax", "keyed"), ("sigmoid", "engram")])
def test_memory_is_causal(gate, mode):
    memory, compression = (
        memory_case(gate, mode, threshold=0.0) if gate == "softmax" else memory_case(gate, mode)
    )
    S = 10
    ids = torch.randint(1, V, (2, S), generator=torch.Generator().manual_seed(7))
    h = torch.randn(2, S, 64, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    out, compressed = memory(h, ids), compression.old_to_new
    for t in range(S - 1):
        changed = ids.clone()
        # a token with another compressed id in both sequences, so the N-grams from t+1 on really change
        changed[:, t + 1] = next(
            v for v in range(V) if compressed[v] not in compressed[ids[:, t + 1]]
        )
        new = memory(h, changed)
        assert torch.equal(new[:, : t + 1], out[:, : t + 1]), t
        assert not torch.equal(new[:, t + 1], out[:, t + 1]), t


def test_model_hidden_states_are_causal_with_memory():
    cfg = load_config(
        "tiny-h4b16k+engram",
        overrides=[
            "model.hash.num_buckets=64",
            "model.engram.layers=[0,1]",
            "model.engram.table_size=97",
        ],
    ).model
    table = SignatureTable.build([f"tok{i}" for i in range(V)], 4, 64, pad_id=0)
    torch.manual_seed(0)
    model = build_model(cfg, V, table.codes, random_compression(V, 200, seed=2)).double()
    ids = torch.randint(1, V, (1, 8), generator=torch.Generator().manual_seed(9))
    h = model.hidden(ids)
    changed = ids.clone()
    changed[0, 5] = 1 + (ids[0, 5] % (V - 1))
    h2 = model.hidden(changed)
    torch.testing.assert_close(h2[:, :5], h[:, :5], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(h2[:, 5:], h[:, 5:])


# ---------------------------------------------------------------- config, FLOPs
@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["model.engram.layers=[1,10]"],
            r"model.engram.layers=\[1, 10\]: layer 10 is out of range for "
            r"model.n_layers=2; use 0..1",
        ),
        (
            ["model.engram.gate=softmax", "model.engram.head_dim=8"],
            r"head_dim=8 with gate=softmax.*d_model=64",
        ),
        (["model.engram.threshold=0.5"], r"threshold applies to gate=softmax only"),
        (
            ["parallel.tp=2", "model.engram.pad_rows_to=3"],
            r"pad_rows_to=3 is not a multiple of parallel.tp=2",
        ),
        (
            ["model.engram.heads=3"],
            r"d_model=64 is not divisible by \(max_ngram-1\)·heads = 6; set model.engram.head_dim",
        ),
    ],
)
def test_engram_config_errors_name_field_and_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny-h4b16k+engram", overrides=overrides)


def test_presets_and_flops_include_the_memory():
    cfg = load_config("1b-h4b16k+engram").model
    assert cfg.engram_layers == [1, 10]  # docs/spec.md §8: layers 1 and L/2
    compression = CompressionTable.identity(32768)
    with torch.device("meta"):
        counts = build_model(
            cfg, 32768, torch.ones(32768, 4, dtype=torch.long), compression
        ).parameter_counts()
    # two memories of (3-1)·4 heads, each 65,537 + 127 padding rows of 2048 / 8 = 256
    assert counts["engram"] == 2 * 8 * 65664 * 256 + 2 * (2 * 2048 * 2048 + 3 * 2048 + 4 * 2048)
    assert load_config("100m-standard+4l+engram").model.n_layers == 16
    assert load_config("tiny-h4b16k").model.engram is None
    cfg = load_config("tiny-h4b16k+engram", overrides=["model.engram.layers=[0,1]"]).model
    base = forward_flops(load_config("tiny-h4b16k").model, 128)
    d, width, kernel = 64, 2 * 4 * 8, 4  # T·m = (N-1)·K·head_dim = d
    per_memory = 2 * (2 * width * d) + 2 * d + 2 * kernel * d  # W_k, W_v, gate dot, depthwise conv
    assert forward_flops(cfg, 128).forward == base.forward + 2 * per_memory
    softmax = load_config("tiny-h4b16k+engram", overrides=["model.engram.gate=softmax"]).model
    assert forward_flops(softmax, 128).forward == base.forward + 2 * 2 * (8 * d) + 2 * d * d


# ---------------------------------------------------------------- tensor parallel
TP_CASES = {  # preset, overrides: both gates, both hashes, both model families, a memory on both layers
    "mhf-sigmoid": ("tiny-h4b16k+engram", ["model.hash.num_buckets=64"]),
    "standard-softmax": (
        "tiny-standard+engram",
        ["model.engram.gate=softmax", "model.engram.hash=seed", "model.engram.threshold=0.0"],
    ),
}


def make_tp_case(name: str, tp: int):
    preset, overrides = TP_CASES[name]
    cfg = load_config(
        preset,
        overrides=[
            *overrides,
            "model.engram.layers=[0,1]",
            "model.engram.table_size=61",
            f"parallel.tp={tp}",
            "model.decoder_chunk_tokens=0",
        ],
    ).model
    table = SignatureTable.build(
        [f"tok{i}" for i in range(V)], cfg.hash.num_hashes, cfg.hash.num_buckets, pad_id=0
    )
    torch.manual_seed(0)
    model = build_model(cfg, V, table.codes, random_compression(V, 200, seed=2))
    batch = torch.randint(1, V, (2, 9), generator=torch.Generator().manual_seed(1))
    return cfg, model, batch


def engram_tp_worker(rank, world):
    groups = ParallelGroups.create(tp=world)
    results = {}
    for name in TP_CASES:
        _, model, batch = make_tp_case(name, world)
        apply_tensor_parallel(model, groups.tp_group, groups.tp_rank, groups.tp)
        # rows sharded
        assert model.backbone.layers[0].engram.tables.weight.shape[1] == 128 // world
        results[name] = step(model, batch)
    return results


@pytest.mark.multirank
def test_tensor_parallel_with_memory_equals_single_process():
    ranks = run_ranks(engram_tp_worker, 2)
    for name in TP_CASES:
        cfg, model, batch = make_tp_case(name, 2)
        ref = step(model, batch)
        for r in ranks:
            torch.testing.assert_close(r[name]["loss"], ref["loss"], rtol=1e-5, atol=0, msg=name)
            torch.testing.assert_close(r[name]["logp"], ref["logp"], rtol=1e-5, atol=1e-5, msg=name)
        grads = merge_state_dicts([r[name]["grads"] for r in ranks], tp_split_dims(cfg, 2))
        assert grads.keys() == ref["grads"].keys()
        for key, g in ref["grads"].items():
            assert_tensor_close(grads[key], g, f"{name} grad {key}")
        for layer in (0, 1):  # the memories take part: their tables receive gradient
            assert ref["grads"][f"backbone.layers.{layer}.engram.tables.weight"].abs().sum() > 0
        assert ranks[0][name]["bytes"] == dict(
            expected_collective_bytes(cfg, batch[:, 1:].numel(), 2)
        ), name
        # checkpoint conversion joins the memory tables' shards along their rows, under either engine's names
        for pipeline in (False, True):
            info = universal_info(list(ref["grads"]), cfg, 2, pipeline)
            name_in_engine = (
                pipeline_name("backbone.layers.1.engram.tables.weight", cfg.n_layers)
                if pipeline
                else "backbone.layers.1.engram.tables.weight"
            )
            assert any(
                re.fullmatch(p, name_in_engine)
                for p in info["parameter_with_row_parallelism_patterns"]
            )
        assert (
            canonical_name(pipeline_name("backbone.layers.1.engram.gate.key_proj.weight", 2))
            == "backbone.layers.1.engram.gate.key_proj.weight"
        )


# ---------------------------------------------------------------- training, pipeline, resharding, profile
ENGRAM = ("model.engram.layers=[0,1]", "model.engram.table_size=1000")
TRAIN_STEPS = 30


@pytest.fixture(scope="module")
def single(tmp_path_factory, data):
    """One rank (ZeRO-3), the memory on both layers: (metrics, printed output, run directory)."""
    run = tmp_path_factory.mktemp("engram") / "single"
    out = run_cli(train_args(run, data, 1, *ENGRAM, preset="tiny-h4b16k+engram", steps=TRAIN_STEPS))
    return metrics(run), out, run


@pytest.mark.multirank
def test_tiny_model_with_memory_trains_on_real_text(single):
    records, out, run = single
    assert "Engram tokenizer compression: 1,024 -> " in out  # the ratio is reported at start
    table = CompressionTable.load(run / "engram")
    assert table.vocab_size == 1024 and table.num_ids < 1024
    first, last = records[0]["loss"], sum(r["loss"] for r in records[-3:]) / 3
    assert last < first - 1.5, (first, last)


@pytest.mark.multirank
@pytest.mark.parametrize(
    "nproc, layout",
    [(2, ["parallel.pp=2"]), (4, ["parallel.tp=2", "parallel.pp=2"])],
    ids=["pp2", "tp2-pp2"],
)
def test_pipeline_with_memory_gives_single_process_losses(tmp_path, data, single, nproc, layout):
    # warm-up lasts 10 steps, so the first 3 steps' learning rates do not depend on max_steps
    piped = train_run(
        tmp_path,
        data,
        "piped",
        nproc,
        *layout,
        "parallel.activation_checkpoint_interval=1",
        *ENGRAM,
        preset="tiny-h4b16k+engram",
        steps=3,
    )
    for got, want in zip(piped, single[0][:3], strict=True):
        assert abs(got["loss"] - want["loss"]) <= 1e-4 * want["loss"], (
            got["step"],
            got["loss"],
            want["loss"],
        )
        for a, b in zip(got["head_losses"], want["head_losses"]):
            assert abs(a - b) <= 1e-4 * b


@pytest.mark.multirank
def test_resume_with_memory_under_another_tensor_parallel_layout(tmp_path, data, single):
    # tp = 2 for two steps, then the universal checkpoint continues at tp = 1: the memory tables are merged
    # along their rows (tp_split_dims), so the losses continue the uninterrupted single-process run's
    args = [*ENGRAM, "train.stop_at_step=2"]
    run_cli(
        train_args(
            tmp_path / "run",
            data,
            2,
            "parallel.tp=2",
            *args,
            preset="tiny-h4b16k+engram",
            steps=TRAIN_STEPS,
        )
    )
    out = run_cli(
        train_args(
            tmp_path / "run",
            data,
            1,
            *ENGRAM,
            "train.stop_at_step=4",
            preset="tiny-h4b16k+engram",
            steps=TRAIN_STEPS,
        )
    )
    assert "converted to this layout" in out
    resumed = metrics(tmp_path / "run")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for got, want in zip(resumed, single[0][:4]):
        assert abs(got["loss"] - want["loss"]) <= 1e-5 * want["loss"], (
            got["step"],
            got["loss"],
            want["loss"],
        )


@pytest.mark.parametrize("hash_name", ["standard+engram", "h4b16k+engram"])
def test_profile_accepts_engram_presets(hash_name):
    """`mhf-dist profile --hash h4b16k,h4b16k+engram` builds each preset in its worker: one step in process."""
    kwargs = dict(
        size="tiny",
        tp=1,
        steps=1,
        warmup=0,
        seq_len=16,
        micro=1,
        dtype="fp32",
        device=torch.device("cpu"),
        peak_measured=1e12,
        peak_nominal=None,
        overrides=[],
    )
    plain = profile_training(hash_name=hash_name.removesuffix("+engram"), **kwargs)
    memory = profile_training(hash_name=hash_name, **kwargs)
    assert memory.hash == hash_name and memory.params > plain.params
    # FLOPs per token (TFLOP/s over tokens/s) include the memory
    assert memory.tflops / memory.tokens_per_s > plain.tflops / plain.tokens_per_s
