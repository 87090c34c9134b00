"""Run configuration: pydantic models, presets and ``--set`` overrides.

A run is described by one ``RunConfig``. It comes from a preset (``{size}-{variant}``, e.g. ``tiny-h4b16k``,
``100m-standard+4l``), optionally a YAML file (which may itself name a ``preset:`` to start from), then ``--set a.b=c``
overrides, in that order. Validation happens here, at the edge: every error names the field and the fix.

``schema`` holds the models (the model's own in ``model``, ``train``'s in ``training``), ``presets`` the presets
and ``loader`` ``load_config`` with the overrides; their names are imported from here. The settings:
docs/configuration.md.
"""

from mhf_dist.config.loader import apply_override, deep_merge, load_config
from mhf_dist.config.model import EngramConfig, HashConfig, ModelConfig
from mhf_dist.config.presets import SIZES, preset, preset_names
from mhf_dist.config.schema import (
    CONFIG_FILE,
    EMBEDDED_CORPUS,
    ConfigError,
    DataConfig,
    DataSource,
    Family,
    InferenceConfig,
    OptimizerConfig,
    ParallelConfig,
    ParamGroupRule,
    RunConfig,
    TokenizerConfig,
    check_data_source,
    parse_blend,
)
from mhf_dist.config.training import TrainConfig, WandbConfig

__all__ = [
    "CONFIG_FILE",
    "EMBEDDED_CORPUS",
    "SIZES",
    "ConfigError",
    "DataConfig",
    "DataSource",
    "EngramConfig",
    "Family",
    "HashConfig",
    "InferenceConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "ParamGroupRule",
    "RunConfig",
    "TokenizerConfig",
    "TrainConfig",
    "WandbConfig",
    "apply_override",
    "check_data_source",
    "deep_merge",
    "load_config",
    "parse_blend",
    "preset",
    "preset_names",
]
