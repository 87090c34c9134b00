"""SignatureTable (docs/spec.md §1): hash vectors, collision rule, errors, extension, persistence."""

from __future__ import annotations

import json

import mmh3
import pytest
import torch

from mhf_dist.config import load_config
from mhf_dist.model import build_model
from mhf_dist.vocab.signatures import SignatureError, SignatureTable


def reference_signatures(tokens, H, B, pad_id=None):
    """docs/spec.md §1 written directly: ascending ids, rehash the last coordinate against every taken signature."""
    taken, rows = set(), []
    for v, tok in enumerate(tokens):
        if v == pad_id:
            rows.append([0] * H)
            continue
        sig = [mmh3.hash128(tok, seed=i, signed=False) % (B - 1) + 1 for i in range(H)]
        k = 0
        while tuple(sig) in taken:
            k += 1
            sig[-1] = mmh3.hash128(tok, seed=H - 1 + k, signed=False) % (B - 1) + 1
        taken.add(tuple(sig))
        rows.append(sig)
    return rows


def parameter_count(cfg, table: SignatureTable) -> int:
    return sum(p.numel() for p in build_model(cfg, table.vocab_size, table.codes).parameters())


TOKENS = ["hello", "▁world", "Ġthe", "<s>", "ü", "日本", "12", "\n"]


def test_hash_vectors_match_mmh3():
    table = SignatureTable.build(TOKENS, num_hashes=4, num_buckets=16384)
    for v, tok in enumerate(TOKENS):
        expected = [mmh3.hash128(tok.encode("utf-8"), seed=i) % 16383 + 1 for i in range(4)]
        assert table.codes[v].tolist() == expected
    assert table.codes.dtype == torch.int32 and table.codes.shape == (len(TOKENS), 4)


def test_collisions_resolved_on_last_coordinate_against_all_signatures():
    # B=9, H=2: 64 possible signatures for 40 tokens forces collisions and multi-token prefixes.
    tokens = [f"tok{i}" for i in range(40)]
    table = SignatureTable.build(tokens, num_hashes=2, num_buckets=9)
    assert table.codes.tolist() == reference_signatures(tokens, 2, 9)
    assert len({tuple(r) for r in table.codes.tolist()}) == len(tokens)
    # the prefix (first coordinate) is never rehashed; some last coordinates were
    assert [r[0] for r in table.codes.tolist()] == [mmh3.hash128(t, seed=0) % 8 + 1 for t in tokens]
    rehashed = [
        r[1] != mmh3.hash128(t, seed=1) % 8 + 1 for t, r in zip(tokens, table.codes.tolist())
    ]
    assert sum(rehashed) >= 3


def test_pad_row_is_zero_and_not_registered():
    table = SignatureTable.build(TOKENS, 3, 64, pad_id=2)
    assert table.codes[2].tolist() == [0, 0, 0]
    assert table.registered_mask().tolist() == [v != 2 for v in range(len(TOKENS))]
    assert (table.codes[torch.arange(len(TOKENS)) != 2] > 0).all()


def test_capacity_error_names_fix():
    with pytest.raises(SignatureError, match=r"capacity is \(B-1\)\^H = 3.*larger num_buckets"):
        SignatureTable.build([f"t{i}" for i in range(4)], num_hashes=1, num_buckets=4)


def test_saturated_prefix_error_names_token():
    # B=3: each coordinate is 1 or 2. Find 3 tokens sharing a first coordinate among 4 (capacity 4).
    ones = [t for t in (f"w{i}" for i in range(100)) if mmh3.hash128(t, seed=0) % 2 + 1 == 1][:3]
    with pytest.raises(
        SignatureError, match=rf"token '{ones[2]}' \(id 2\).*prefix \(1,\).*larger num_buckets"
    ):
        SignatureTable.build(ones, num_hashes=2, num_buckets=3)


def test_single_id_mode_copies_one_hash():
    tokens = [f"t{i}" for i in range(200)]
    table = SignatureTable.build(tokens, num_hashes=4, num_buckets=32, single_id=True)
    first = [mmh3.hash128(t, seed=0) % 31 + 1 for t in tokens]
    assert table.codes.tolist() == [[h] * 4 for h in first]
    assert not table.unique  # 200 tokens in 31 values: shared signatures are allowed


def test_extend_keeps_rows_and_adds_no_parameters(tiny_cfg):
    old = SignatureTable.build(TOKENS, 4, 64, pad_id=0)
    new = old.extend(["new1", "new2", "hello world"])
    assert torch.equal(new.codes[: len(TOKENS)], old.codes)
    assert len({tuple(r) for r in new.codes[1:].tolist()}) == new.vocab_size - 1
    assert new.is_extension_of(old) and not old.is_extension_of(new)
    assert parameter_count(tiny_cfg, new) == parameter_count(tiny_cfg, old)
    with pytest.raises(SignatureError, match="already registered"):
        new.extend(["hello"])
    # extending equals building the whole list at once
    assert torch.equal(
        SignatureTable.build(TOKENS + ["new1", "new2", "hello world"], 4, 64, pad_id=0).codes,
        new.codes,
    )


def test_save_load_round_trip(tmp_path):
    table = SignatureTable.build(TOKENS, 4, 128, pad_id=0)
    loaded = SignatureTable.load(table.save(tmp_path / "sig"))
    assert torch.equal(loaded.codes, table.codes) and loaded.tokens == table.tokens
    assert loaded.content_hash == table.content_hash
    meta = json.loads((tmp_path / "sig" / "signatures.json").read_text())
    assert {
        "num_hashes",
        "num_buckets",
        "seeds",
        "hash_version",
        "tokenizer_fingerprint",
        "content_hash",
    } <= set(meta)


def test_tampered_or_truncated_table_is_detected(tmp_path):
    table = SignatureTable.build(TOKENS, 4, 128)
    path = table.save(tmp_path / "sig")
    codes = table.codes.clone()
    codes[3, 1] += 1
    from safetensors.numpy import save_file

    save_file({"codes": codes.numpy()}, str(path / "signatures.safetensors"))
    with pytest.raises(SignatureError, match="fails its content check"):
        SignatureTable.load(path)
    table.save(path)
    data = (path / "signatures.safetensors").read_bytes()
    (path / "signatures.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(SignatureError, match="unreadable"):
        SignatureTable.load(path)


def test_param_count_independent_of_vocabulary():
    cfg = load_config("tiny-h4b16k", overrides=["model.hash.num_buckets=128"]).model
    small, large = (
        SignatureTable.build(TOKENS, 4, 128),
        SignatureTable.build([f"t{i}" for i in range(3000)], 4, 128),
    )
    assert parameter_count(cfg, small) == parameter_count(cfg, large)
