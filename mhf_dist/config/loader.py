"""A run's config from a preset, then a YAML file (which may itself name a ``preset:`` to start from), then
``--set a.b=c`` overrides, in that order; validated once at the end. ``config_yaml`` writes a config as the file
that loads back as it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from mhf_dist.config.presets import preset
from mhf_dist.config.schema import RunConfig
from mhf_dist.errors import ConfigError


def deep_merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = (
            deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        )
    return out


def apply_override(raw: dict, assignment: str) -> dict:
    """Apply one ``a.b.c=value`` (value parsed as YAML) to a raw config dict."""
    key, sep, text = assignment.partition("=")
    if not sep or not key:
        raise ConfigError(
            f"--set {assignment!r}: expected key=value, e.g. --set model.hash.num_buckets=4096"
        )
    value = yaml.safe_load(text) if text else None
    return deep_merge(raw, _nest(key.strip().split("."), value))


def _data_replaced(raw: dict, overrides: list[str]) -> dict:
    """``raw`` without its data of the kind the overrides do not name when they name the other: a ``--set data.path``
    replaces a file's ``data.sources``, and a ``--set data.sources`` its ``data.path`` (both set by ``--set`` still
    clash)."""
    named = {assignment.partition("=")[0].strip() for assignment in overrides}
    data = raw.get("data")
    for key, other in (("path", "sources"), ("sources", "path")):
        if isinstance(data, dict) and f"data.{key}" in named and f"data.{other}" not in named:
            raw = raw | {"data": {k: v for k, v in data.items() if k != other}}
    return raw


def _nest(path: list[str], value: Any) -> dict:
    return {path[0]: value if len(path) == 1 else _nest(path[1:], value)}


def _format_errors(err: ValidationError, source: str = "") -> str:
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "config"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field; check its spelling (see `mhf-dist config --preset NAME` for valid keys)"
        lines.append(f"  {where}: {msg}")
    return f"invalid run config{source}:\n" + "\n".join(lines)


def read_config_file(path: str | Path) -> dict:
    """The mapping a YAML config file holds (empty: ``{}``); a file that cannot be read, is not UTF-8 or not YAML,
    or holds something else is a ``ConfigError`` naming the file and the problem."""
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"cannot read config file {path}: it is not UTF-8 text (byte 0x{e.object[e.start]:02x} at "
            f"offset {e.start}); fix or replace the file"
        ) from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        for mark in (getattr(e, "context_mark", None), getattr(e, "problem_mark", None)):
            if mark is not None:
                mark.name = str(path)  # yaml says "<unicode string>" for text it was handed
        raise ConfigError(f"cannot read config file {path}: it is not valid YAML:\n{e}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(
            f"config file {path} must hold a mapping at the top level, not a {type(raw).__name__}"
        )
    return raw


def load_config(
    preset_name: str | None = None, path: str | Path | None = None, overrides: list[str] = ()
) -> RunConfig:
    """Preset, then YAML file, then ``--set`` overrides; validated once at the end."""
    raw: dict[str, Any] = {}
    named = False  # whether a config file or --set names train.micro_batch_size
    if path is not None:
        from_file = read_config_file(path)
        preset_name = preset_name or from_file.get("preset")
        raw = from_file
        named = (
            isinstance(from_file.get("train"), dict) and "micro_batch_size" in from_file["train"]
        )
    if preset_name:
        # the preset whose values it holds
        raw = deep_merge(preset(preset_name), raw) | {"preset": preset_name}
    if not raw:
        raise ConfigError(
            "no configuration: pass --preset NAME (e.g. tiny-h4b16k) or --config run.yaml"
        )
    raw = _data_replaced(raw, overrides)
    for assignment in overrides:
        raw = apply_override(raw, assignment)
        named |= assignment.partition("=")[0].strip() == "train.micro_batch_size"
    try:
        cfg = RunConfig.model_validate(raw)
    except ValidationError as e:
        source = f" ({path}{' with --set' if overrides else ''})" if path is not None else ""
        raise ConfigError(_format_errors(e, source)) from None
    cfg.train._micro_batch_from_preset = preset_name is not None and not named
    return cfg


CEILING_NOTE = "the preset's, a ceiling: lowered to fit dp; uncomment to keep it as set"


def config_yaml(cfg: RunConfig) -> str:
    """``cfg`` as a YAML config file that ``load_config(path=...)`` reads back as ``cfg``, at every dp: every field,
    except that a preset's micro-batch (a ceiling, which the layout lowers to fit dp) is a comment, so that the file's
    ``preset:`` supplies it again; a micro-batch the file names is the user's (kept, or refused where it does not fit).
    """
    text = yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
    if not (cfg.train.micro_batch_from_preset and cfg.preset):
        return text
    lines, section = text.splitlines(keepends=True), None
    for i, line in enumerate(lines):
        if not line.startswith(" "):
            section = line.partition(":")[0]
        elif section == "train" and line.startswith("  micro_batch_size: "):
            lines[i] = f"  # {line.strip()}  ({CEILING_NOTE})\n"
            break
    return "".join(lines)
