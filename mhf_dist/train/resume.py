"""The config a run resumes with when ``train`` names only its run directory (no ``--preset``/``--config``).

The run's own ``config.yaml`` (written at every start) is the base and ``--set`` overrides apply on top. A field
the checkpoint fixes (the model, the tokenizer, ``data.seq_len``, the seed, ...) must equal the checkpoint's, whether
an override or a hand edit of ``config.yaml`` changed it: the refusal names the field and its checkpoint value.
The fields in ``CHANGEABLE_ON_RESUME`` may differ: steps, intervals, logging, checkpoint settings, the
optimizer (``mhf_dist.train.optim.apply_optimizer_changes``), the layout (checkpoints convert), the data source
(``mhf_dist.config.DataConfig.restart``) and how the run computes. The checkpoint's config is read from its
``complete.json``; one saved before markers held it is compared by its model section only.

No torch here: the command line checks this before it starts any rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from mhf_dist.config import CONFIG_FILE, ConfigError, ModelConfig, RunConfig, load_config
from mhf_dist.storage.run_dir import RunDir
from mhf_dist.train.checkpoint.index import complete_checkpoints, read_marker
from mhf_dist.train.checkpoint.store import checkpoint_store

CHANGEABLE_ON_RESUME = (
    "optimizer",
    "parallel",
    "inference",
    "model.engram.offload_update",
    "model.engram.offload_shards",
    "model.engram.host_budget_gb",
    "data.restart",
    "data.path",
    "data.sources",
    "data.shuffle_seed",
    "data.shuffle_window",
    "data.on_bad_shard",
    "data.verify_checksums",
    "data.allow_pipe",
    "train.max_steps",
    "train.stop_at_step",
    "train.micro_batch_size",
    "train.log_interval",
    "train.eval_interval",
    "train.eval_sequences",
    "train.eval_tasks",
    "train.eval_tasks_path",
    "train.eval_tasks_interval",
    "train.eval_tasks_samples",
    "train.checkpoint_interval",
    "train.checkpoint_minutes",
    "train.keep_checkpoints",
    "train.checkpoint_dir",
    "train.checkpoint_staging",
    "train.on_nonfinite",
    "train.max_nonfinite_steps",
    "train.spike_factor",
    "train.grad_spike_factor",
    "train.on_spike",
    "train.spike_patience",
    "train.max_rollbacks",
    "train.peak_tflops",
    "train.compile",
    "train.fused_head_kernel",
    "train.dist_backend",
    "train.dist_timeout_minutes",
    "train.wandb",
    "train.hang_timeout_s",
    "train.first_step_timeout_s",
    "train.peer_timeout_s",
    "train.straggler_factor",
    "train.straggler_intervals",
    "train.device_probe",
    "train.health_metrics",
    "train.callbacks",
    "train.z_loss_weight",
    "train.profile_steps",
    "train.profile_window",
    "train.profile_ranks",
)


def changeable_on_resume(field: str) -> bool:
    """Whether the dotted ``field`` may differ from the checkpoint's config when a run resumes."""
    return any(field == name or field.startswith(name + ".") for name in CHANGEABLE_ON_RESUME)


def differences(before: dict, after: dict, prefix: str = "") -> dict[str, tuple[Any, Any]]:
    """``{dotted field: (before, after)}`` for every value that differs; a field only one side has (a config of
    another version) is not compared."""
    found = {}
    for key, old in before.items():
        if key not in after:
            continue
        new, name = after[key], prefix + key
        if isinstance(old, dict) and isinstance(new, dict):
            found |= differences(old, new, name + ".")
        elif old != new:
            found[name] = (old, new)
    return found


def resume_config(run_dir: str | Path, overrides: list[str], resume: str) -> RunConfig:
    """``RUN/config.yaml`` with ``overrides``, checked against the checkpoint ``resume`` names (auto: the newest
    complete one)."""
    path = RunDir(run_dir).config_path
    if not path.is_file():
        raise ConfigError(
            f"no configuration: {run_dir} holds no {CONFIG_FILE} to resume with; pass --preset NAME "
            "(e.g. tiny-h4b16k) or --config run.yaml"
        )
    written, cfg = load_config(path=path), load_config(path=path, overrides=overrides)
    store = checkpoint_store(RunDir(run_dir), cfg.train)
    if (
        store.url is not None
    ):  # object storage: named now when it cannot be used, before any rank starts
        store.check()
        checkpoint, marker = store.resumed_marker(resume)
    else:
        checkpoint = _resumed_checkpoint(store.local, resume)
        marker = None if checkpoint is None else read_marker(checkpoint)
    if marker is not None:
        _check_fixed_fields(
            checkpoint, marker, written.model_dump(mode="json"), cfg.model_dump(mode="json"), path
        )
    return cfg


def _resumed_checkpoint(checkpoints: Path, resume: str) -> Path | None:
    """The checkpoint the start will load from the directory ``checkpoints``, as the training loop picks it
    (``--resume`` auto, none or a path)."""
    if resume == "none":
        return None
    if resume == "auto":
        found = complete_checkpoints(checkpoints)
        return found[-1] if found else None
    return Path(resume)


def _check_fixed_fields(
    checkpoint: str | Path, marker: dict, written: dict, resolved: dict, path: Path
) -> None:
    """Refuse a fixed field of ``resolved`` (config.yaml, then ``--set``) that differs from the checkpoint's (its
    ``marker``'s), naming where it changed: an override, or ``written`` (config.yaml as it is) edited by hand."""
    saved = _checkpoint_config(marker)
    fixed = {k: v for k, v in differences(saved, resolved).items() if not changeable_on_resume(k)}
    if not fixed:
        return
    set_here = differences(written, resolved)
    sources = {field: "--set" if field in set_here else f"edited in {path}" for field in fixed}
    lines = [
        f"{field}: {new!r}, the checkpoint's is {old!r} ({sources[field]})"
        for field, (old, new) in fixed.items()
    ]
    undo = [
        fix
        for fix, needed in (
            ("drop those --set", "--set" in sources.values()),
            (f"set them back in {path}", f"edited in {path}" in sources.values()),
        )
        if needed
    ]
    raise ConfigError(
        f"{checkpoint} was trained with other values of fields a resume cannot change:\n  "
        + "\n  ".join(lines)
        + f"\nresume with the checkpoint's values ({' and '.join(undo)}), or train a new run directory (--run-dir) "
        "for the new ones. A resume may change: " + _changeable_summary()
    )


def _checkpoint_config(marker: dict) -> dict:
    """The run config a checkpoint was saved with (its marker's), as this version writes it where it validates."""
    if "config" in marker:
        return _as_written_now(RunConfig, marker["config"])
    return {"model": _as_written_now(ModelConfig, marker["model"])}


def _as_written_now(kind: type[BaseModel], raw: dict) -> dict:
    try:
        return kind.model_validate(raw).model_dump(mode="json")
    except ValidationError:  # compared as stored, naming what differs
        return raw


def _changeable_summary() -> str:
    """``CHANGEABLE_ON_RESUME``, grouped by section: ``optimizer.*, ..., train.{max_steps, ...}``."""
    groups: dict[str, list[str]] = {}
    for name in CHANGEABLE_ON_RESUME:
        section, _, rest = name.partition(".")
        groups.setdefault(section, []).append(rest)
    return ", ".join(
        f"{s}.*"
        if fields == [""]
        else f"{s}.{fields[0]}"
        if len(fields) == 1
        else f"{s}.{{{', '.join(fields)}}}"
        for s, fields in groups.items()
    )
