"""``profile --layout``: the tensor-parallel layouts of a sweep, each checked against every configuration it will
measure before any rank starts (the checks ``train`` makes of a run's config: the bucket and vocabulary tables, the
attention heads, the FFN and the Engram tables split over tp; pipeline stages against layers). Nothing here imports
torch."""

from __future__ import annotations

from mhf_dist.config import ConfigError, load_config
from mhf_dist.parallel.layout import backend_name

_TRIED_TP = range(1, 9)  # the layouts a refusal may suggest instead


def parse_layouts(text: str) -> list[int]:
    """The tp of each layout in ``text`` (``tp=1,tp=2``); anything else is a ``ConfigError``."""
    tps = []
    for layout in (part.strip() for part in text.split(",")):
        name, _, value = layout.partition("=")
        if name.strip() != "tp" or not value.strip().isdigit() or int(value) < 1:
            raise ConfigError(
                f"--layout {layout!r}: profile measures tensor-parallel layouts only, written tp=N "
                "(N >= 1) and comma-separated, e.g. --layout tp=1,tp=2"
            )
        tps.append(int(value))
    return tps


def _problem(
    size: str, hash_name: str, tp: int, overrides: list[str], gpus: int | None
) -> str | None:
    """Why ``{size}-{hash_name}`` cannot be profiled at ``tp`` (as the ranks would build it), or None."""
    try:
        cfg = load_config(f"{size}-{hash_name}", overrides=[f"parallel.tp={tp}", *overrides])
    except ConfigError as e:
        # past "invalid run config:", each problem on its line
        lines = str(e).splitlines()[1:] or [str(e)]
        return "\n  ".join(line.strip().removeprefix("config: ") for line in lines)
    if cfg.parallel.pp != 1:
        return f"parallel.pp={cfg.parallel.pp}: profile measures tensor parallelism only (its ranks are one stage)"
    if gpus is not None and tp > gpus and backend_name(cfg.train.dist_backend, "cuda") == "nccl":
        return (
            f"{tp} ranks on {gpus} visible GPU{'s' * (gpus != 1)}: NCCL needs a GPU per rank (or "
            "--set train.dist_backend=gloo, which lets ranks share one)"
        )
    return None


def check_layouts(
    size: str, hashes: list[str], tps: list[int], overrides: list[str], gpus: int | None = None
) -> None:
    """Refuse, before any rank starts, a layout in ``tps`` that some configuration ``{size}-{hash}`` of ``hashes``
    cannot be split into (with ``overrides``; ``gpus``: the GPUs visible to the ranks, None on CPU): one
    ``ConfigError`` naming the layout, the configuration, the problem and the layouts that fit."""
    for hash_name in hashes:  # a configuration that is wrong whatever the layout is said as such
        load_config(f"{size}-{hash_name}", overrides=overrides)
    for tp in tps:
        for hash_name in hashes:
            if (problem := _problem(size, hash_name, tp, overrides, gpus)) is None:
                continue
            fitting = [
                t
                for t in _TRIED_TP
                if all(_problem(size, h, t, overrides, gpus) is None for h in hashes)
            ]
            instead = (
                f"use layouts that fit every configuration (of tp=1..{_TRIED_TP[-1]}: "
                f"{','.join(f'tp={t}' for t in fitting)})"
                if fitting
                else "change the configurations (--set)"
            )
            raise ConfigError(
                f"--layout tp={tp} does not fit {size}-{hash_name} (no rank was started):\n  {problem}\n"
                f"leave tp={tp} out of --layout and {instead}"
            )
