"""``mhf-dist expand-vocab``: grow a trained run's vocabulary (docs/spec.md §1; the paper's vocabulary expansion).

The new tokenizer keeps every old token at its old id and appends the new ones (``check_superset``). A
MultiHashFormer registers them with fresh signatures (``SignatureTable.extend``) and adds no parameter; a Standard
model gets one row per new token, the mean of the old rows of its text (``mean_initialised_rows``). The result is a
new run directory starting from the expanded weights (``train.init_from``), optionally training only the vocabulary
side and the outer blocks (``train.trainable_blocks``). The command: docs/models.md, "Vocabulary expansion".
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mhf_dist.config import EMBEDDED_CORPUS, ConfigError, DataConfig, RunConfig, apply_override
from mhf_dist.data.formats import MANIFEST, DataError
from mhf_dist.data.locations import read_json
from mhf_dist.data.retokenize import prepare_command, prepared_again
from mhf_dist.hf.importer import INIT_WEIGHTS, save_initialised_run
from mhf_dist.model import build_model
from mhf_dist.model.variants import variant
from mhf_dist.storage.output_dir import check_target, staged
from mhf_dist.storage.run_dir import RunDir
from mhf_dist.train.trained_weights import trained_weights
from mhf_dist.vocab.signatures import SignatureTable
from mhf_dist.vocab.token_list import tokens_fingerprint, vocabulary
from mhf_dist.vocab.tokenizers import TokenizerError, load_tokenizer

TABLES = "vocab.tables.weight"


@dataclass
class Expansion:
    run_dir: Path
    old_vocab: int
    new_vocab: int
    parameters_added: int
    # prepare-data commands that tokenize the data anew
    prepare: list[str] = field(default_factory=list)
    data: str | None = None  # the --set that trains on their output

    def summary(self) -> str:
        done = f"expanded {self.old_vocab} -> {self.new_vocab} tokens, {self.parameters_added} parameters added"
        train = [
            "mhf-dist",
            "train",
            "--run-dir",
            str(self.run_dir),
            "--config",
            str(self.run_dir / "config.yaml"),
        ]
        if not self.prepare:
            return f"{done}; continue with: {shlex.join(train)}"
        return (
            f"{done}; the run's data was tokenized by the old tokenizer: prepare it with the new one, then "
            "continue on it:\n  "
            + "\n  ".join([*self.prepare, shlex.join([*train, "--set", self.data])])
        )


def data_to_prepare(
    data: DataConfig, tokenizer: Path, fingerprint: str, suffix: str
) -> tuple[list[str], str | None]:
    """The prepare-data commands that tokenize with ``tokenizer`` (whose fingerprint is ``fingerprint``) the data of
    ``data`` that another tokenizer tokenized, and the ``data.*`` setting that names their output; none for the
    embedded text (prepared in the run directory with the run's tokenizer) or data of ``tokenizer`` already."""
    dirs = [s.path for s in data.sources] if data.sources else [data.path] if data.shard_dir else []
    stale = [d for d in dirs if _tokenized_by(d) not in (None, fingerprint)]
    if not stale:
        return [], None
    new = {d: prepared_again(d, suffix) if d in stale else d for d in dirs}
    commands = [prepare_command(d, tokenizer, new[d]) for d in stale]
    if not data.sources:
        return commands, f"data.path={new[data.path]}"
    sources = [s.model_dump(exclude_none=True) | {"path": new[s.path]} for s in data.sources]
    return commands, f"data.sources={json.dumps(sources)}"


def _tokenized_by(shard_dir: str) -> str | None:
    """The tokenizer fingerprint of ``shard_dir``'s manifest; None when it cannot be read (not prepared yet)."""
    try:
        return read_json(f"{shard_dir.rstrip('/')}/{MANIFEST}").get("tokenizer_fingerprint")
    except DataError:
        return None


def check_superset(old: list[str], new: list[str]) -> None:
    """The new vocabulary keeps every old token at its old id."""
    if len(new) <= len(old):
        raise TokenizerError(
            f"the new tokenizer has {len(new)} tokens, not more than the run's {len(old)}: "
            "pass a tokenizer that appends tokens to the run's vocabulary"
        )
    for i, (a, b) in enumerate(zip(old, new)):
        if a != b:
            where = "is missing from" if a not in set(new) else "has another id in"
            raise TokenizerError(
                f"token {a!r} (id {i}) {where} the new tokenizer (id {i} is {b!r} there): the new "
                "vocabulary must be a superset of the old one with every old id kept"
            )


def mean_initialised_rows(table: torch.Tensor, old_tok, new_tok, new_ids: range) -> torch.Tensor:
    """Rows for ``new_ids``: the mean of the old rows of each token's text under the old tokenizer."""
    rows = []
    for i in new_ids:
        pieces = old_tok.encode(new_tok.decode([i]), add_special_tokens=False)
        rows.append(table[pieces].mean(dim=0) if pieces else table[: len(old_tok)].mean(dim=0))
    return torch.stack(rows)


def expand_vocab(
    run_dir: str | Path,
    tokenizer: str | Path,
    out: str | Path | None = None,
    trainable_blocks: int | None = None,
    overrides: list[str] = (),
    overwrite: bool = False,
) -> Expansion:
    trained = trained_weights(run_dir)
    cfg, state = trained.cfg, dict(trained.state)
    if cfg.model.engram is not None:
        raise ConfigError(
            "expand-vocab: the Engram memory's N-gram hashes depend on the compressed vocabulary size "
            "(docs/spec.md §8), which new tokens change; vocabulary expansion is not supported with "
            "model.engram"
        )
    old_tok, new_tok = load_tokenizer(trained.run.tokenizer_source(cfg)), load_tokenizer(tokenizer)
    old_tokens, new_tokens = vocabulary(old_tok), vocabulary(new_tok)
    check_superset(old_tokens, new_tokens)
    out = RunDir(
        check_target(
            out or Path(run_dir).with_name(f"{Path(run_dir).name}-vocab{len(new_tokens)}"),
            [run_dir],
            overwrite,
        )
    )

    old_table = (
        SignatureTable.load(trained.run.signatures_dir) if variant(cfg).needs_signatures else None
    )
    table = old_table.extend(new_tokens[len(old_tokens) :]) if old_table is not None else None
    if table is None:
        old = state[TABLES][0]
        rows = cfg.model.padded_vocab_rows(len(new_tokens))
        grown = old.new_zeros(rows, old.shape[1])
        grown[: len(old_tokens)] = old[: len(old_tokens)]
        grown[len(old_tokens) : len(new_tokens)] = mean_initialised_rows(
            old, old_tok, new_tok, range(len(old_tokens), len(new_tokens))
        )
        state[TABLES] = grown[None]

    raw = cfg.model_dump(mode="json") | {"preset": None}
    if (
        cfg.data.path is None
    ):  # the source trained on the embedded text (a tiny preset): say so, as the preset did
        raw["data"]["path"] = EMBEDDED_CORPUS
    raw["tokenizer"] = {"path": str(out.tokenizer_dir.resolve())}
    raw["train"] |= {"init_from": INIT_WEIGHTS, "trainable_blocks": trainable_blocks}
    for assignment in overrides:
        raw = apply_override(raw, assignment)
    new_cfg = RunConfig.model_validate(raw)

    before = build_model(
        cfg.model, len(old_tokens), old_table.codes if old_table is not None else None
    )
    after_model = build_model(
        new_cfg.model, len(new_tokens), table.codes if table is not None else None
    )
    after_model.load_state_dict(state)  # the expanded weights fit the expanded model exactly

    with staged(out.path) as tmp:
        save_initialised_run(
            RunDir(tmp),
            new_cfg,
            new_tok,
            table,
            state,
            {"source": str(trained.checkpoint), "expanded_from_vocab": str(len(old_tokens))},
        )
    added = after_model.parameter_counts()["total"] - before.parameter_counts()["total"]
    prepare, data = data_to_prepare(
        new_cfg.data, out.tokenizer_dir, tokens_fingerprint(new_tokens), f"vocab{len(new_tokens)}"
    )
    return Expansion(out.path, len(old_tokens), len(new_tokens), added, prepare, data)
