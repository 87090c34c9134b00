"""An elastic job's next round (``submit --nodes MIN-MAX``): on the most of the nodes that still run a task (at
least MIN) whose ranks all train the global batch, from the newest checkpoint.

A count of N nodes *trains the batch* when every one of its ranks is busy (tp × pp divides its ranks and the global
batch splits evenly over their dp); nodes are used whole. ``submit`` refuses a range whose MIN, or every count below
MAX, does not (``check_range``). Before every round the job script calls ``mhf-dist elastic-plan`` with the nodes
that answered and those that did not; the plan prints the round's shell values (``ElasticRound.shell``) on stdout
and its story on stderr. Too few nodes left end the allocation's rounds (``TooFewNodes``, exit 2) and the job queues
itself again (``mhf_dist.cluster.requeue``). The whole story, with the job log: docs/clusters.md ("A lost node:
elastic jobs").
"""

from __future__ import annotations

import json
import math
import shlex
from dataclasses import dataclass

from mhf_dist.config import ConfigError, RunConfig
from mhf_dist.parallel.layout import Layout, resolve_layout
from mhf_dist.storage.heartbeats import read_lost
from mhf_dist.storage.run_dir import RunDir
from mhf_dist.train.checkpoint.index import read_marker
from mhf_dist.train.checkpoint.store import saved_checkpoints

PLAN_FILE = "elastic.json"  # RUN/jobs/elastic.json: the last round's choice


class TooFewNodes(ConfigError):
    """Fewer nodes of the allocation are left than the job's minimum; ``lost``: the nodes lost, ``story``: which,
    in words."""

    def __init__(self, message: str, lost: list[str], story: list[str]):
        super().__init__(message)
        self.lost, self.story = lost, story


@dataclass
class ElasticRound:
    nodes: list[str]  # the nodes the round runs on (a prefix of those that answered)
    lost: list[str]  # the allocation's nodes left out from now on
    ranks: int
    layout: Layout
    story: list[str]

    def shell(self) -> str:
        return (
            f"NODELIST={','.join(self.nodes)} NNODES={len(self.nodes)} NTASKS={self.ranks} "
            f"lost={shlex.quote(' '.join(self.lost))}"
        )


def whole_nodes_layout(cfg: RunConfig, nodes: int, tasks_per_node: int) -> Layout | None:
    """The layout of ``nodes`` nodes with every rank busy (dp = ranks / (tp × pp), the global batch split evenly over
    dp, micro-batches per step adjusted), or None when that count does not train the batch."""
    try:
        return resolve_layout(cfg.model_copy(deep=True), nodes * tasks_per_node)
    except (ConfigError, ValueError):
        return None


def training_counts(cfg: RunConfig, low: int, high: int, tasks_per_node: int) -> dict[int, Layout]:
    """The node counts from ``high`` down to ``low`` that train the batch, with their layouts."""
    counts = ((n, whole_nodes_layout(cfg, n, tasks_per_node)) for n in range(high, low - 1, -1))
    return {n: layout for n, layout in counts if layout is not None}


def _batch(cfg: RunConfig) -> str:
    micro = (
        ""
        if cfg.train.micro_batch_from_preset
        else f" in micro-batches of {cfg.train.micro_batch_size}"
    )
    return f"the global batch {cfg.train.global_batch_size}{micro}"


def _why_not(cfg: RunConfig, counts, tasks_per_node: int) -> str:
    """Why each of ``counts`` does not train the batch: its dp, or its ranks that tp × pp does not divide."""
    model_parallel = cfg.parallel.tp * cfg.parallel.pp
    return "; ".join(
        (
            f"dp {n * tasks_per_node // model_parallel}"
            if n * tasks_per_node % model_parallel == 0
            else f"{n * tasks_per_node} ranks, no multiple of tp x pp = {model_parallel},"
        )
        + f" on {n} node{_s(n)}"
        for n in counts
    )


def _s(n: int) -> str:
    return "s" if n != 1 else ""


def check_range(cfg: RunConfig, min_nodes: int, max_nodes: int, tasks_per_node: int) -> str:
    """``submit``'s check of an elastic range: the counts that train the batch, in words; ConfigError when MIN does
    not (SLURM may start the job on MIN nodes), or no count below MAX does (a lost node would end the rounds), with
    the batch sizes and ranges that work."""
    counts = training_counts(cfg, min_nodes, max_nodes, tasks_per_node)
    shape = f"{tasks_per_node} ranks a node, tp {cfg.parallel.tp} x pp {cfg.parallel.pp}"
    below = [n for n in counts if n < max_nodes]
    if not below:
        missed = _why_not(cfg, range(max_nodes - 1, min_nodes - 1, -1), tasks_per_node)
        raise ConfigError(
            f"--nodes {min_nodes}-{max_nodes}: no count of nodes below {max_nodes} trains "
            f"{_batch(cfg)} with every rank busy ({shape}: {missed}), so a lost node would end the "
            f"job's rounds; {_fixes(cfg, min_nodes, max_nodes, tasks_per_node)}"
        )
    if min_nodes not in counts:
        raise ConfigError(
            f"--nodes {min_nodes}-{max_nodes}: {min_nodes} node{_s(min_nodes)} do"
            f"{'es' if min_nodes == 1 else ''} not train {_batch(cfg)} with every rank busy ({shape}: "
            f"{_why_not(cfg, [min_nodes], tasks_per_node)}), and SLURM may start the job on the "
            f"minimum; raise it to {below[-1]} (--nodes {below[-1]}-{max_nodes})"
        )
    listed = ", ".join(f"{n} (dp {layout.dp})" for n, layout in counts.items())
    return (
        f"elastic: of {min_nodes}-{max_nodes} nodes ({shape}), these train {_batch(cfg)} with every rank busy: "
        f"{listed}; after a loss each round runs on the most of these that the nodes left allow (any other node "
        f"waits, idle), and with fewer than {min_nodes} left the job is queued again without the lost ones"
    )


def _fixes(cfg: RunConfig, min_nodes: int, max_nodes: int, tasks_per_node: int) -> str:
    """What makes a refused range work: a global batch that MAX and the largest count below it both train, a lower
    minimum that trains the batch as it is, or a fixed size."""
    fixes = []
    model_parallel = cfg.parallel.tp * cfg.parallel.pp
    fitting = [
        n
        for n in range(max_nodes - 1, min_nodes - 1, -1)
        if n * tasks_per_node % model_parallel == 0
    ]
    if fitting:
        per_micro = 1 if cfg.train.micro_batch_from_preset else cfg.train.micro_batch_size
        steps = [per_micro * n * tasks_per_node // model_parallel for n in (max_nodes, fitting[0])]
        step = math.lcm(*steps)
        batch = math.ceil(cfg.train.global_batch_size / step) * step
        other = cfg.model_copy(deep=True)
        other.train.global_batch_size = batch
        if all(whole_nodes_layout(other, n, tasks_per_node) for n in (max_nodes, fitting[0])):
            fixes.append(
                f"train.global_batch_size={batch} ({fitting[0]} and {max_nodes} nodes train it)"
            )
    lower = next(
        (n for n in range(min_nodes - 1, 0, -1) if whole_nodes_layout(cfg, n, tasks_per_node)), None
    )
    if lower is not None:
        fixes.append(
            f"--nodes {lower}-{max_nodes} ({lower} node{_s(lower)} train{'s' if lower == 1 else ''} it)"
        )
    fixes.append(f"a fixed --nodes {max_nodes}")
    return "use " + ", ".join(fixes[:-1]) + f" or {fixes[-1]}"


def newest_checkpoint(run: RunDir) -> str:
    """What a job that starts again resumes from, in words."""
    complete = saved_checkpoints(run)
    if not complete:
        return "no checkpoint yet: the run starts again from step 0"
    marker = read_marker(complete[-1])
    return f"checkpoint {complete[-1].name} (step {marker['step']}); the steps since it are trained again"


def lost_story(run: RunDir, lost: list[str], why: str = "no longer runs a task") -> str | None:
    """``lost: node N (ranks ...): why``, the ranks from the job's lost-node record when it names these nodes."""
    if not lost:
        return None
    recorded = read_lost(run)
    ranks = (
        f" (ranks {', '.join(map(str, recorded['ranks']))})"
        if set(recorded.get("nodes", ())) == set(lost)
        else ""
    )
    return f"lost: node{'s' if len(lost) > 1 else ''} {', '.join(lost)}{ranks}: {why}"


def plan_round(
    cfg: RunConfig,
    run: RunDir,
    *,
    up: list[str],
    lost: list[str],
    tasks_per_node: int,
    min_nodes: int,
    ranks_lost: bool = False,
) -> ElasticRound:
    """The next round on the answering nodes ``up`` (``lost``: those that did not answer). ``ranks_lost``: the last
    round ended because ranks stopped answering while every node still answers: the nodes the ranks' lost-node record
    names are left out."""
    silent = [n for n in read_lost(run).get("nodes", []) if n in up] if ranks_lost else []
    if ranks_lost and not silent:
        raise ConfigError(
            "ranks stopped answering but every node still runs a task and none is named as theirs "
            "(RUN/heartbeats/lost.json): the job stops; submit it again to resume from the newest "
            "checkpoint"
        )
    story = [
        line
        for line in [
            lost_story(run, silent, "its ranks stopped answering, though it still runs a task")
            if silent
            else lost_story(run, lost)
        ]
        if line
    ]
    up, lost = [n for n in up if n not in silent], [*lost, *silent]
    if len(up) < min_nodes:
        raise TooFewNodes(
            f"{len(up)} node{'s' if len(up) != 1 else ''} left ({', '.join(up) or 'none'}; lost: "
            f"{', '.join(lost) or 'none'}), fewer than the job's minimum of {min_nodes}",
            lost,
            story,
        )
    counts = training_counts(cfg, min_nodes, len(up), tasks_per_node)
    if not counts:
        why = (
            f"{len(up)} node{_s(len(up))} left ({', '.join(up)}; lost: {', '.join(lost) or 'none'}), and no count "
            f"of them from the job's minimum of {min_nodes} up trains {_batch(cfg)} with every rank busy "
            f"({_why_not(cfg, range(len(up), min_nodes - 1, -1), tasks_per_node)})"
        )
        if not lost:  # the allocation itself: queueing the job again would meet the same
            raise ConfigError(
                f"{why}: the job stops; submit it again with a batch that its node counts train"
            )
        raise TooFewNodes(why, lost, story)
    used, layout = next(iter(counts.items()))
    ranks = layout.dp * layout.tp * layout.pp
    nodes, idle = up[:used], up[used:]
    path = run.jobs_dir / PLAN_FILE
    try:
        before = json.loads(path.read_text())
    except (OSError, ValueError):
        before = None
    was = (
        f" (was dp {before['dp']} on {before['nodes']} nodes)"
        if before and before["dp"] != layout.dp
        else ""
    )
    story = [
        *story,
        *(
            line
            for line in (
                f"kept: {newest_checkpoint(run)}" if lost or before else None,
                f"chose: dp {layout.dp}{was} on {used} node{_s(used)} ({', '.join(nodes)}), "
                f"{ranks} ranks: tp {layout.tp} x pp {layout.pp} kept, the most of the {len(up)} "
                f"answering node{_s(len(up))} of {tasks_per_node} ranks (at least the minimum of "
                f"{min_nodes}) whose ranks all train the global batch {cfg.train.global_batch_size} = "
                f"dp {layout.dp} x {layout.accum} micro-batches of "
                f"{cfg.train.global_batch_size // (layout.dp * layout.accum)}",
                f"idle: {len(idle)} answering node{_s(len(idle))} ({', '.join(idle)}; "
                f"{len(idle) * tasks_per_node} ranks) wait{'s' if len(idle) == 1 else ''} this round "
                f"out: more nodes do not train {_batch(cfg)} with every rank busy "
                f"({_why_not(cfg, range(len(up), used, -1), tasks_per_node)})"
                if idle
                else None,
            )
            if line
        ),
    ]
    run.make_jobs_dir()
    path.write_text(json.dumps({"dp": layout.dp, "nodes": len(nodes), "ranks": ranks}))
    return ElasticRound(nodes, lost, ranks, layout, story)
