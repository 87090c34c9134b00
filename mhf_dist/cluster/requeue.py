"""A job that lost a node, queued again without it (``mhf-dist requeue``).

A running job's node list cannot change and a requeued job keeps its own, so the job script submits itself again as a
new job that starts once this one has ended, on nodes other than the lost ones and those left out before
(``Slurm.submit_after``), recorded in ``RUN/jobs/jobs.jsonl`` as ``submit`` records a job, so ``status`` follows it;
it resumes from the newest checkpoint. A fixed-size job asks for it when its ranks recorded a lost node
(``mhf_dist.storage.heartbeats.record_lost``), an elastic job when fewer nodes than its minimum are left. Where the
cluster has too few other nodes, SLURM refuses the job and it stops, saying so. More: docs/clusters.md ("A lost
node: elastic jobs").
"""

from __future__ import annotations

from pathlib import Path

from mhf_dist.cluster.elastic import newest_checkpoint
from mhf_dist.cluster.job_records import read_jobs, record_job
from mhf_dist.cluster.scheduler.slurm import SLURM
from mhf_dist.config import ConfigError
from mhf_dist.storage.run_dir import RunDir


def requeue_without(run: RunDir, job: str, script: Path, lost: list[str]) -> str:
    """Submit ``script`` (job ``job``'s own) again to start when ``job`` ends, excluding ``lost``; what was done, in
    words. ConfigError when SLURM refuses it (too few nodes are left without them)."""
    jobs = read_jobs(run)
    current = next((j for j in reversed(jobs) if str(j["job_id"]) == job), {})
    leave_out = sorted({*current.get("excluded", []), *lost})
    try:
        new, excluded = SLURM.submit_after(script, job, leave_out)
    except ConfigError as e:
        raise ConfigError(
            f"{e}; nothing was queued without {', '.join(leave_out)}: the job stops; submit it again "
            "to resume from the newest checkpoint"
        ) from None
    kept = run.jobs_dir / SLURM.script_name
    record_job(
        run,
        new,
        cluster=current.get("cluster"),
        nodes=current.get("nodes"),
        script=str(kept if kept.exists() else script),
        scheduler=SLURM.name,
        requeue_of=job,
        excluded=excluded,
    )
    return (
        f"queued again as job {new} without {', '.join(excluded)}, to start when job {job} ends; kept: "
        f"{newest_checkpoint(run)}"
    )
