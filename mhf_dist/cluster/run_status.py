"""A run's status, read from its files: ``RunStatus`` and its parts, and ``gather``, which fills it in.

It reads ``config.yaml``, ``metrics.jsonl``, the complete checkpoints (their files' sizes against ``complete.json``;
``verify`` also their SHA-256 digests, which reads every file), ``lock.json``, ``jobs/jobs.jsonl``, the ranks'
heartbeats (``rank_status``) and the profiler windows' folders (``profiles/``), and asks the job's scheduler
(``Scheduler.query``) for the state of the run's current job. It imports neither torch nor numpy, so it starts fast.
A run is STALE when it is not finished and nothing was logged for longer than ``stale_minutes``, by default
max(``STALE_FLOOR_S`` s, ``STALE_INTERVALS`` × the recent mean interval between logged records); "recent" is the last
``RECENT`` logged training records. How rates and the ETA are derived: docs/training.md ("Monitoring: status").
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from mhf_dist.cluster.job_records import read_jobs
from mhf_dist.cluster.rank_status import Ranks, read_ranks
from mhf_dist.cluster.scheduler import schedulers
from mhf_dist.cluster.scheduler.slurm import SLURM
from mhf_dist.config import ConfigError, RunConfig, load_config
from mhf_dist.config.loader import read_config_file
from mhf_dist.storage.run_dir import MEMORY_FILE, PROFILE_DIR, TRACE_FILE, RunDir
from mhf_dist.storage.run_lock import STALE_S, RunLock, holder_gone
from mhf_dist.train.checkpoint.index import (
    MARKER,
    CheckpointError,
    damage,
    read_marker,
    step_directories,
)
from mhf_dist.train.checkpoint.store import run_store
from mhf_dist.train.metrics import read_metrics
from mhf_dist.train.rollback import read_rollbacks
from mhf_dist.train.schedule import decay_begins, phase

RECENT = 10  # logged training records the means (loss, tokens/s, MFU) cover
STALE_FLOOR_S = 600.0
STALE_INTERVALS = 5
COUNTERS = ("nonfinite_steps", "skipped_steps", "loss_spikes", "grad_spikes")


@dataclass
class Checkpoint:
    name: str
    path: str
    step: int
    tokens: int
    reason: str
    age_s: float


@dataclass
class DamagedCheckpoint:
    name: str
    path: str
    step: int
    problem: str


@dataclass
class Job:
    job_id: str
    state: str | None
    restarts: int | None
    source: str | None
    submitted: str | None
    cluster: str | None
    nodes: int | None
    submissions: int


@dataclass
class Lock:
    host: str | None
    pid: int | None
    slurm_job_id: str | None
    started: str | None
    heartbeat_age_s: float
    heartbeat_stopped: bool
    holder_gone: str | None
    next_train_takes_over: bool


@dataclass
class Profile:
    """A profiler window's folder under ``RUN/profiles/`` and the ranks' files in it."""

    name: str  # step-FIRST-LAST
    path: str
    first_step: int
    last_step: int
    traces: list[str]  # the ranks' traces, by rank
    memory_snapshots: list[str]  # the GPU ranks' CUDA memory histories, by rank


@dataclass
class OutOfMemory:
    """The newest step that ran out of memory (``mhf_dist.train.oom``): its ranks' reports' folder."""

    step: int
    folder: str
    ranks: list[int]  # the ranks that ran out, by their reports
    age_s: float


@dataclass
class RunStatus:
    run_dir: str
    preset: str | None
    checked_at: float
    step: int | None = None
    max_steps: int | None = None
    progress: float | None = None
    finished: bool = False
    tokens: int | None = None
    source_tokens: dict | None = None  # a mixture's tokens read from each source (data.sources)
    loss: float | None = None
    head_losses: list | None = None
    z_loss: float | None = None  # the last logged z-loss term (train.z_loss_weight > 0)
    loss_recent_mean: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    recent_records: int = 0
    seconds_per_step: float | None = None
    last_step_age_s: float | None = None
    stale_after_s: float = STALE_FLOOR_S
    stale: bool = False
    eta_s: float | None = None
    checkpoint: Checkpoint | None = None
    checkpoint_check: str = "sizes"
    damaged_checkpoints: list[DamagedCheckpoint] = field(default_factory=list)
    # train.checkpoint_dir in object storage: its URL, and its checkpoints ({name, complete, problem}) by step
    checkpoint_store: str | None = None
    stored_checkpoints: list[dict] | None = None
    store_error: str | None = None  # why the store could not be listed
    validation: dict | None = None
    # the last logged scores of train.eval_tasks (eval/<task>/<metric>), with their step
    downstream: dict | None = None
    nonfinite_steps: int | None = None
    skipped_steps: int | None = None
    loss_spikes: int | None = None
    grad_spikes: int | None = None
    grad_norms: dict | None = (
        None  # the last logged step's gradient norm per parameter family (the health metrics)
    )
    rollbacks: list[dict] = field(default_factory=list)
    # the learning-rate schedule and the phase of the last logged step: {name, phase, decay_start}
    schedule: dict | None = None
    job: Job | None = None
    lock: Lock | None = None
    ranks: Ranks | None = None
    profiles: list[Profile] = field(default_factory=list)  # the profiler windows recorded, by step
    out_of_memory: OutOfMemory | None = None  # the newest step out of memory (RUN/oom/last.json)


# ---------------------------------------------------------------- reading a run directory


def check_run_dir(path: Path) -> RunDir:
    """The run directory at ``path`` if it looks like one; else a ``ConfigError`` naming the fix."""
    run = RunDir(path)
    hint = "give the --run-dir that `mhf-dist train` or `mhf-dist submit` was started with"
    if not path.exists():
        raise ConfigError(f"{path} does not exist: {hint}")
    if not path.is_dir():
        raise ConfigError(f"{path} is not a directory: {hint}")
    markers = (run.config_path, run.metrics_path, run.checkpoints_dir, run.jobs_file, run.lock_path)
    if not any(p.exists() for p in markers):
        named = [
            str(p.relative_to(path)) + ("/" if p == run.checkpoints_dir else "")
            for p in markers[:4]
        ]
        raise ConfigError(
            f"{path} is not a run directory (no {', '.join(named[:3])} or {named[3]}): {hint}"
        )
    return run


def read_config(run: RunDir) -> tuple[dict, RunConfig | None]:
    """The run's ``config.yaml`` as a plain dict ({} before the job wrote it) and as the config it resolves to;
    one that ``train --run-dir`` would refuse (unreadable, not YAML, failing the schema) is a ``ConfigError`` naming
    it and the problem."""
    path = run.config_path
    if not path.exists():
        return {}, None
    resolved = load_config(path=path)
    return read_config_file(path), resolved


def schedule_phase(cfg: RunConfig, step: int) -> dict:
    """The learning-rate schedule at (1-based) ``step``: its name, the step's phase, and the last step before its
    decay (None: constant, which never decays)."""
    opt, steps = cfg.optimizer, cfg.train.max_steps
    begins = None if opt.schedule == "constant" else decay_begins(opt, steps)
    return {"name": opt.schedule, "phase": phase(step - 1, opt, steps), "decay_start": begins}


def _mean(values: list) -> float | None:
    finite = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return sum(finite) / len(finite) if finite else None


def _int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def stored_checkpoints(run: RunDir) -> tuple[str | None, list[dict] | None, str | None]:
    """(the URL of the run's checkpoints in object storage, its checkpoints, why they could not be listed); all None
    for a run that keeps them in RUN/checkpoints."""
    store = run_store(run)
    if store.url is None:
        return None, None, None
    try:
        listed = store.listing()
    except CheckpointError as e:
        return store.url, None, str(e)
    return (
        store.url,
        [{"name": n, "complete": p is None, "problem": p} for n, p in listed],
        None,
    )


def newest_checkpoint(
    run: RunDir, now: float, digests: bool = False
) -> tuple[Checkpoint | None, str, list[DamagedCheckpoint]]:
    """(the newest complete checkpoint whose files have their saved sizes — with ``digests``, their saved content
    too — or None; what was checked of it, ``sizes`` or ``digests``; the newer complete ones that fail that check,
    newest first)."""
    damaged = []
    for path in reversed(step_directories(run_store(run).local)):
        try:
            marker, written = read_marker(path), (path / MARKER).stat().st_mtime
            problem = damage(path, digests)
        except (
            CheckpointError,
            OSError,
        ):  # incomplete (perhaps being saved right now), or removed since listed
            continue
        if problem is not None:
            damaged.append(DamagedCheckpoint(path.name, str(path), marker["step"], problem))
            continue
        # older checkpoints have no digests
        checked = "digests" if digests and "digests" in marker else "sizes"
        return (
            Checkpoint(
                path.name,
                str(path),
                marker["step"],
                marker["tokens"],
                marker["reason"],
                max(0.0, now - written),
            ),
            checked,
            damaged,
        )
    return None, "digests" if digests else "sizes", damaged


def latest_with(records: list[dict], prefix: str) -> dict | None:
    """The fields named ``prefix...`` of the newest record holding any (``val_``: the validation; ``eval/``: the
    downstream scores), with its step."""
    for record in reversed(records):
        values = {k: v for k, v in record.items() if k.startswith(prefix)}
        if values:
            return {"step": record.get("step"), **values}
    return None


def read_lock(run: RunDir, now: float) -> Lock | None:
    path = run.lock_path
    try:
        age = max(0.0, now - path.stat().st_mtime)
        holder = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):  # a write in progress
        holder = {}
    holder = holder if isinstance(holder, dict) else {}
    job = holder.get("slurm_job_id")
    return Lock(
        holder.get("host"),
        _int(holder.get("pid")),
        str(job) if job else None,
        holder.get("started"),
        age,
        age > STALE_S,
        holder_gone(holder, age),
        RunLock(run).stale_reason(holder, age) is not None,
    )


def read_profiles(run: RunDir) -> list[Profile]:
    """The profiler windows in ``RUN/profiles/`` (``train.profile_steps``, ``RUN/profile-now``), by their steps;
    files still being written are left out."""
    try:
        folders = [p for p in run.profiles_dir.iterdir() if PROFILE_DIR.fullmatch(p.name)]
    except OSError:  # none yet
        return []
    found = []
    for folder in folders:
        try:
            names = [p.name for p in folder.iterdir()]
        except OSError:  # not a folder, or removed since listed
            continue
        first, last = map(int, PROFILE_DIR.fullmatch(folder.name).groups())
        traces, memory = _by_rank(names, TRACE_FILE), _by_rank(names, MEMORY_FILE)
        found.append(Profile(folder.name, str(folder), first, last, traces, memory))
    return sorted(found, key=lambda p: (p.first_step, p.last_step))


def read_out_of_memory(run: RunDir, now: float) -> OutOfMemory | None:
    """``RUN/oom/last.json`` and the reports beside it, or None (no step ran out, or the record is unreadable)."""
    try:
        record = json.loads(run.oom_record.read_text())
        # by its name under RUN/oom: the run directory may have been copied from where it ran
        folder, written = run.oom_dir / Path(record["folder"]).name, run.oom_record.stat().st_mtime
        step = int(record["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    ranks = sorted(
        int(m.group(1))
        for p in (folder.iterdir() if folder.is_dir() else [])
        if (m := re.fullmatch(r"rank-(\d+)\.txt", p.name))
    )
    return OutOfMemory(step=step, folder=str(folder), ranks=ranks, age_s=now - written)


def _by_rank(names: list[str], template: str) -> list[str]:
    """The ``names`` that are ``template`` of a rank (``{}``), by rank."""
    pattern = re.compile(re.escape(template).replace(re.escape("{}"), r"(\d+)"))
    ranks = {n: int(m[1]) for n in names if (m := pattern.fullmatch(n))}
    return sorted(ranks, key=ranks.get)


# ---------------------------------------------------------------- the scheduler


def current_job(run: RunDir, lock: Lock | None) -> Job | None:
    jobs = read_jobs(run)
    current = jobs[-1] if jobs else {}
    job_id = current.get("job_id") or (lock.slurm_job_id if lock else None)
    if not job_id:
        return None
    name = current.get("scheduler", SLURM.name)  # submissions recorded before the name was
    # None: not registered in this process
    found = s.query(str(job_id)) if (s := schedulers().get(name)) else None
    state, restarts, source = found if found is not None else (None, None, None)
    return Job(
        str(job_id),
        state,
        restarts,
        source,
        current.get("submitted"),
        current.get("cluster"),
        _int(current.get("nodes")),
        len(jobs),
    )


# ---------------------------------------------------------------- the report


def _from_records(st: RunStatus, records: list[dict], tokens_per_step: int | None) -> list[dict]:
    """The step, tokens, loss, throughput, validation and counters from ``metrics.jsonl``'s records."""
    st.step = _int(records[-1].get("step"))
    training = [r for r in records if "loss" in r]  # a record may hold validation only
    recent = training[-RECENT:]
    st.recent_records = len(recent)
    if training:
        st.loss, st.head_losses = training[-1]["loss"], training[-1].get("head_losses")
        st.z_loss = training[-1].get("z_loss")
    st.loss_recent_mean = _mean([r["loss"] for r in recent])
    st.tokens_per_s = _mean([r.get("tokens_per_s") for r in recent])
    st.mfu = _mean([r.get("mfu") for r in recent])
    if st.step is not None and tokens_per_step:
        st.tokens = st.step * tokens_per_step
    st.source_tokens = next(
        (r["source_tokens"] for r in reversed(records) if "source_tokens" in r), None
    )
    if st.step is not None and st.max_steps:
        st.progress, st.finished = st.step / st.max_steps, st.step >= st.max_steps
    st.validation = latest_with(records, "val_")
    st.downstream = latest_with(records, "eval/")
    st.grad_norms = next(
        (
            norms
            for r in reversed(training)
            if (
                norms := {
                    k.removeprefix("grad_norm/"): v
                    for k, v in r.items()
                    if k.startswith("grad_norm/") and "/block" not in k
                }
            )
        ),
        None,
    )
    for key in COUNTERS:
        setattr(st, key, next((r[key] for r in reversed(records) if key in r), None))
    return recent


def _timing(
    st: RunStatus,
    recent: list[dict],
    tokens_per_step: int | None,
    log_interval,
    written: float,
    stale_minutes: float | None,
) -> None:
    """Seconds per step, ETA, and whether the run is stale (``written``: when ``metrics.jsonl`` was written)."""
    if tokens_per_step and st.tokens_per_s:
        st.seconds_per_step = tokens_per_step / st.tokens_per_s
        steps = [r["step"] for r in recent]
        between = _mean([b - a for a, b in zip(steps, steps[1:])]) or _int(log_interval) or 1
        if stale_minutes is None:
            st.stale_after_s = max(STALE_FLOOR_S, STALE_INTERVALS * between * st.seconds_per_step)
        if st.step is not None and st.max_steps:
            st.eta_s = (st.max_steps - st.step) * st.seconds_per_step
    if st.finished:
        st.eta_s = 0.0
    st.last_step_age_s = max(0.0, st.checked_at - written)
    st.stale = not st.finished and st.last_step_age_s > st.stale_after_s


def gather(
    run_dir: str | Path, stale_minutes: float | None = None, verify: bool = False
) -> RunStatus:
    """Everything ``status`` reports about ``run_dir`` (``verify``: check the checkpoints' digests, not only their
    sizes); raises ``ConfigError`` if it is not a run directory."""
    run = check_run_dir(Path(run_dir))
    cfg, resolved = read_config(run)
    now = time.time()
    train, data = cfg.get("train") or {}, cfg.get("data") or {}
    batch, seq_len = _int(train.get("global_batch_size")), _int(data.get("seq_len"))
    tokens_per_step = batch * seq_len if batch and seq_len else None
    st = RunStatus(
        run_dir=str(run.path.resolve()),
        preset=cfg.get("preset"),
        checked_at=now,
        max_steps=_int(train.get("max_steps")),
    )
    if stale_minutes is not None:
        st.stale_after_s = stale_minutes * 60
    st.ranks = read_ranks(run, now, records := read_metrics(run.path))
    if records:
        recent = _from_records(st, records, tokens_per_step)
        written = run.metrics_path.stat().st_mtime
        _timing(st, recent, tokens_per_step, train.get("log_interval"), written, stale_minutes)
        if resolved is not None and st.step:
            st.schedule = schedule_phase(resolved, st.step)
    st.checkpoint, st.checkpoint_check, st.damaged_checkpoints = newest_checkpoint(run, now, verify)
    st.checkpoint_store, st.stored_checkpoints, st.store_error = stored_checkpoints(run)
    st.rollbacks = read_rollbacks(run)
    st.profiles = read_profiles(run)
    st.out_of_memory = read_out_of_memory(run, now)
    st.lock = read_lock(run, now)
    st.job = current_job(run, st.lock)
    return st
