"""``mhf-dist import-hf``: a model in the authors' layout (docs/spec.md §9) as a run directory to continue from.

Reads ``config.json``, the safetensors weights (one file or an index of shards) and the tokenizer of a Hugging Face
directory, one of the authors' ``qwen3_hashformer`` checkpoints or our ``export-hf``, and writes ``RUN/config.yaml``
(``train.init_from`` pointing at the weights), ``RUN/init/model.safetensors`` (our names, fp32), ``RUN/tokenizer/``,
``RUN/signatures/`` (``model.hash_map`` itself: the weights were trained with it, so it is never rebuilt) and
``RUN/import-report.json`` (``ImportReport``: every token whose signature differs from a fresh docs/spec.md §1 build
for the same tokenizer, and every signature several tokens share; such a table imports as non-unique). Only random
hash coordinates (``num_lsh = 0``) are supported, as docs/spec.md §9 fixes. What a user sees, and how the config is
made: docs/models.md, "Import: ``import-hf``".
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from huggingface_hub.errors import StrictDataclassError
from safetensors.torch import load_file, save_file

from mhf_dist.config import ConfigError, RunConfig, apply_override, deep_merge
from mhf_dist.hf.configuration_multihashformer import MultiHashFormerConfig
from mhf_dist.hf.exporter import RUN_CONFIG
from mhf_dist.hf.names import HFImportError, from_export
from mhf_dist.model import build_model
from mhf_dist.model.variants import VARIANTS, variant
from mhf_dist.storage.output_dir import check_target, staged
from mhf_dist.storage.run_dir import RunDir
from mhf_dist.vocab.signatures import HASH_VERSION, SignatureTable
from mhf_dist.vocab.token_list import vocabulary
from mhf_dist.vocab.tokenizers import load_tokenizer

INIT_WEIGHTS = "init/model.safetensors"
REPORT = "import-report.json"


def read_weights(src: Path) -> dict[str, torch.Tensor]:
    """All tensors of a Hugging Face directory: ``model.safetensors`` or the shards its index lists."""
    index = src / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (src / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise HFImportError(
            f"{src} has no model.safetensors (or index): export the weights as safetensors"
        )
    state = {}
    for name in files:
        if not (src / name).is_file():
            raise HFImportError(f"{src / name} is missing: copy every shard the index lists")
        state |= load_file(str(src / name))
    return state


REQUIRED_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
# read by transformers besides a config's fields: the remote-code map, and older spellings of dtype and RoPE
LOADER_KEYS = ("auto_map", "torch_dtype", "rope_theta", "rope_scaling")
# ours beside a config's fields: how the run read its rows (data.document_masking; hf_config writes it when true)
RUN_KEYS = ("document_masking",)


def read_config(path: Path) -> dict:
    """``config.json``, checked to be JSON, to name the architecture and to hold fields of the right types;
    keys that nothing reads are warned about."""
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HFImportError(
            f"{path} is not valid JSON ({e}); copy or export the model again"
        ) from None
    missing = [k for k in REQUIRED_KEYS if not isinstance(config, dict) or k not in config]
    if missing:
        raise HFImportError(
            f"{path} lacks {', '.join(missing)}: it is not a complete Qwen3 / qwen3_hashformer "
            "config; copy or export the model again"
        )
    unknown = sorted(
        set(config) - set(MultiHashFormerConfig().to_dict()) - set(LOADER_KEYS) - set(RUN_KEYS)
    )
    if unknown:  # a misspelt key leaves its field at the default, which may only show as weights that do not fit
        print(
            f"warning: {path} has keys that neither transformers' Qwen3 config nor mhf-dist reads, ignored: "
            f"{', '.join(unknown)}",
            file=sys.stderr,
        )
    check_fields(config, path)
    return config


def check_fields(config: dict, path: Path) -> None:
    """Every field of ``config`` of the type transformers' config takes: the tokenizer and the model load through
    it, so a bad field is named here rather than as a tokenizer that cannot load."""
    try:
        MultiHashFormerConfig(**config)
    except (StrictDataclassError, TypeError, ValueError) as e:
        raise HFImportError(
            f"{path}: {' '.join(str(e).split())}; correct that field (transformers' Qwen3Config "
            "documents each), or copy or export the model again"
        ) from None


def check_shapes(
    cfg: RunConfig,
    vocab_size: int,
    codes: torch.Tensor | None,
    state: dict[str, torch.Tensor],
    src: Path,
) -> None:
    """The weights must be exactly the parameters of the model ``config.json`` describes."""
    with torch.device("meta"):  # shapes only: no memory for a multi-billion-parameter model
        expected = {
            k: v.shape for k, v in build_model(cfg.model, vocab_size, codes).state_dict().items()
        }
    problems = [
        f"{k}: weights {tuple(state[k].shape)}, config {tuple(shape)}"
        for k, shape in expected.items()
        if k in state and state[k].shape != shape
    ]
    problems += [f"{k}: missing from the weights" for k in expected if k not in state]
    problems += [f"{k}: not a parameter of this model" for k in state if k not in expected]
    if problems:
        raise HFImportError(
            f"the weights in {src} do not fit its config.json ({'; '.join(problems[:5])}"
            f"{'; ...' if len(problems) > 5 else ''}): the files come from different models; copy "
            "or export the model again"
        )


def model_config_from_hf(config: dict) -> dict:
    """Our ``model`` section from a Qwen3 / qwen3_hashformer ``config.json``."""
    rope = config.get("rope_parameters") or {}
    head_dim = config.get("head_dim")
    if head_dim == config["hidden_size"] // config["num_attention_heads"]:
        head_dim = None  # our default
    model = dict(
        d_model=config["hidden_size"],
        n_layers=config["num_hidden_layers"],
        n_heads=config["num_attention_heads"],
        n_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
        head_dim=head_dim,
        ffn_dim=config["intermediate_size"],
        rope_theta=rope.get("rope_theta", config.get("rope_theta", 1_000_000.0)),
        norm_eps=config.get("rms_norm_eps", 1e-6),
    )
    try:  # the variant whose record reads this config.json (its HFNames.model_section)
        found = [
            (spec.name, keys)
            for spec in VARIANTS.values()
            if (keys := spec.hf.model_section(config)) is not None
        ]
    except ValueError as e:
        raise HFImportError(str(e)) from None
    if len(found) != 1:
        raise HFImportError(
            f"config.json is read as {len(found)} model variants ({', '.join(n for n, _ in found)}), "
            "not one: check the variants' HFNames.model_section (mhf_dist/model/variants.py)"
        )
    name, keys = found[0]
    return model | {"variant": name} | keys


@dataclass
class ImportReport:
    run_dir: Path
    variant: str
    vocab_size: int
    # tokens whose signature differs from a fresh build
    differing: list[dict] = field(default_factory=list)
    # groups of token ids sharing one signature
    shared: list[list[int]] = field(default_factory=list)

    def summary(self) -> str:
        lines = [f"imported a {self.variant} model ({self.vocab_size} tokens) into {self.run_dir}"]
        if variant(self.variant).needs_signatures:
            lines.append(
                f"signatures: {len(self.differing)} differ from a fresh docs/spec.md §1 build, "
                f"{len(self.shared)} shared by several tokens (details: {self.run_dir / REPORT})"
            )
            lines += [
                f"  id {d['id']} {d['token']!r}: imported {d['imported']}, fresh {d['fresh']}"
                for d in self.differing[:10]
            ]
        return "\n".join(lines)


def imported_table(
    codes: torch.Tensor, tokens: list[str], num_buckets: int, rule: dict | None, pad_id: int | None
) -> tuple[SignatureTable, list[dict], list[list[int]]]:
    """(the table as imported, differences from a fresh build, shared signatures)."""
    groups = defaultdict(list)
    for i, row in enumerate(codes.tolist()):
        if any(row):
            groups[tuple(row)].append(i)
    shared = [ids for ids in groups.values() if len(ids) > 1]
    h = codes.shape[1]
    rule = rule or {
        "seeds": list(range(h)),
        "unique": not shared,
        "pad_id": pad_id,
        "hash_version": HASH_VERSION,
    }
    table = SignatureTable(
        codes=codes.to(torch.int32),
        num_buckets=num_buckets,
        seeds=tuple(rule["seeds"]),
        tokens=tuple(tokens),
        unique=rule["unique"] and not shared,
        pad_id=rule["pad_id"],
        hash_version=rule["hash_version"],
    )
    single_id = h > 1 and not any(table.seeds)
    fresh = SignatureTable.build(
        tokens, h, num_buckets, pad_id=table.pad_id, unique=table.unique, single_id=single_id
    )
    differing = [
        {
            "id": i,
            "token": tokens[i],
            "imported": table.codes[i].tolist(),
            "fresh": fresh.codes[i].tolist(),
        }
        for i in torch.nonzero((table.codes != fresh.codes).any(dim=1)).flatten().tolist()
    ]
    return table, differing, shared


def import_hf(
    src: str | Path, run_dir: str | Path, overrides: list[str] = (), overwrite: bool = False
) -> ImportReport:
    src = Path(src)
    if not (src / "config.json").is_file():
        raise HFImportError(f"{src} has no config.json: pass a Hugging Face model directory")
    final = RunDir(check_target(run_dir, [src], overwrite))
    config = read_config(src / "config.json")
    tokenizer = load_tokenizer(src)
    tokens, vocab_size = vocabulary(tokenizer), len(tokenizer)

    raw = yaml.safe_load((src / RUN_CONFIG).read_text()) if (src / RUN_CONFIG).is_file() else {}
    raw.pop("exported_step", None)
    raw = deep_merge(
        raw,
        {
            "model": model_config_from_hf(config),
            "preset": None,
            "tokenizer": {"path": str(final.tokenizer_dir.resolve())},
            "train": {"init_from": INIT_WEIGHTS},
        },
    )
    if "inference_temperature" in config:  # what the model's logits apply
        raw = deep_merge(raw, {"inference": {"temperature": config["inference_temperature"]}})
    if "document_masking" in config:
        raw = deep_merge(raw, {"data": {"document_masking": bool(config["document_masking"])}})
    for assignment in overrides:
        raw = apply_override(raw, assignment)
    try:
        cfg = RunConfig.model_validate(raw)
    except ValueError as e:
        raise ConfigError(f"the imported config is invalid: {e}") from None

    spec = variant(cfg)
    state, codes = from_export(read_weights(src), spec.heads(cfg.model))
    report = ImportReport(final.path, cfg.model.variant, vocab_size)
    if spec.needs_signatures:
        if codes is None:
            raise HFImportError(
                f"{src} has no model.hash_map: the signature table must be saved with the weights"
            )
        if codes.shape[0] < vocab_size or codes[vocab_size:].any():
            raise HFImportError(
                f"model.hash_map has {codes.shape[0]} rows but the tokenizer {vocab_size} tokens "
                "(rows past the tokenizer must be all zero): use the tokenizer saved with the model"
            )
        table, report.differing, report.shared = imported_table(
            codes[:vocab_size],
            tokens,
            cfg.model.hash.num_buckets,
            config.get("signature_rule"),
            tokenizer.pad_token_id,
        )
    else:  # Standard: pad the table back to pad_vocab_to rows (the padding is never predicted)
        table, weight = None, state["vocab.tables.weight"]
        rows = cfg.model.padded_vocab_rows(vocab_size)
        state["vocab.tables.weight"] = torch.cat(
            [weight, weight.new_zeros(1, rows - weight.shape[1], weight.shape[2])], dim=1
        )

    check_shapes(cfg, vocab_size, table.codes if table is not None else None, state, src)
    with staged(final.path) as tmp:
        run = RunDir(tmp)
        save_initialised_run(
            run,
            cfg,
            tokenizer,
            table,
            {k: v.float() for k, v in state.items()},
            {"source": str(src.resolve())},
        )
        (run.path / REPORT).write_text(
            json.dumps(
                {
                    "source": str(src.resolve()),
                    "differing": report.differing,
                    "shared": report.shared,
                },
                indent=1,
                ensure_ascii=False,
            )
        )
    return report


def save_initialised_run(
    run: RunDir,
    cfg: RunConfig,
    tokenizer,
    table: SignatureTable | None,
    state: dict[str, torch.Tensor],
    metadata: dict[str, str],
) -> None:
    """Write a run directory that starts from ``state`` (``train.init_from`` = ``INIT_WEIGHTS``, saved with
    ``metadata``): its tokenizer, its signature table (MHF), the weights and ``cfg``."""
    tokenizer.save_pretrained(run.tokenizer_dir)
    if table is not None:
        table.save(run.signatures_dir)
    (run.path / INIT_WEIGHTS).parent.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in state.items()},
        str(run.path / INIT_WEIGHTS),
        metadata=metadata,
    )
    run.save_config(cfg)
