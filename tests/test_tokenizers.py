"""Offline tokenizers: a BPE trained here, Mistral v0.3 from mistral-common, signatures over 32K."""

from __future__ import annotations

from pathlib import Path

import pytest

from mhf_dist.cli import main
from mhf_dist.vocab.signatures import SignatureTable
from mhf_dist.vocab.token_list import vocabulary
from mhf_dist.vocab.tokenizers import TokenizerError, load_tokenizer


def test_trained_bpe_loads_with_auto_tokenizer(bpe):
    assert len(bpe) == 1024
    ids = bpe("In the beginning God created the heaven and the earth.")["input_ids"]
    assert bpe.decode(ids) == "In the beginning God created the heaven and the earth."
    assert bpe.eos_token_id is not None and bpe.pad_token_id is not None


def test_tokenizer_train_cli(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    assert (
        main(
            [
                "tokenizer",
                "train",
                "--input",
                str(text),
                "--vocab-size",
                "300",
                "--out",
                str(tmp_path / "tok"),
            ]
        )
        == 0
    )
    assert load_tokenizer(tmp_path / "tok")("the lazy dog")["input_ids"]


def test_missing_tokenizer_names_the_fix(tmp_path):
    with pytest.raises(TokenizerError, match="does not exist: train one"):
        load_tokenizer(tmp_path / "nope")


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    out = tmp_path_factory.mktemp("mistral")
    assert main(["tokenizer", "mistral-v0.3", "--out", str(out)]) == 0
    return load_tokenizer(out)


def test_mistral_v03_directory_holds_the_tokenizer_converted_from_its_model(mistral, tmp_path):
    # the written tokenizer.json loads without converting; it must be the conversion of the model beside it
    (tmp_path / "tokenizer.model").write_bytes(
        (Path(mistral.name_or_path) / "tokenizer.model").read_bytes()
    )
    converted = load_tokenizer(tmp_path)
    assert sorted(p.name for p in Path(mistral.name_or_path).iterdir()) == [
        "tokenizer.json",
        "tokenizer.model",
        "tokenizer_config.json",
    ]
    text = "In the beginning </s> God created\n\tthe heaven 1611 ünïcode 日本語  <s>"
    assert mistral(text)["input_ids"] == converted(text)["input_ids"]
    assert vocabulary(mistral) == vocabulary(converted)
    assert mistral.eos_token_id == converted.eos_token_id == 2


def test_mistral_v03_has_32768_pieces(mistral):
    tokens = vocabulary(mistral)
    assert len(tokens) == 32768 and tokens[:3] == ["<unk>", "<s>", "</s>"]


@pytest.mark.parametrize("H, B", [(4, 16384), (3, 10624)])
def test_paper_tables_unique_over_mistral_vocabulary(mistral, H, B):
    table = SignatureTable.build(vocabulary(mistral), num_hashes=H, num_buckets=B)
    assert table.num_registered == 32768
    assert len({tuple(r) for r in table.codes.tolist()}) == 32768
