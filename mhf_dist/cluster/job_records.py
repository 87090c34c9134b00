"""A run's submitted jobs, ``RUN/jobs/jobs.jsonl`` (``RUN/slurm/`` in older runs): one line per job ``submit`` (or a
requeue without a lost node, ``mhf_dist.cluster.requeue``) queued, with its scheduler's name; ``status`` follows the
newest."""

from __future__ import annotations

import json
import time

from mhf_dist.storage.run_dir import RunDir


def read_jobs(run: RunDir) -> list[dict]:
    """The submissions in ``jobs.jsonl``, oldest first (unreadable lines left out)."""
    path = run.jobs_file
    jobs = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            job = json.loads(line)
        except ValueError:
            continue
        if isinstance(job, dict) and job.get("job_id"):
            jobs.append(job)
    return jobs


def record_job(run: RunDir, job: str, **fields: object) -> None:
    """Add job ``job`` (submitted now) to the run's submissions, with ``fields`` (cluster, nodes, script, ...)."""
    with run.jobs_file.open("a") as f:
        f.write(
            json.dumps({"job_id": job, "submitted": time.strftime("%Y-%m-%d %H:%M:%S"), **fields})
            + "\n"
        )
