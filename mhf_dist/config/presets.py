"""Presets: ``{size}-{variant}[+engram]`` (e.g. ``tiny-h4b16k``, ``100m-standard+4l``) as raw config dicts."""

from __future__ import annotations

import copy
import re
from typing import Any

from mhf_dist.errors import ConfigError

SIZES: dict[str, dict[str, Any]] = {
    # docs/spec.md §6 backbones (from the public code); `tiny` is ours, for CPU tests and demos.
    "tiny": dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=192),
    "100m": dict(d_model=768, n_layers=12, n_heads=12, n_kv_heads=2, ffn_dim=2560),
    "1b": dict(d_model=2048, n_layers=20, n_heads=16, n_kv_heads=8, ffn_dim=6144),
    "3b": dict(d_model=2048, n_layers=36, n_heads=16, n_kv_heads=2, ffn_dim=11008),
    # Ours, with the backbone shapes of Qwen3-8B (6.95B parameters) and Qwen3-14B (13.2B), head_dim 128.
    "7b": dict(d_model=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn_dim=12288),
    "13b": dict(d_model=5120, n_layers=40, n_heads=40, n_kv_heads=8, ffn_dim=17408),
}

# Training defaults per size: the paper's recipe for real sizes, a seconds-scale run for tiny.
_TRAINING = {
    "tiny": dict(
        tokenizer={"path": None, "vocab_size": 4096},
        data={"seq_len": 128},
        optimizer={"lr": 2e-3, "warmup_steps": 10},
        train={"max_steps": 200, "global_batch_size": 8, "micro_batch_size": 8, "dtype": "fp32"},
    ),
    "real": dict(
        tokenizer={"path": "mistral-v0.3"},
        data={"seq_len": 2048},
        optimizer={"lr": 3e-4, "warmup_steps": 2000},
        train={
            "global_batch_size": 256,
            "micro_batch_size": 4,
            "dtype": "bf16",
            "checkpoint_minutes": 30,
        },
    ),
}
# 256 x 2048 tokens per step: 10B tokens at 100M, 100B tokens otherwise (docs/spec.md §6).
_MAX_STEPS = {
    "100m": 10_000_000_000 // (256 * 2048),
    **{size: 100_000_000_000 // (256 * 2048) for size in ("1b", "3b", "7b", "13b")},
}

# H3B10K keeps the public code's B = 10,624 (docs/spec.md §6); other hNbMk read B = M * 1024.
_SPECIAL_BUCKETS = {("3", "10"): 10_624}
_VARIANT = re.compile(
    r"^(?:(?P<std>standard)(?:\+(?P<extra>\d+)l)?|h(?P<h>\d+)b(?P<b>\d+)k)(?P<engram>\+engram)?$"
)


def preset_names() -> list[str]:
    """The canonical presets, each also with ``+engram`` (any ``hNbMk`` and ``standard+kL`` variant also parses)."""
    variants = ["standard", "h1b16k", "h3b10k", "h4b16k"]
    names = [f"{s}-{v}" for s in SIZES for v in variants] + ["100m-standard+4l", "1b-standard+2l"]
    return names + [f"{n}+engram" for n in names]


def preset(name: str) -> dict[str, Any]:
    """The raw config dict of preset ``{size}-{variant}[+engram]``; ``+engram`` adds the docs/spec.md §8 memory with
    its defaults (``EngramConfig``: layers 1 and L/2)."""
    size, _, variant = name.partition("-")
    match = _VARIANT.match(variant)
    if size not in SIZES or not match:
        raise ConfigError(
            f"unknown preset {name!r}: use {{size}}-{{variant}}[+engram] with size in {sorted(SIZES)} and variant "
            "standard, standard+<k>l, h1b16k, h3b10k, h4b16k or h<H>b<B/1024>k (e.g. tiny-h4b16k, 100m-standard+4l, "
            "1b-h4b16k+engram)"
        )
    model = dict(SIZES[size])
    if match["std"]:
        model["variant"] = "standard"
        model["n_layers"] += int(match["extra"] or 0)
    else:
        h, b = match["h"], match["b"]
        buckets = _SPECIAL_BUCKETS.get((h, b), int(b) * 1024)
        # H1 ablation: one hash copied into four coordinates to match parameters (docs/spec.md §6).
        hash_cfg = (
            {"num_hashes": 4, "num_buckets": buckets, "single_id": True}
            if h == "1"
            else {"num_hashes": int(h), "num_buckets": buckets}
        )
        model |= {"variant": "mhf", "hash": hash_cfg}
    if match["engram"]:
        model["engram"] = {}
    cfg = copy.deepcopy(_TRAINING["tiny" if size == "tiny" else "real"])
    if size in _MAX_STEPS:
        cfg["train"]["max_steps"] = _MAX_STEPS[size]
    return {"preset": name, "model": model, **cfg}
