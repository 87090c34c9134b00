"""``mhf-dist status RUN_DIR``: a run's progress from its files (no process needs to be running).

``run_status`` gathers what the run's files and its scheduler say (``gather``, ``RunStatus``); this module renders it,
as the report (``render``) or as ``--json`` (``to_json``), and holds the command (``show``, with ``--watch``). It
imports neither torch nor numpy, so it starts fast. What the report says and how rates and the ETA are derived:
docs/training.md ("Monitoring: status"), with every ``--json`` key in its "status --json" table.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path

from mhf_dist.cluster.rank_status import rank_lines
from mhf_dist.cluster.run_status import COUNTERS, STALE_FLOOR_S, STALE_INTERVALS, RunStatus, gather
from mhf_dist.config import ConfigError
from mhf_dist.errors import OOM_EXIT_CODE
from mhf_dist.storage.run_lock import STALE_S
from mhf_dist.train.console import duration

DEFAULT_WATCH_S = 10.0
STALE_HELP = (
    f"flag the run STALE when nothing was logged for this long (default: max({STALE_FLOOR_S / 60:g} min, "
    f"{STALE_INTERVALS} x the recent mean interval between logged steps, estimated from tokens/s))"
)


# ---------------------------------------------------------------- the report


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
    # and the job's older key
    return json.dumps(_finite(report | {"slurm": report["job"]}), allow_nan=False)


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
    if sched := st.schedule:
        decay = (
            f" (decay after step {sched['decay_start']:,}"
            + (f" to {st.max_steps:,})" if st.max_steps else ")")
            if sched["decay_start"] is not None
            else ""
        )
        lines.append(
            _line("schedule", f"{sched['name']}, {sched['phase']} at step {st.step}{decay}")
        )
    if st.source_tokens:
        lines.append(
            _line(
                "sources", ", ".join(f"{name} {n:,} tokens" for name, n in st.source_tokens.items())
            )
        )
    if st.loss is not None:
        heads = (
            f" (heads {', '.join(_number(h) for h in st.head_losses)})" if st.head_losses else ""
        )
        if st.z_loss is not None:
            heads += f" (z-loss {_number(st.z_loss)})"
        mean = (
            f", {_number(st.loss_recent_mean)} mean of the last {st.recent_records} logged steps"
            if (st.loss_recent_mean is not None)
            else ""
        )
        lines.append(_line("loss", f"{_number(st.loss)} last{mean}{heads}"))
    if st.grad_norms:
        lines.append(
            _line("grad norms", ", ".join(f"{k} {_number(v)}" for k, v in st.grad_norms.items()))
        )
    if st.tokens_per_s is not None:
        mfu = f", MFU {st.mfu:.1%}" if st.mfu is not None else ""
        lines.append(
            _line(
                "throughput",
                f"{st.tokens_per_s:,.0f} tokens/s{mfu} "
                f"(mean of the last {st.recent_records} logged steps)",
            )
        )
    stale = (
        f"  STALE: nothing logged for over {duration(st.stale_after_s)} (check the job's log)"
        if st.stale
        else ""
    )
    lines.append(_line("last log", f"{duration(st.last_step_age_s)} ago{stale}"))
    if st.finished:
        lines.append(_line("ETA", "finished"))
    elif st.eta_s is not None:
        lines.append(
            _line(
                "ETA",
                f"{duration(st.eta_s)} ({st.max_steps - st.step:,} steps at "
                f"{st.seconds_per_step:.3g} s/step, training time only)",
            )
        )
    return lines


def _job_lines(st: RunStatus) -> list[str]:
    lines = []
    if job := st.job:
        state = (
            job.state
            or "state unknown (not known to its scheduler, or the scheduler cannot be asked from here)"
        )
        restarts = (
            f", {job.restarts} restart{'s' if job.restarts != 1 else ''}"
            if job.restarts is not None
            else ""
        )
        details = ", ".join(
            str(x)
            for x in (
                job.submitted and f"submitted {job.submitted}",
                job.cluster,
                job.nodes and f"{job.nodes} node{'s' if job.nodes != 1 else ''}",
                job.submissions > 1 and f"{job.submissions} submissions",
            )
            if x
        )
        lines.append(
            _line("job", f"{job.job_id} {state}{restarts}" + (f" ({details})" if details else ""))
        )
    if lock := st.lock:
        takeover = (
            "the next train takes the lock over"
            if lock.next_train_takes_over
            else f"train takes the lock over once its heartbeat is {STALE_S // 60} min old"
        )
        gone = f"  (holder gone: {lock.holder_gone}; {takeover})" if lock.holder_gone else ""
        lines.append(
            _line(
                "lock",
                f"{lock.host} pid {lock.pid}, started {lock.started}, "
                f"heartbeat {duration(lock.heartbeat_age_s)} ago{gone}",
            )
        )
    return lines


def _checkpoint_lines(st: RunStatus) -> list[str]:
    verified = ", digests verified" if st.checkpoint_check == "digests" else ""
    if ck := st.checkpoint:
        lines = [
            _line(
                "checkpoint",
                f"{ck.name} (step {ck.step}, {ck.reason}, {duration(ck.age_s)} ago){verified}",
            )
        ]
    elif st.checkpoint_store is not None and not st.damaged_checkpoints:
        lines = []  # the stored ones below; RUN/checkpoints holds none
    else:
        lines = [
            _line("checkpoint", "none that verifies" if st.damaged_checkpoints else "none yet")
        ]
    for bad in st.damaged_checkpoints:
        lines.append(_line("damaged", f"{bad.name} (step {bad.step}): {bad.problem}"))
    if st.damaged_checkpoints and st.checkpoint:
        lines.append(
            _line(
                "",
                "train --resume auto moves the damaged ones to checkpoints/corrupt/ and continues from "
                f"{st.checkpoint.name}",
            )
        )
    elif st.damaged_checkpoints:
        lines.append(
            _line("", "train --resume auto refuses to start: copy the damaged files back intact")
        )
    if st.checkpoint_store is not None:
        lines.append(_line("stored", st.store_error or st.checkpoint_store))
        for ck in st.stored_checkpoints or []:
            state = "complete" if ck["complete"] else f"incomplete: {ck['problem']}"
            lines.append(_line("", f"{ck['name']} ({state})"))
        if st.stored_checkpoints == []:
            lines.append(_line("", "no checkpoint yet"))
    return lines


def render(st: RunStatus) -> str:
    """The human-readable report."""
    lines = [
        _line(
            "run",
            f"{st.run_dir} ({st.preset or ('custom config' if st.max_steps else 'no config.yaml yet')})",
        )
    ]
    if st.step is None:
        lines.append(
            _line("step", "no steps logged yet" + (f" (of {st.max_steps})" if st.max_steps else ""))
        )
    else:
        lines += _progress_lines(st)
    lines += _checkpoint_lines(st)
    if val := st.validation:
        lines.append(
            _line(
                "validation",
                f"step {val['step']}: "
                + ", ".join(
                    f"{k} "
                    + (f"[{' '.join(map(_number, v))}]" if isinstance(v, list) else _number(v))
                    for k, v in val.items()
                    if k != "step"
                ),
            )
        )
    if scores := st.downstream:
        lines.append(
            _line(
                "downstream",
                f"step {scores['step']}: "
                + ", ".join(
                    f"{k.removeprefix('eval/').replace('/', ' ')} {_number(v)}"
                    for k, v in scores.items()
                    if k != "step" and isinstance(v, (int, float))
                ),
            )
        )
    if counters := [f"{k} {getattr(st, k)}" for k in COUNTERS if getattr(st, k) is not None]:
        lines.append(_line("counters", ", ".join(counters)))
    for n, r in enumerate(st.rollbacks, start=1):
        lines.append(
            _line(
                "rollback" if n == 1 else "",
                f"{n}: at step {r['step']} (spikes at "
                f"{', '.join(map(str, r['spikes']))}) back to {r['checkpoint']}, global samples "
                f"{r['skipped'][0]}-{r['skipped'][1] - 1} skipped",
            )
        )
    lines += _profile_lines(st)
    if oom := st.out_of_memory:
        after = (
            f"; the run went on to step {st.step} since"
            if st.step is not None and st.step >= oom.step
            else f" (exit {OOM_EXIT_CODE}, not requeued)"
        )
        lines.append(
            _line(
                "oom",
                f"out of memory at step {oom.step}, {duration(oom.age_s)} ago: "
                f"{_count(len(oom.ranks), 'rank')} ({', '.join(map(str, oom.ranks))}), "
                f"reports in {oom.folder}{after}",
            )
        )
    return "\n".join(lines + rank_lines(st.ranks, _line) + _job_lines(st))


def _profile_lines(st: RunStatus) -> list[str]:
    """One line per profiler window: its steps, its files and where they are."""
    lines = []
    for n, p in enumerate(st.profiles):
        steps = (
            f"steps {p.first_step}-{p.last_step}"
            if p.last_step > p.first_step
            else f"step {p.first_step}"
        )
        files = _count(len(p.traces), "trace") + (
            f", {_count(len(p.memory_snapshots), 'memory snapshot')}" if p.memory_snapshots else ""
        )
        lines.append(_line("" if n else "profile", f"{steps}: {files} in {p.path}"))
    return lines


def _count(n: int, thing: str) -> str:
    return f"{n} {thing}{'' if n == 1 else 's'}"


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
        raise ConfigError(
            "status needs a run directory: mhf-dist status RUN_DIR [--watch [SECONDS]]"
        )
    return run_dir, seconds


def show(
    run_dir: str,
    as_json: bool = False,
    watch: float | None = None,
    stale_minutes: float | None = None,
    verify: bool = False,
) -> int:
    """Print the report once, or every ``watch`` seconds until Ctrl-C (exit 0)."""
    report = (
        (lambda: to_json(gather(run_dir, stale_minutes, verify)))
        if as_json
        else (lambda: status(run_dir, stale_minutes, verify))
    )
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
