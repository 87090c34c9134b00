"""What a training job will take, from its config and cluster profile alone: time per step (``step_seconds``, with the
FLOPs that MFU counts in training, ``mhf_dist.model.flops``), checkpoint size (``checkpoint_bytes``, from
``mhf_dist.model.parameter_count``), save time (``save_seconds``) and the grace period a save on the scheduler's
warning signal needs (``mhf_dist.train.preemption.grace_seconds``). Nothing here imports torch: ``plan`` prints these
estimates and ``submit`` sizes the job's ``--signal`` from them on a login node. The formulas: docs/configuration.md
("How plan counts").
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mhf_dist.backend import checkpoint_interval, engine_config
from mhf_dist.cluster.profile import ClusterProfile
from mhf_dist.config import ConfigError, RunConfig
from mhf_dist.model.flops import forward_flops
from mhf_dist.model.parameter_count import parameter_count
from mhf_dist.model.variants import variant
from mhf_dist.parallel.layout import resolve_layout
from mhf_dist.remote import is_url
from mhf_dist.train.preemption import grace_seconds

DEFAULT_MFU = 0.40
PLANNING_VOCAB_SIZE = (
    32768  # the tokenizer size estimates assume (only Standard's tables depend on it)
)


@dataclass(frozen=True)
class StepEstimate:
    """One optimizer step at an assumed MFU (docs/configuration.md, "How plan counts")."""

    mfu: float
    peak_flops: float  # all devices together
    tokens_per_step: int
    flops_per_token: int  # model FLOPs, 3 × forward
    recompute_per_token: int  # forward FLOPs of the checkpointed blocks, done again in backward
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.seconds

    @property
    def hfu(self) -> float:
        """Hardware FLOPs utilisation implied by the assumed MFU: ``MFU · (F + recompute) / F``."""
        return self.mfu * (self.flops_per_token + self.recompute_per_token) / self.flops_per_token


def device_of(profile: ClusterProfile) -> str:
    """The device type of a profile's ranks (its DeepSpeed config depends on it)."""
    return "cpu" if profile.backend == "gloo" else "cuda"


def step_seconds(tokens: int, flops_per_token: float, mfu: float, peak_flops: float) -> float:
    """Seconds per optimizer step: ``T · F / (MFU · peak)`` for ``peak`` FLOP/s of all devices together."""
    return tokens * flops_per_token / (mfu * peak_flops)


def step_estimate(
    cfg: RunConfig,
    profile: ClusterProfile,
    nodes: int,
    mfu: float = DEFAULT_MFU,
    vocab_size: int = PLANNING_VOCAB_SIZE,
) -> StepEstimate | None:
    """Time and throughput of one optimizer step at an assumed ``mfu``; None when the profile gives no nominal
    peak (``peak_bf16_tflops``)."""
    if not 0 < mfu <= 1:
        raise ConfigError(f"--mfu {mfu:g} is not a fraction in (0, 1]; pass e.g. --mfu 0.4")
    if profile.peak_bf16_tflops is None:
        return None
    world = nodes * profile.gpus_per_node
    layout = resolve_layout(cfg, world)
    m = cfg.model
    rows = variant(m).vocab_rows(m, vocab_size)
    flops = forward_flops(m, cfg.data.seq_len, rows)
    k = checkpoint_interval(cfg, engine_config(cfg, layout, device_of(profile)))
    recompute = sum(flops.layer(i) for i in range(m.n_layers) if k and i % k == 0)
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    peak = profile.peak_bf16_tflops * 1e12 * world
    return StepEstimate(
        mfu=mfu,
        peak_flops=peak,
        tokens_per_step=tokens,
        flops_per_token=flops.train,
        recompute_per_token=recompute,
        seconds=step_seconds(tokens, flops.train, mfu, peak),
    )


def checkpoint_bytes(cfg: RunConfig, pp: int, vocab_size: int = PLANNING_VOCAB_SIZE) -> int:
    """The size of one checkpoint of ``cfg`` trained with ``pp`` pipeline stages (docs/configuration.md, "How plan
    counts")."""
    count = parameter_count(cfg.model, vocab_size)
    master_and_moments = 12
    if pp == 1:
        saved = master_and_moments * count.trained_by_engine
    else:
        weights = 2 if cfg.train.dtype == "bf16" else 4
        saved = (master_and_moments + weights) * (count.trained_by_engine + count.vocab_tables)
    return saved + master_and_moments * count.host_tables


def save_seconds(size: float, nodes: int, storage_gb_per_s: float) -> float:
    """Seconds to write ``size`` bytes from ``nodes`` nodes, each at ``storage_gb_per_s``."""
    return size / (nodes * storage_gb_per_s * 1e9)


@dataclass(frozen=True)
class SaveEstimate:
    """One checkpoint of a job: its size, the time to write it, and the grace period a save on the signal needs."""

    bytes: int
    seconds: float  # the local write, then (a URL train.checkpoint_dir) the upload
    step_seconds: float | None  # None: the profile gives no peak to estimate a step from
    storage_gb_per_s: float
    upload_gb_per_s: float | None = None  # None: the checkpoints stay on a file system

    @property
    def rates(self) -> str:
        """How the time was reckoned, for messages."""
        written = f"{self.storage_gb_per_s:g} GB/s per node (profile storage_gb_per_s)"
        if self.upload_gb_per_s is None:
            return written
        return f"{written}, then uploaded at {self.upload_gb_per_s:g} GB/s per node (profile upload_gb_per_s)"

    @property
    def grace(self) -> int:
        return grace_seconds(self.step_seconds or 0.0, self.seconds)


def save_estimate(
    cfg: RunConfig, profile: ClusterProfile, nodes: int, vocab_size: int = PLANNING_VOCAB_SIZE
) -> SaveEstimate:
    """The checkpoints of ``cfg`` on ``nodes`` nodes of ``profile`` (step time at ``DEFAULT_MFU``); a save into
    object storage (a URL ``train.checkpoint_dir``) is written into staging, then uploaded."""
    layout = resolve_layout(cfg, nodes * profile.gpus_per_node)
    size = checkpoint_bytes(cfg, layout.pp, vocab_size)
    step = step_estimate(cfg, profile, nodes, vocab_size=vocab_size)
    upload = profile.upload_gb_per_s if is_url(cfg.train.checkpoint_dir) else None
    seconds = save_seconds(size, nodes, profile.storage_gb_per_s)
    return SaveEstimate(
        bytes=size,
        seconds=seconds + (save_seconds(size, nodes, upload) if upload else 0.0),
        step_seconds=step.seconds if step else None,
        storage_gb_per_s=profile.storage_gb_per_s,
        upload_gb_per_s=upload,
    )


_TIME_LIMIT = re.compile(r"(?:(?P<days>\d+)-)?(?P<a>\d+)(?::(?P<b>\d+))?(?::(?P<c>\d+))?")


def time_limit_seconds(limit: str) -> int | None:
    """A SLURM ``--time`` value in seconds (``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``,
    ``D-HH:MM:SS``); None for ``UNLIMITED``/``INFINITE``."""
    if limit.strip().upper() in ("UNLIMITED", "INFINITE"):
        return None
    m = _TIME_LIMIT.fullmatch(limit.strip())
    if m is None:
        raise ConfigError(
            f"--time={limit!r} is not a SLURM time limit (e.g. 30, 24:00:00 or 2-00:00:00)"
        )
    days, parts = int(m["days"] or 0), [int(p) for p in (m["a"], m["b"], m["c"]) if p is not None]
    if m["days"]:  # D-HH[:MM[:SS]]
        hours, minutes, seconds = (parts + [0, 0])[:3]
    elif len(parts) == 3:
        hours, minutes, seconds = parts
    else:  # MM[:SS]
        hours, (minutes, seconds) = 0, (parts + [0])[:2]
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds
