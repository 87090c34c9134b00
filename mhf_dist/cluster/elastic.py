"""An elastic job's next round (``submit --nodes MIN-MAX``): on the nodes that still run a task, the largest
data-parallel size that keeps tp × pp and divides the global batch, from the newest checkpoint.

The job script probes its allocation's nodes before every round and calls ``mhf-dist elastic-plan`` with the nodes
that answered and those that did not; the plan prints the round's shell values (``NODELIST``, ``NNODES``,
``NTASKS``, and ``lost``: the nodes left out from now on) on stdout and its story on stderr, into the job log: which
nodes were lost (with their ranks, from ``RUN/heartbeats/lost.json`` when the ranks recorded them), what was kept (the
newest checkpoint) and what it chose. A node whose ranks were lost while it still runs a task (its GPU or its data
network failed, not its ``slurmd``) is left out as well, after a round that ended with
:data:`~mhf_dist.errors.NODE_LOST_EXIT_CODE`. The data reader's global order does not depend on dp, and the
micro-batches per step follow the new dp (:func:`~mhf_dist.parallel.layout.fit_micro_batch`), so the tokens seen are
those of an uninterrupted run. Fewer nodes left than MIN end the allocation's rounds (:class:`TooFewNodes`, exit 2):
the job is queued again without the lost nodes (:mod:`mhf_dist.cluster.requeue`), and stops where SLURM has too few
other nodes, saying so; the run resumes whenever it is submitted again.
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
from mhf_dist.train.checkpoint.index import marker_problem, read_marker, step_directories

PLAN_FILE = "elastic.json"  # RUN/slurm/elastic.json: the last round's choice


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
        return (f"NODELIST={','.join(self.nodes)} NNODES={len(self.nodes)} NTASKS={self.ranks} "
                f"lost={shlex.quote(' '.join(self.lost))}")


def largest_layout(cfg: RunConfig, ranks: int) -> Layout | None:
    """The layout with the largest dp that ``ranks`` ranks allow at the config's tp × pp and whose global batch it
    divides (micro-batches per step adjusted), or None."""
    model_parallel = cfg.parallel.tp * cfg.parallel.pp
    for dp in range(ranks // model_parallel, 0, -1):
        try:
            return resolve_layout(cfg.model_copy(deep=True), dp * model_parallel)
        except (ConfigError, ValueError):
            continue
    return None


def newest_checkpoint(run: RunDir) -> str:
    """What a job that starts again resumes from, in words."""
    complete = [p for p in step_directories(run.checkpoints_dir) if marker_problem(p) is None]
    if not complete:
        return "no checkpoint yet: the run starts again from step 0"
    marker = read_marker(complete[-1])
    return f"checkpoint {complete[-1].name} (step {marker['step']}); the steps since it are trained again"


def lost_story(run: RunDir, lost: list[str], why: str = "no longer runs a task") -> str | None:
    """``lost: node N (ranks ...): why``, the ranks from the job's lost-node record when it names these nodes."""
    if not lost:
        return None
    recorded = read_lost(run)
    ranks = f" (ranks {', '.join(map(str, recorded['ranks']))})" if set(recorded.get("nodes", ())) == set(lost) else ""
    return f"lost: node{'s' if len(lost) > 1 else ''} {', '.join(lost)}{ranks}: {why}"


def plan_round(cfg: RunConfig, run: RunDir, up: list[str], lost: list[str], tasks_per_node: int,
               min_nodes: int, ranks_lost: bool = False) -> ElasticRound:
    """The next round on the answering nodes ``up`` (``lost``: those that did not answer). ``ranks_lost``: the last
    round ended because ranks stopped answering while every node still answers: the nodes the ranks' lost-node record
    names are left out."""
    silent = [n for n in read_lost(run).get("nodes", []) if n in up] if ranks_lost else []
    if ranks_lost and not silent:
        raise ConfigError("ranks stopped answering but every node still runs a task and none is named as theirs "
                          "(RUN/heartbeats/lost.json): the job stops; submit it again to resume from the newest "
                          "checkpoint")
    story = [line for line in [lost_story(run, silent, "its ranks stopped answering, though it still runs a task")
                               if silent else lost_story(run, lost)] if line]
    up, lost = [n for n in up if n not in silent], [*lost, *silent]
    if len(up) < min_nodes:
        raise TooFewNodes(f"{len(up)} node{'s' if len(up) != 1 else ''} left ({', '.join(up) or 'none'}; lost: "
                          f"{', '.join(lost) or 'none'}), fewer than the job's minimum of {min_nodes}", lost, story)
    layout = largest_layout(cfg, len(up) * tasks_per_node)
    if layout is None:
        raise ConfigError(f"no layout of tp={cfg.parallel.tp} x pp={cfg.parallel.pp} fits {len(up)} nodes of "
                          f"{tasks_per_node} ranks with train.global_batch_size={cfg.train.global_batch_size}")
    ranks = layout.dp * layout.tp * layout.pp
    nodes = up[:math.ceil(ranks / tasks_per_node)]
    path = run.jobs_dir / PLAN_FILE
    try:
        before = json.loads(path.read_text())
    except (OSError, ValueError):
        before = None
    was = f" (was dp {before['dp']} on {before['nodes']} nodes)" if before and before["dp"] != layout.dp else ""
    story = [*story, *(line for line in (
        f"kept: {newest_checkpoint(run)}" if lost or before else None,
        f"chose: dp {layout.dp}{was} on {len(nodes)} node{'s' if len(nodes) > 1 else ''} ({', '.join(nodes)}), "
        f"{ranks} ranks: tp {layout.tp} x pp {layout.pp} kept, the largest dp that {len(up)} node"
        f"{'s' if len(up) > 1 else ''} of {tasks_per_node} allow and that divides the global batch "
        f"{cfg.train.global_batch_size} = dp {layout.dp} x {layout.accum} micro-batches of "
        f"{cfg.train.global_batch_size // (layout.dp * layout.accum)}",
    ) if line)]
    run.jobs_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"dp": layout.dp, "nodes": len(nodes), "ranks": ranks}))
    return ElasticRound(nodes, lost, ranks, layout, story)
