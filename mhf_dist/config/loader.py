"""A run's config from a preset, then a YAML file (which may itself name a ``preset:`` to start from), then
``--set a.b=c`` overrides, in that order; validated once at the end."""

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
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def apply_override(raw: dict, assignment: str) -> dict:
    """Apply one ``a.b.c=value`` (value parsed as YAML) to a raw config dict."""
    key, sep, text = assignment.partition("=")
    if not sep or not key:
        raise ConfigError(f"--set {assignment!r}: expected key=value, e.g. --set model.hash.num_buckets=4096")
    value = yaml.safe_load(text) if text else None
    return deep_merge(raw, _nest(key.strip().split("."), value))


def _nest(path: list[str], value: Any) -> dict:
    return {path[0]: value if len(path) == 1 else _nest(path[1:], value)}


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "config"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field; check its spelling (see `mhf-dist config --preset NAME` for valid keys)"
        lines.append(f"  {where}: {msg}")
    return "invalid run config:\n" + "\n".join(lines)


def load_config(preset_name: str | None = None, path: str | Path | None = None, overrides: list[str] = ()) -> RunConfig:
    """Preset, then YAML file, then ``--set`` overrides; validated once at the end."""
    raw: dict[str, Any] = {}
    named = False  # whether a config file or --set names train.micro_batch_size
    if path is not None:
        try:
            from_file = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"cannot read config file {path}: {e}") from e
        if not isinstance(from_file, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
        preset_name = preset_name or from_file.get("preset")
        raw = from_file
        named = isinstance(from_file.get("train"), dict) and "micro_batch_size" in from_file["train"]
    if preset_name:
        raw = deep_merge(preset(preset_name), raw)
    if not raw:
        raise ConfigError("no configuration: pass --preset NAME (e.g. tiny-h4b16k) or --config run.yaml")
    for assignment in overrides:
        raw = apply_override(raw, assignment)
        named |= assignment.partition("=")[0].strip() == "train.micro_batch_size"
    try:
        cfg = RunConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_format_errors(e)) from None
    cfg.train._micro_batch_from_preset = preset_name is not None and not named
    return cfg
