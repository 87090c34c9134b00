"""Vocabulary expansion (docs/spec.md §1): new tokens, old signatures and rows kept, no new MHF parameters."""

from __future__ import annotations

import shlex

import pytest
import torch
import yaml
from safetensors.torch import load_file

from helpers.runs import metrics, run_cli, train_run, trained_model
from mhf_dist.config import RunConfig
from mhf_dist.model import build_model
from mhf_dist.train.trained_weights import trained_weights
from mhf_dist.vocab.signatures import SignatureTable
from mhf_dist.vocab.token_list import vocabulary
from mhf_dist.vocab.tokenizers import embedded_corpus, load_tokenizer, train_bpe

# every test expands the runs the `trained` fixture trains under `mhf-dist train`
pytestmark = pytest.mark.multirank

NEW_TOKENS = [" Jerusalem", " Israel", " wilderness", " tabernacle", " Pharaoh", "iniquity"]


@pytest.fixture(scope="module")
def superset(data, tmp_path_factory):
    """The test tokenizer with six whole words appended (old ids kept)."""
    tok = load_tokenizer(data["tokenizer"])
    assert tok.add_tokens(NEW_TOKENS) == len(NEW_TOKENS)
    out = tmp_path_factory.mktemp("superset")
    tok.save_pretrained(out)
    return out


def expanded_model(run):
    cfg = RunConfig.model_validate(yaml.safe_load((run / "config.yaml").read_text()))
    tok = load_tokenizer(cfg.tokenizer.path)
    table = SignatureTable.load(run / "signatures") if cfg.model.variant == "mhf" else None
    model = build_model(cfg.model, len(tok), table.codes if table else None)
    model.load_state_dict(load_file(str(run / cfg.train.init_from)))
    return model.eval(), tok, table


def scores_old_tokens_as_before(old, new, old_vocab: int, text: str, tok) -> None:
    """With the new tokens masked out, the expanded model's P_inf over old tokens is the old model's."""
    ids = tok(text, return_tensors="pt").input_ids
    with torch.no_grad():
        before = old.log_p_inf(ids)
        after = new.log_p_inf(ids)[..., :old_vocab]
    torch.testing.assert_close(after.log_softmax(-1), before, rtol=0, atol=1e-5)


def test_mhf_expansion_adds_no_parameters_and_keeps_every_signature(
    trained, superset, data, tmp_path
):
    out = run_cli(
        [
            "expand-vocab",
            "--run-dir",
            str(trained["mhf"]),
            "--tokenizer",
            str(superset),
            "--out",
            str(tmp_path / "expanded"),
            "--trainable-blocks",
            "0",
        ]
    )
    assert "0 parameters added" in out
    old, old_tok, old_table = trained_model(trained["mhf"])
    new, new_tok, new_table = expanded_model(tmp_path / "expanded")
    v = len(old_tok)
    assert len(new_tok) == v + len(NEW_TOKENS)
    assert new.parameter_counts() == old.parameter_counts()
    assert torch.equal(new_table.codes[:v], old_table.codes) and new_table.is_extension_of(
        old_table
    )
    registered = new_table.codes[new_table.registered_mask()]
    assert torch.unique(registered, dim=0).shape[0] == registered.shape[0]  # all signatures unique
    for name, p in old.state_dict().items():
        assert torch.equal(new.state_dict()[name], p), name
    scores_old_tokens_as_before(old, new, v, "In the beginning God created the heaven", old_tok)

    # Training continues on text with the new tokens (the embedded corpus, re-tokenised into the new run),
    # only the vocabulary side and the final norm trainable (k = 0 blocks).
    run_cli(
        [
            "train",
            "--config",
            str(tmp_path / "expanded/config.yaml"),
            "--run-dir",
            str(tmp_path / "expanded"),
            "--set",
            "data.path=embedded",
            "--set",
            "train.max_steps=2",
            "--set",
            "train.micro_batch_size=4",
        ]
    )
    assert len(metrics(tmp_path / "expanded")) == 2
    after = trained_weights(tmp_path / "expanded").state
    for name, p in old.state_dict().items():
        changed = not torch.equal(after[name], p)
        assert changed == (not name.startswith("backbone.layers.")), name


def test_standard_expansion_adds_mean_initialised_rows(trained, superset, tmp_path):
    out = run_cli(
        [
            "expand-vocab",
            "--run-dir",
            str(trained["standard"]),
            "--tokenizer",
            str(superset),
            "--out",
            str(tmp_path / "expanded"),
        ]
    )
    old, old_tok, _ = trained_model(trained["standard"])
    new, new_tok, _ = expanded_model(tmp_path / "expanded")
    v, d = len(old_tok), old.cfg.d_model

    def rows(m):
        return m.vocab.tables.weight[0]

    added = (rows(new).shape[0] - rows(old).shape[0]) * d
    assert f"{added} parameters added" in out
    assert new.parameter_counts()["total"] - old.parameter_counts()["total"] == added > 0
    assert torch.equal(rows(new)[:v], rows(old)[:v])
    for i, token in enumerate(NEW_TOKENS):
        pieces = old_tok.encode(token, add_special_tokens=False)
        torch.testing.assert_close(rows(new)[v + i], rows(old)[pieces].mean(0))
    scores_old_tokens_as_before(old, new, v, "In the beginning God created the heaven", old_tok)


def test_expansion_needs_a_superset(trained, data, tmp_path):
    """A larger tokenizer trained anew on other text reorders the old tokens: a clear error, nothing written."""
    train_bpe(list(embedded_corpus())[::3], 1100, tmp_path / "other")
    old, other = (
        vocabulary(load_tokenizer(data["tokenizer"])),
        vocabulary(load_tokenizer(tmp_path / "other")),
    )
    assert other[: len(old)] != old
    out = run_cli(
        [
            "expand-vocab",
            "--run-dir",
            str(trained["mhf"]),
            "--tokenizer",
            str(tmp_path / "other"),
            "--out",
            str(tmp_path / "x"),
        ],
        expect_rc=2,
    )
    assert "must be a superset of the old one" in out and not (tmp_path / "x").exists()


def test_expansion_names_the_commands_that_prepare_its_data_with_the_new_tokenizer(
    data, superset, tmp_path
):
    """The old run's shards carry the old tokenizer: the advice prepares them again with the new one, then trains."""
    train_run(tmp_path, data, "run", 1, steps=1)
    out = run_cli(
        [
            "expand-vocab",
            "--run-dir",
            str(tmp_path / "run"),
            "--tokenizer",
            str(superset),
            "--out",
            str(tmp_path / "expanded"),
        ]
    )
    assert "continue with" not in out
    prepare, train = [
        line.strip() for line in out.splitlines() if line.strip().startswith("mhf-dist ")
    ]
    new_shards, tokenizer = (
        f"{data['shards']}-vocab{len(load_tokenizer(superset))}",
        tmp_path / "expanded/tokenizer",
    )
    assert prepare == shlex.join(
        [
            "mhf-dist",
            "prepare-data",
            "mhf_dist/data/corpus/kjv.txt.gz",
            "--tokenizer",
            str(tokenizer),
            "--out",
            new_shards,
            "--seq-len",
            "64",
            "--samples-per-shard",
            "32",
            "--val-fraction",
            "0.05",
        ]
    )
    assert train == shlex.join(
        [
            "mhf-dist",
            "train",
            "--run-dir",
            str(tmp_path / "expanded"),
            "--config",
            str(tmp_path / "expanded/config.yaml"),
            "--set",
            f"data.path={new_shards}",
        ]
    )
    run_cli([*shlex.split(prepare)[1:], "--workers", "1", "--no-progress"])
    run_cli(shlex.split(train)[1:])
    assert [r["step"] for r in metrics(tmp_path / "expanded") if "loss" in r] == [1]
