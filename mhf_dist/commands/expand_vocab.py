"""``mhf-dist expand-vocab``: grow a trained run's vocabulary (docs/spec.md §1; the paper's vocabulary expansion).

The new tokenizer must keep every old token at its old id and append the new
ones. A MultiHashFormer registers the new tokens with fresh unique signatures
(:meth:`SignatureTable.extend`: old rows never change) and adds no parameter.
A Standard model gets one new table row per new token, initialised to the mean
of the old rows of the token's text under the old tokenizer (as the authors'
``mean_initialization.py``), and the parameters added are reported.

The result is a new run directory (the old one is left as it was) that starts
from the expanded weights (``train.init_from``), optionally training only the
vocabulary side, the final norm and the first and last k blocks
(``train.trainable_blocks``), as the paper's expansion stage does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from mhf_dist.config import EMBEDDED_CORPUS, ConfigError, RunConfig, apply_override
from mhf_dist.hf.importer import INIT_WEIGHTS, save_initialised_run
from mhf_dist.model import build_model
from mhf_dist.model.variants import variant
from mhf_dist.storage.output_dir import check_target, staged
from mhf_dist.storage.run_dir import RunDir
from mhf_dist.train.trained_weights import trained_weights
from mhf_dist.vocab.signatures import SignatureTable
from mhf_dist.vocab.token_list import vocabulary
from mhf_dist.vocab.tokenizers import TokenizerError, load_tokenizer

TABLES = "vocab.tables.weight"


@dataclass
class Expansion:
    run_dir: Path
    old_vocab: int
    new_vocab: int
    parameters_added: int

    def summary(self) -> str:
        return (f"expanded {self.old_vocab} -> {self.new_vocab} tokens, {self.parameters_added} parameters added; "
                f"continue with: mhf-dist train --run-dir {self.run_dir} --config {self.run_dir / 'config.yaml'}")


def check_superset(old: list[str], new: list[str]) -> None:
    """The new vocabulary keeps every old token at its old id."""
    if len(new) <= len(old):
        raise TokenizerError(f"the new tokenizer has {len(new)} tokens, not more than the run's {len(old)}: "
                             "pass a tokenizer that appends tokens to the run's vocabulary")
    for i, (a, b) in enumerate(zip(old, new)):
        if a != b:
            where = "is missing from" if a not in set(new) else "has another id in"
            raise TokenizerError(f"token {a!r} (id {i}) {where} the new tokenizer (id {i} is {b!r} there): the new "
                                 "vocabulary must be a superset of the old one with every old id kept")


def mean_initialised_rows(table: torch.Tensor, old_tok, new_tok, new_ids: range) -> torch.Tensor:
    """Rows for ``new_ids``: the mean of the old rows of each token's text under the old tokenizer."""
    rows = []
    for i in new_ids:
        pieces = old_tok.encode(new_tok.decode([i]), add_special_tokens=False)
        rows.append(table[pieces].mean(dim=0) if pieces else table[: len(old_tok)].mean(dim=0))
    return torch.stack(rows)


def expand_vocab(run_dir: str | Path, tokenizer: str | Path, out: str | Path | None = None,
                 trainable_blocks: int | None = None, overrides: list[str] = (), overwrite: bool = False) -> Expansion:
    trained = trained_weights(run_dir)
    cfg, state = trained.cfg, dict(trained.state)
    if cfg.model.engram is not None:
        raise ConfigError("expand-vocab: the Engram memory's N-gram hashes depend on the compressed vocabulary size "
                          "(docs/spec.md §8), which new tokens change; vocabulary expansion is not supported with "
                          "model.engram")
    old_tok, new_tok = load_tokenizer(trained.run.tokenizer_source(cfg)), load_tokenizer(tokenizer)
    old_tokens, new_tokens = vocabulary(old_tok), vocabulary(new_tok)
    check_superset(old_tokens, new_tokens)
    out = RunDir(check_target(out or Path(run_dir).with_name(f"{Path(run_dir).name}-vocab{len(new_tokens)}"),
                              [run_dir], overwrite))

    old_table = SignatureTable.load(trained.run.signatures_dir) if variant(cfg).needs_signatures else None
    table = old_table.extend(new_tokens[len(old_tokens):]) if old_table is not None else None
    if table is None:
        old = state[TABLES][0]
        rows = cfg.model.padded_vocab_rows(len(new_tokens))
        grown = old.new_zeros(rows, old.shape[1])
        grown[: len(old_tokens)] = old[: len(old_tokens)]
        grown[len(old_tokens): len(new_tokens)] = mean_initialised_rows(old, old_tok, new_tok,
                                                                         range(len(old_tokens), len(new_tokens)))
        state[TABLES] = grown[None]

    raw = cfg.model_dump(mode="json") | {"preset": None}
    if cfg.data.path is None:  # the source trained on the embedded text (a tiny preset): say so, as the preset did
        raw["data"]["path"] = EMBEDDED_CORPUS
    raw["tokenizer"] = {"path": str(out.tokenizer_dir.resolve())}
    raw["train"] |= {"init_from": INIT_WEIGHTS, "trainable_blocks": trainable_blocks}
    for assignment in overrides:
        raw = apply_override(raw, assignment)
    new_cfg = RunConfig.model_validate(raw)

    before = build_model(cfg.model, len(old_tokens), old_table.codes if old_table is not None else None)
    after_model = build_model(new_cfg.model, len(new_tokens), table.codes if table is not None else None)
    after_model.load_state_dict(state)  # the expanded weights fit the expanded model exactly

    with staged(out.path) as tmp:
        save_initialised_run(RunDir(tmp), new_cfg, new_tok, table, state,
                             {"source": str(trained.checkpoint), "expanded_from_vocab": str(len(old_tokens))})
    added = after_model.parameter_counts()["total"] - before.parameter_counts()["total"]
    return Expansion(out.path, len(old_tokens), len(new_tokens), added)
