"""``status``'s view of a running job's ranks, from their heartbeats (``mhf_dist.storage.heartbeats``) and the
newest metrics record: how many answer and on which nodes, whether the job is HUNG (ranks disagree: some stopped
answering while others answer, or a rank that answers made no progress for its hang timeout) and which ranks, and
the slowest rank when the training loop flagged a straggler or a slow device."""

from __future__ import annotations

from dataclasses import dataclass

from mhf_dist.storage.heartbeats import rank_health, read_heartbeats
from mhf_dist.storage.run_dir import RunDir


@dataclass
class Ranks:
    world: int
    nodes: list[str]  # the nodes the ranks run on, in rank order of their first rank
    step: int  # the furthest step a rank reached
    hung: bool
    findings: list[str]  # which ranks stopped answering, fell behind or made no progress
    straggler: dict | None  # the newest record's straggler warning: {rank, node, ratio, intervals}
    slow_device: dict | None  # the newest record's slow device warning: the same fields


def read_ranks(run: RunDir, now: float, records: list[dict]) -> Ranks | None:
    """The ranks of the job running in ``run``, or None when none of them answers (no job runs)."""
    beats = read_heartbeats(run)
    health = rank_health(beats, now)
    if health is None:
        return None
    nodes = list(dict.fromkeys(str(b.get("node")) for b in beats))
    # the newest record that measured the ranks: a warning stays in every record while it holds
    newest = next((r for r in reversed(records) if "compute_s" in r), {})
    return Ranks(
        health.world,
        nodes,
        health.step,
        health.hung,
        health.describe(now) if health.hung else [],
        newest.get("straggler"),
        newest.get("slow_device"),
    )


def rank_lines(ranks: Ranks | None, label) -> list[str]:
    """The report's lines about the ranks (``label(name, text)`` lays one out)."""
    if ranks is None:
        return []
    where = f"{ranks.world} rank{'s' if ranks.world != 1 else ''} on {', '.join(ranks.nodes)}"
    lines = [
        label("ranks", f"HUNG ({where}): " + "; ".join(ranks.findings) if ranks.hung else where)
    ]
    if s := ranks.straggler:
        lines.append(
            label(
                "straggler",
                f"rank {s['rank']} on {s['node']}: {s['ratio']:.2f}x the median compute "
                f"time per step of its stage's other ranks for {s['intervals']} log intervals",
            )
        )
    if s := ranks.slow_device:
        lines.append(
            label(
                "device",
                f"rank {s['rank']} on {s['node']} is slow: {s['ratio']:.2f}x the median time "
                f"of the other ranks' devices at the device probe for {s['intervals']} log "
                "intervals",
            )
        )
    return lines
