"""A job that lost a node, queued again without it.

A running job's node list cannot change (SLURM changes ``ExcNodeList`` of pending jobs only) and a requeued job
keeps its own, so the job script submits itself again (``mhf-dist requeue``) as a new job that starts once this one
has ended, on nodes other than the lost ones, those earlier requeues left out and those the script itself leaves out
(:meth:`~mhf_dist.cluster.scheduler.slurm.Slurm.submit_after`). ``RUN/slurm/jobs.jsonl`` records it as ``submit``
records a job, so ``status`` follows it. It resumes from the newest checkpoint. The job script asks for it when its
ranks recorded a lost node (:func:`~mhf_dist.storage.heartbeats.record_lost`; a fixed-size job), and an elastic job
when fewer nodes than its minimum are left in its allocation (it asks for MIN-MAX nodes again). Where the cluster
has too few other nodes, SLURM refuses the job: the job stops, saying so, and the run resumes whenever it is
submitted again.
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
        raise ConfigError(f"{e}; nothing was queued without {', '.join(leave_out)}: the job stops; submit it again "
                          "to resume from the newest checkpoint") from None
    kept = run.jobs_dir / SLURM.script_name
    record_job(run, new, cluster=current.get("cluster"), nodes=current.get("nodes"),
               script=str(kept if kept.exists() else script), scheduler=SLURM.name, requeue_of=job,
               excluded=excluded)
    return (f"queued again as job {new} without {', '.join(excluded)}, to start when job {job} ends; kept: "
            f"{newest_checkpoint(run)}")
