"""Each rank's heartbeat, ``RUN/heartbeats/rank-N.json``, rewritten every few seconds by a thread of the rank whatever
its training thread waits on, so the files tell without the network which ranks answer, which stopped and which fell
behind (``rank_health``); and the lost-node record, ``RUN/heartbeats/lost.json`` (``record_lost``). The hang
watchdog (``mhf_dist.train.watchdog``) and ``status`` read them (docs/monitoring.md, "Monitoring: ``status``").

A heartbeat: ``rank``, ``node`` (``NODE_ENV``, else the host name), ``pid``, ``step`` (under way, or the last one
done), ``phase`` (``start``, ``step``, ``eval``, ``save``, ``rollback``, ``end``, ``finished``), ``since`` (when the
phase began: the last progress), ``beat`` (when written), ``beat_s`` (the interval between writes),
``hang_timeout_s`` (the phase's budget), ``started`` (when the rank's watchdog started).
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from mhf_dist.atomic import create_whole, write_atomic
from mhf_dist.storage.run_dir import RunDir

NODE_ENV = "MHF_DIST_NODE"  # a rank's node name as its scheduler calls it (set for each task)
MISSED_BEATS = 3  # a heartbeat this many intervals old (plus a second) no longer answers
IDLE_PHASES = ("start", "finished")  # no hang is counted in them (set-up has no progress marks)


def node_name() -> str:
    return os.environ.get(NODE_ENV) or socket.gethostname()


def heartbeat_path(run: RunDir, rank: int) -> Path:
    return run.heartbeats_dir / f"rank-{rank}.json"


def write_heartbeat(run: RunDir, record: dict) -> None:
    """Replace the rank's heartbeat whole (a reader never sees half of one)."""
    path = heartbeat_path(run, record["rank"])
    write_atomic(path, json.dumps(record), durable=False)


def record_lost(run: RunDir, nodes: list[str], ranks: list[int], step: int, when: float) -> bool:
    """Record the nodes (and their ranks) this job lost, ``RUN/heartbeats/lost.json``, unless a rank already did:
    whether this call recorded it. What the job script acts on (an elastic job's next round leaves them out; a requeue
    excludes them). The first rank to see the loss records it: the others may be ended by its exit before they do."""
    return create_whole(
        run.lost_record, json.dumps({"nodes": nodes, "ranks": ranks, "time": when, "step": step})
    )


def read_lost(run: RunDir) -> dict:
    """The lost-node record of this job (``record_lost``): ``{nodes, ranks, time, step}``, or ``{}``."""
    try:
        record = json.loads(run.lost_record.read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def clear_heartbeats(run: RunDir) -> None:
    """Remove the heartbeats of an earlier job (its world may differ) and its lost-node record; called before this
    job's ranks write."""
    for path in run.heartbeats_dir.glob("*.json"):
        path.unlink(missing_ok=True)
    run.heartbeats_dir.mkdir(parents=True, exist_ok=True)


def read_heartbeats(run: RunDir) -> list[dict]:
    """Every readable heartbeat, by rank."""
    beats = []
    for path in run.heartbeats_dir.glob("rank-*.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):  # removed or replaced while listed
            continue
        if isinstance(record, dict) and isinstance(record.get("rank"), int):
            beats.append(record)
    return sorted(beats, key=lambda b: b["rank"])


def answers(beat: dict, now: float) -> bool:
    """Whether the rank's heartbeat thread still writes (a finished rank counts as answering)."""
    return (
        beat.get("phase") == "finished"
        or now - beat.get("beat", 0) <= MISSED_BEATS * beat.get("beat_s", 1) + 1
    )


@dataclass
class RankHealth:
    """What the heartbeats of one job say: the ranks that stopped answering, those that fell behind the furthest
    step, and those that answer but made no progress for their hang timeout."""

    world: int
    step: int  # the furthest step any rank reached
    not_answering: list[dict]
    behind: list[dict]
    stalled: list[dict]

    @property
    def hung(self) -> bool:
        """Ranks disagree (some answer, some do not), or a rank that answers is stuck."""
        return bool(self.stalled) or (
            bool(self.not_answering) and len(self.not_answering) < self.world
        )

    def describe(self, now: float) -> list[str]:
        """A line per finding, each naming ranks with their node."""
        lines = []
        if self.not_answering:
            lines.append(
                "not answering: "
                + "; ".join(
                    f"rank {b['rank']} ({b.get('node')}, pid {b.get('pid')}, last heartbeat "
                    f"{now - b['beat']:.0f} s ago, {doing(b)})"
                    for b in self.not_answering
                )
            )
        if self.behind:
            lines.append(
                f"did not reach step {self.step}: "
                + ", ".join(f"rank {b['rank']} ({b.get('node')}, {doing(b)})" for b in self.behind)
            )
        if self.stalled:
            lines.append(
                "no progress: "
                + ", ".join(
                    f"rank {b['rank']} ({b.get('node')}, {now - b['since']:.0f} s {doing(b)})"
                    for b in self.stalled
                )
            )
        return lines


def doing(beat: dict) -> str:
    """What a heartbeat says its rank was doing: ``in step 4``, ``in the evaluation at step 4``, ..."""
    return {
        "step": "in step {}",
        "eval": "in the evaluation at step {}",
        "save": "in the save of step {}",
        "rollback": "in the rollback at step {}",
        "end": "in the end of training at step {}",
        "start": "starting",
        "finished": "finished at step {}",
    }.get(beat.get("phase"), "in {} of step {{}}".format(beat.get("phase"))).format(
        beat.get("step")
    )


def rank_health(beats: list[dict], now: float) -> RankHealth | None:
    """The heartbeats' verdict, or None when there are none or none answers (no job is running)."""
    if not beats or not any(answers(b, now) for b in beats):
        return None
    top = max(b.get("step", 0) for b in beats)
    active = [b for b in beats if b.get("phase") not in IDLE_PHASES]
    return RankHealth(
        world=len(beats),
        step=top,
        not_answering=[b for b in beats if not answers(b, now)],
        behind=[b for b in active if b.get("step", 0) < top],
        stalled=[
            b
            for b in active
            if answers(b, now)
            and b.get("hang_timeout_s")
            and now - b.get("since", now) > b["hang_timeout_s"]
        ],
    )
