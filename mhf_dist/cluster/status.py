"""``mhf-dist status RUN_DIR``: a run's progress from its files (no process needs to be running).

It reads ``config.yaml``, ``metrics.jsonl``, the complete checkpoints (their files' sizes against ``complete.json``;
``--verify`` also their SHA-256 digests, which reads every file), ``lock.json``, ``jobs/jobs.jsonl`` and the ranks'
heartbeats (``rank_status``), and asks the job's scheduler (``Scheduler.query``) for the state of the run's current
job. It imports neither torch nor numpy, so it starts fast. A run is STALE when it is not finished and nothing was
logged for longer than ``--stale-minutes``, by default max(``STALE_FLOOR_S`` s, ``STALE_INTERVALS`` × the recent mean
interval between logged records); "recent" is the last ``RECENT`` logged training records. What the report says and
how rates and the ETA are derived: docs/training.md ("Monitoring: status"), with every ``--json`` key in its
"status --json" table.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mhf_dist.cluster.job_records import read_jobs
from mhf_dist.cluster.rank_status import Ranks, rank_lines, read_ranks
from mhf_dist.cluster.scheduler import schedulers
from mhf_dist.cluster.scheduler.slurm import SLURM
from mhf_dist.config import ConfigError, load_config
from mhf_dist.config.loader import read_config_file
from mhf_dist.storage.run_dir import RunDir
from mhf_dist.storage.run_lock import STALE_S, RunLock, holder_gone
from mhf_dist.train.checkpoint.index import MARKER, CheckpointError, damage, read_marker, step_directories
from mhf_dist.train.console import duration
from mhf_dist.train.metrics import read_metrics
from mhf_dist.train.rollback import read_rollbacks

RECENT = 10  # logged training records the means (loss, tokens/s, MFU) cover
STALE_FLOOR_S = 600.0
STALE_INTERVALS = 5
COUNTERS = ("nonfinite_steps", "skipped_steps", "loss_spikes", "grad_spikes")
DEFAULT_WATCH_S = 10.0
STALE_HELP = (f"flag the run STALE when nothing was logged for this long (default: max({STALE_FLOOR_S / 60:g} min, "
              f"{STALE_INTERVALS} x the recent mean interval between logged steps, estimated from tokens/s))")


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
    validation: dict | None = None
    nonfinite_steps: int | None = None
    skipped_steps: int | None = None
    loss_spikes: int | None = None
    grad_spikes: int | None = None
    grad_norms: dict | None = None  # the last logged step's gradient norm per parameter family (the health metrics)
    rollbacks: list[dict] = field(default_factory=list)
    job: Job | None = None
    lock: Lock | None = None
    ranks: Ranks | None = None


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
        named = [str(p.relative_to(path)) + ("/" if p == run.checkpoints_dir else "") for p in markers[:4]]
        raise ConfigError(f"{path} is not a run directory (no {', '.join(named[:3])} or {named[3]}): {hint}")
    return run


def read_config(run: RunDir) -> dict:
    """The run's ``config.yaml`` as a plain dict ({} before the job wrote it); one that ``train --run-dir`` would
    refuse (unreadable, not YAML, failing the schema) is a ``ConfigError`` naming it and the problem."""
    path = run.config_path
    if not path.exists():
        return {}
    load_config(path=path)
    return read_config_file(path)


def _mean(values: list) -> float | None:
    finite = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return sum(finite) / len(finite) if finite else None


def _int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def newest_checkpoint(run: RunDir, now: float, digests: bool = False) -> tuple[Checkpoint | None, str,
                                                                             list[DamagedCheckpoint]]:
    """(the newest complete checkpoint whose files have their saved sizes — with ``digests``, their saved content
    too — or None; what was checked of it, ``sizes`` or ``digests``; the newer complete ones that fail that check,
    newest first)."""
    damaged = []
    for path in reversed(step_directories(run.checkpoints_dir)):
        try:
            marker, written = read_marker(path), (path / MARKER).stat().st_mtime
            problem = damage(path, digests)
        except (CheckpointError, OSError):  # incomplete (perhaps being saved right now), or removed since listed
            continue
        if problem is not None:
            damaged.append(DamagedCheckpoint(path.name, str(path), marker["step"], problem))
            continue
        checked = "digests" if digests and "digests" in marker else "sizes"  # older checkpoints have no digests
        return Checkpoint(path.name, str(path), marker["step"], marker["tokens"], marker["reason"],
                          max(0.0, now - written)), checked, damaged
    return None, "digests" if digests else "sizes", damaged


def latest_validation(records: list[dict]) -> dict | None:
    for record in reversed(records):
        values = {k: v for k, v in record.items() if k.startswith("val_")}
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
    return Lock(holder.get("host"), _int(holder.get("pid")), str(job) if job else None, holder.get("started"), age,
                age > STALE_S, holder_gone(holder, age), RunLock(run).stale_reason(holder, age) is not None)


# ---------------------------------------------------------------- the scheduler

def current_job(run: RunDir, lock: Lock | None) -> Job | None:
    jobs = read_jobs(run)
    current = jobs[-1] if jobs else {}
    job_id = current.get("job_id") or (lock.slurm_job_id if lock else None)
    if not job_id:
        return None
    name = current.get("scheduler", SLURM.name)  # submissions recorded before the name was
    found = s.query(str(job_id)) if (s := schedulers().get(name)) else None  # None: not registered in this process
    state, restarts, source = found if found is not None else (None, None, None)
    return Job(str(job_id), state, restarts, source, current.get("submitted"), current.get("cluster"),
               _int(current.get("nodes")), len(jobs))


# ---------------------------------------------------------------- the report

def _from_records(st: RunStatus, records: list[dict], tokens_per_step: int | None) -> list[dict]:
    """The step, tokens, loss, throughput, validation and counters from ``metrics.jsonl``'s records."""
    st.step = _int(records[-1].get("step"))
    training = [r for r in records if "loss" in r]  # a record may hold validation only
    recent = training[-RECENT:]
    st.recent_records = len(recent)
    if training:
        st.loss, st.head_losses = training[-1]["loss"], training[-1].get("head_losses")
    st.loss_recent_mean = _mean([r["loss"] for r in recent])
    st.tokens_per_s = _mean([r.get("tokens_per_s") for r in recent])
    st.mfu = _mean([r.get("mfu") for r in recent])
    if st.step is not None and tokens_per_step:
        st.tokens = st.step * tokens_per_step
    st.source_tokens = next((r["source_tokens"] for r in reversed(records) if "source_tokens" in r), None)
    if st.step is not None and st.max_steps:
        st.progress, st.finished = st.step / st.max_steps, st.step >= st.max_steps
    st.validation = latest_validation(records)
    st.grad_norms = next((norms for r in reversed(training) if (norms := {
        k.removeprefix("grad_norm/"): v for k, v in r.items() if k.startswith("grad_norm/") and "/block" not in k})),
        None)
    for key in COUNTERS:
        setattr(st, key, next((r[key] for r in reversed(records) if key in r), None))
    return recent


def _timing(st: RunStatus, recent: list[dict], tokens_per_step: int | None, log_interval, written: float,
            stale_minutes: float | None) -> None:
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


def gather(run_dir: str | Path, stale_minutes: float | None = None, verify: bool = False) -> RunStatus:
    """Everything ``status`` reports about ``run_dir`` (``verify``: check the checkpoints' digests, not only their
    sizes); raises ``ConfigError`` if it is not a run directory."""
    run = check_run_dir(Path(run_dir))
    cfg = read_config(run)
    now = time.time()
    train, data = cfg.get("train") or {}, cfg.get("data") or {}
    batch, seq_len = _int(train.get("global_batch_size")), _int(data.get("seq_len"))
    tokens_per_step = batch * seq_len if batch and seq_len else None
    st = RunStatus(run_dir=str(run.path.resolve()), preset=cfg.get("preset"), checked_at=now,
                   max_steps=_int(train.get("max_steps")))
    if stale_minutes is not None:
        st.stale_after_s = stale_minutes * 60
    st.ranks = read_ranks(run, now, records := read_metrics(run.path))
    if records:
        recent = _from_records(st, records, tokens_per_step)
        written = run.metrics_path.stat().st_mtime
        _timing(st, recent, tokens_per_step, train.get("log_interval"), written, stale_minutes)
    st.checkpoint, st.checkpoint_check, st.damaged_checkpoints = newest_checkpoint(run, now, verify)
    st.rollbacks = read_rollbacks(run)
    st.lock = read_lock(run, now)
    st.job = current_job(run, st.lock)
    return st


def _finite(value):
    """``value`` with NaN and infinities replaced by None (strict JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def to_json(st: RunStatus) -> str:
    report = asdict(st)
    return json.dumps(_finite(report | {"slurm": report["job"]}), allow_nan=False)  # and the job's older key


def _number(value) -> str:
    if isinstance(value, float):
        return f"{value:.2f}" if abs(value) >= 100 else f"{value:.4f}"
    return str(value)


def _line(label: str, text: str) -> str:
    return f"{label:<10} {text}"


def _progress_lines(st: RunStatus) -> list[str]:
    of = f" / {st.max_steps} ({st.progress:.1%})" if st.max_steps else ""
    tokens = f", {st.tokens:,} tokens" if st.tokens is not None else ""
    lines = [_line("step", f"{st.step}{of}{tokens}")]
    if st.source_tokens:
        lines.append(_line("sources", ", ".join(f"{name} {n:,} tokens" for name, n in st.source_tokens.items())))
    if st.loss is not None:
        heads = f" (heads {', '.join(_number(h) for h in st.head_losses)})" if st.head_losses else ""
        mean = f", {_number(st.loss_recent_mean)} mean of the last {st.recent_records} logged steps" if (
            st.loss_recent_mean is not None) else ""
        lines.append(_line("loss", f"{_number(st.loss)} last{mean}{heads}"))
    if st.grad_norms:
        lines.append(_line("grad norms", ", ".join(f"{k} {_number(v)}" for k, v in st.grad_norms.items())))
    if st.tokens_per_s is not None:
        mfu = f", MFU {st.mfu:.1%}" if st.mfu is not None else ""
        lines.append(_line("throughput", f"{st.tokens_per_s:,.0f} tokens/s{mfu} "
                                         f"(mean of the last {st.recent_records} logged steps)"))
    stale = (f"  STALE: nothing logged for over {duration(st.stale_after_s)} (check the job's log)"
             if st.stale else "")
    lines.append(_line("last log", f"{duration(st.last_step_age_s)} ago{stale}"))
    if st.finished:
        lines.append(_line("ETA", "finished"))
    elif st.eta_s is not None:
        lines.append(_line("ETA", f"{duration(st.eta_s)} ({st.max_steps - st.step:,} steps at "
                                  f"{st.seconds_per_step:.3g} s/step, training time only)"))
    return lines


def _job_lines(st: RunStatus) -> list[str]:
    lines = []
    if job := st.job:
        state = job.state or "state unknown (not known to its scheduler, or the scheduler cannot be asked from here)"
        restarts = f", {job.restarts} restart{'s' if job.restarts != 1 else ''}" if job.restarts is not None else ""
        details = ", ".join(str(x) for x in (
            job.submitted and f"submitted {job.submitted}", job.cluster,
            job.nodes and f"{job.nodes} node{'s' if job.nodes != 1 else ''}",
            job.submissions > 1 and f"{job.submissions} submissions") if x)
        lines.append(_line("job", f"{job.job_id} {state}{restarts}" + (f" ({details})" if details else "")))
    if lock := st.lock:
        takeover = ("the next train takes the lock over" if lock.next_train_takes_over else
                    f"train takes the lock over once its heartbeat is {STALE_S // 60} min old")
        gone = f"  (holder gone: {lock.holder_gone}; {takeover})" if lock.holder_gone else ""
        lines.append(_line("lock", f"{lock.host} pid {lock.pid}, started {lock.started}, "
                                   f"heartbeat {duration(lock.heartbeat_age_s)} ago{gone}"))
    return lines


def _checkpoint_lines(st: RunStatus) -> list[str]:
    verified = ", digests verified" if st.checkpoint_check == "digests" else ""
    if ck := st.checkpoint:
        lines = [_line("checkpoint", f"{ck.name} (step {ck.step}, {ck.reason}, {duration(ck.age_s)} ago){verified}")]
    else:
        lines = [_line("checkpoint", "none that verifies" if st.damaged_checkpoints else "none yet")]
    for bad in st.damaged_checkpoints:
        lines.append(_line("damaged", f"{bad.name} (step {bad.step}): {bad.problem}"))
    if st.damaged_checkpoints and st.checkpoint:
        lines.append(_line("", "train --resume auto moves the damaged ones to checkpoints/corrupt/ and continues from "
                               f"{st.checkpoint.name}"))
    elif st.damaged_checkpoints:
        lines.append(_line("", "train --resume auto refuses to start: copy the damaged files back intact"))
    return lines


def render(st: RunStatus) -> str:
    """The human-readable report."""
    lines = [_line("run", f"{st.run_dir} ({st.preset or ('custom config' if st.max_steps else 'no config.yaml yet')})")]
    if st.step is None:
        lines.append(_line("step", "no steps logged yet" + (f" (of {st.max_steps})" if st.max_steps else "")))
    else:
        lines += _progress_lines(st)
    lines += _checkpoint_lines(st)
    if val := st.validation:
        lines.append(_line("validation", f"step {val['step']}: " + ", ".join(
            f"{k} " + (f"[{' '.join(map(_number, v))}]" if isinstance(v, list) else _number(v))
            for k, v in val.items() if k != "step")))
    if counters := [f"{k} {getattr(st, k)}" for k in COUNTERS if getattr(st, k) is not None]:
        lines.append(_line("counters", ", ".join(counters)))
    for n, r in enumerate(st.rollbacks, start=1):
        lines.append(_line("rollback" if n == 1 else "", f"{n}: at step {r['step']} (spikes at "
                           f"{', '.join(map(str, r['spikes']))}) back to {r['checkpoint']}, global samples "
                           f"{r['skipped'][0]}-{r['skipped'][1] - 1} skipped"))
    return "\n".join(lines + rank_lines(st.ranks, _line) + _job_lines(st))


def status(run_dir: str | Path, stale_minutes: float | None = None, verify: bool = False) -> str:
    return render(gather(run_dir, stale_minutes, verify))


# ---------------------------------------------------------------- command line

def positive_number(text: str) -> float:
    """An argparse type: a number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def command_target(run_dir: str | None, watch: str | None) -> tuple[str, float | None]:
    """(run directory, refresh seconds or None); accepts ``--watch RUN_DIR`` as ``RUN_DIR --watch``."""
    seconds = None
    if watch is not None:
        try:
            seconds = positive_number(watch)
        except argparse.ArgumentTypeError as e:
            if run_dir is not None:
                raise ConfigError(f"--watch {watch}: {e}") from None
            run_dir, seconds = watch, DEFAULT_WATCH_S
    if run_dir is None:
        raise ConfigError("status needs a run directory: mhf-dist status RUN_DIR [--watch [SECONDS]]")
    return run_dir, seconds


def show(run_dir: str, as_json: bool = False, watch: float | None = None, stale_minutes: float | None = None,
         verify: bool = False) -> int:
    """Print the report once, or every ``watch`` seconds until Ctrl-C (exit 0)."""
    report = (lambda: to_json(gather(run_dir, stale_minutes, verify))) if as_json else (
        lambda: status(run_dir, stale_minutes, verify))
    if watch is None:
        print(report())
        return 0
    clear = not as_json and sys.stdout.isatty()
    try:
        while True:
            text = report()
            if clear:
                text = f"\033[H\033[2J{text}\n\nrefreshing every {watch:g} s; Ctrl-C stops"
            elif not as_json:
                text = f"{text}\n"
            print(text, flush=True)
            time.sleep(watch)
    except KeyboardInterrupt:
        return 0
