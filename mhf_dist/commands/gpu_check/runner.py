"""The check's modes, its rows, and how its commands run: one at a time or side by side, each with its log, its
time limit, its share of the cores, and its seconds in the report as soon as it ends; and a run's logged metrics,
which the steps' checks read."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from mhf_dist.commands.gpu_check.forked import ForkedCommand, forkable

# a checkout's root when installed editable (its .venv, its commit)
ROOT = Path(__file__).resolve().parents[3]
PASS, FAIL, MEASURED, SKIPPED = "PASS", "FAIL", "measured", "skipped"
NOT_RUNNABLE = (
    "not runnable with gloo"  # a 2-rank run that gloo cannot carry on CUDA tensors (not a failure)
)
BF16_TOLERANCE = 1e-2  # relative: bf16 keeps 8 significant bits (see the resume tolerances)


@dataclass(frozen=True)
class Mode:
    """Sizes, tolerances and time of one way of running the check."""

    name: str
    device: str
    dtypes: tuple[str, ...]  # training dtypes whose resume is checked
    steps: int  # training steps per run
    split: int  # checkpoint, stop and resume step
    # per dtype: max relative difference of the losses after resuming
    resume_tolerance: dict[str, float]
    eval_tolerance: float  # relative difference of -log P_inf, eval vs the training loop
    new_tokens: int  # tokens generated per timed call
    profiles: tuple[tuple[str, int], ...]  # (size, seq_len)
    # tools/bench_reference.py: our Standard against transformers' Qwen3 of the same shape, in rounds
    reference_size: str
    reference_shapes: str  # SEQxMICRO, comma-separated
    reference_rounds: int
    profile_dtype: str
    profile_steps: int
    profile_warmup: int
    vocab_sizes: str  # registered vocabularies of the profile's inference-head timing
    jobs: int  # training jobs at once (a GPU runs several tiny ones side by side)
    timeout_s: int  # per command
    compare_steps: int  # C: the layout and feature runs stop here and are compared over steps 1..C
    compare_tolerance: float  # max relative difference of their losses and gradient norms (fp32)
    gloo_layouts: tuple[str, ...]  # 2-rank layouts trained over gloo ("tp=2", "pp=2")
    # further runs, by check name: "compile", "engram-offload", "grad-accum", ...
    features: tuple[str, ...]
    sdpa_dtypes: tuple[str, ...]  # dtypes whose attention backend is reported
    # per command of a 2-rank run (a collective gloo cannot carry may hang, not fail)
    gloo_timeout_s: int
    # each step's expected seconds, in the order of the steps (printed first)
    estimates_s: tuple[float, ...]
    train_overrides: tuple[str, ...] = ()  # settings every training run of the check gets
    # commands forked from one process that has imported what they import (forked.py), not fresh interpreters
    fork_commands: bool = False
    # the stop-and-resume runs evaluate the whole validation split, as the uninterrupted runs do (False: one batch of
    # 8 sequences; only the uninterrupted fp32 run's evaluation is compared, with eval's)
    resumed_eval_whole: bool = True


GPU = Mode(
    name="gpu",
    device="cuda",
    dtypes=("bf16", "fp32"),
    steps=30,
    split=15,
    resume_tolerance={"bf16": BF16_TOLERANCE, "fp32": 1e-5},
    eval_tolerance=1e-4,
    new_tokens=64,
    profiles=(("1b", 2048), ("100m", 2048)),
    reference_size="100m",
    reference_shapes="256x4,2048x1",
    reference_rounds=5,
    profile_dtype="bf16",
    profile_steps=5,
    profile_warmup=2,
    vocab_sizes="32768,131072",
    jobs=14,
    timeout_s=300,
    compare_steps=10,
    compare_tolerance=1e-4,
    gloo_layouts=("tp=2", "pp=2"),
    features=(
        "compile",
        "engram-offload",
        "engram-sharded",
        "grad-accum",
        "profiler-window",
        "document-masking",
        "p-inf-tp2-bf16",
        "profile-tp2-gloo",
    ),
    sdpa_dtypes=("bf16", "fp32"),
    gloo_timeout_s=180,
    estimates_s=(10, 180, 180, 180),
)
CPU = Mode(
    name="cpu",
    device="cpu",
    dtypes=("fp32",),
    steps=8,
    split=4,
    resume_tolerance={"fp32": 0.0},
    eval_tolerance=1e-4,
    new_tokens=8,
    profiles=(("tiny", 128),),
    reference_size="tiny",
    reference_shapes="128x2",
    reference_rounds=2,
    profile_dtype="fp32",
    profile_steps=1,
    profile_warmup=1,
    vocab_sizes="4096",
    jobs=2,
    timeout_s=600,
    compare_steps=4,
    compare_tolerance=1e-4,
    gloo_layouts=("tp=2",),
    features=("grad-accum", "profiler-window", "document-masking"),
    sdpa_dtypes=("fp32",),
    gloo_timeout_s=600,
    estimates_s=(5, 50, 20, 15),
    # 1,024 buckets instead of the preset's 16,384: a CPU step of tiny-h4b16k in a seventh of the time
    train_overrides=("model.hash.num_buckets=1024",),
    fork_commands=True,
    resumed_eval_whole=False,  # on the CPU the whole split's evaluation is most of such a run's time
)


def without(mode: Mode, names: set[str]) -> Mode:
    """``mode`` less the layout and feature runs named (``--skip``)."""
    layouts = {layout_check_name(layout): layout for layout in mode.gloo_layouts}
    unknown = names - layouts.keys() - set(mode.features)
    if unknown:
        raise ValueError(
            f"--skip {','.join(sorted(unknown))}: not a layout or feature run of the {mode.name} mode "
            f"(those are {', '.join([*layouts, *mode.features])})"
        )
    return dataclasses.replace(
        mode,
        features=tuple(name for name in mode.features if name not in names),
        gloo_layouts=tuple(layout for name, layout in layouts.items() if name not in names),
    )


def layout_check_name(layout: str) -> str:
    return f"layout-{layout.replace('=', '')}-gloo"  # tp=2: layout-tp2-gloo


@dataclass
class Check:
    """One row of the summary table."""

    name: str
    status: str  # PASS, FAIL, MEASURED, SKIPPED or NOT_RUNNABLE
    result: str
    values: dict[str, float] = field(default_factory=dict)


class StepFailed(Exception):
    """A command or an expectation that the later steps depend on failed; ``log``: the command's output."""

    def __init__(self, message: str, log: Path | None = None):
        super().__init__(message)
        self.log = log


@dataclass
class Job:
    """Commands run in order, beside the step's other jobs; ``name`` is its check (or run) name."""

    name: str
    commands: list[tuple[str, list[str]]]
    required: bool = True  # later checks read its runs: a failure stops the check
    ranks: int = 1  # 2: two ranks over gloo, whose failure may be a gloo limitation


class Reporter(Protocol):
    """What the commands tell the report: a command ended (the report rewrites itself)."""

    def rewrite(self) -> None: ...


class Context:
    """The mode, the output folders, the commands under way and ended, and the printing shared by the steps."""

    def __init__(self, mode: Mode, out: Path, work: Path, nominal_tflops: float):
        self.mode, self.out, self.work, self.nominal_tflops = mode, out, work, nominal_tflops
        self.logs = out / "logs"
        self.cores = (
            len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity")
            else os.cpu_count() or 1
        )
        self.commands: list[dict] = []  # every ended command: its name, status and seconds
        self.reporter: Reporter | None = None
        self._running: dict[str, tuple[subprocess.Popen, float]] = {}
        self._interrupted = False
        self._lock = threading.Lock()

    def say(self, message: str) -> None:
        with self._lock:
            print(message, flush=True)

    def run(self, name: str) -> Path:
        return self.work / "runs" / name

    def model(self, name: str) -> Path:
        return self.work / "models" / name

    def start(
        self, name: str, cmd: list[str], env: dict[str, str]
    ) -> subprocess.Popen | ForkedCommand:
        """Start a command in its own process group, so that a time limit or an interruption also ends the ranks
        it starts; forked from the server where the mode says so."""
        if self.mode.fork_commands and forkable(cmd):
            return ForkedCommand(cmd[1:], env)
        return subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env=env,
        )

    def ended(self, name: str, status: str, seconds: float) -> None:
        """Record a command's end and rewrite the report, so that a check killed later still has its seconds."""
        with self._lock:
            self._running.pop(name, None)
            self.commands.append({"command": name, "status": status, "seconds": seconds})
        if self.reporter is not None:
            self.reporter.rewrite()

    def interrupt(self) -> None:
        """The check is being stopped (Ctrl-C, SIGTERM): end every command under way and record it as interrupted."""
        with self._lock:
            self._interrupted = True
            running, self._running = self._running, {}
        now = time.perf_counter()
        for name, (proc, began) in running.items():
            kill_group(proc)
            with self._lock:
                self.commands.append(
                    {"command": name, "status": "interrupted", "seconds": now - began}
                )
        if running and self.reporter is not None:
            self.reporter.rewrite()

    def _started(self, name: str, proc: subprocess.Popen, began: float) -> None:
        with self._lock:
            if self._interrupted:  # started by a worker as the check was being stopped
                kill_group(proc)
                raise StepFailed(f"{name} was not run: the check was interrupted")
            self._running[name] = (proc, began)

    def _finished(self, name: str) -> bool:
        """Forget a command that ended; False when ``interrupt`` ended and recorded it."""
        with self._lock:
            return self._running.pop(name, None) is not None


def kill_group(proc: subprocess.Popen | ForkedCommand) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # the group has ended, or a forked command has not yet made it
        proc.kill()


def mhf_dist(ctx: Context, name: str, args: list[str], **limits) -> str:
    """``python -m mhf_dist ARGS`` as ``python`` runs it (``limits``: its ``timeout_s`` and ``threads``)."""
    return python(ctx, name, ["-m", "mhf_dist", *args], **limits)


def python(
    ctx: Context,
    name: str,
    args: list[str],
    timeout_s: int | None = None,
    threads: int | None = None,
) -> str:
    """Run ``python ARGS`` with this interpreter (``mhf-dist`` or a checkout's ``tools/`` script; its output in
    ``OUT/logs/NAME.log``) with ``threads`` OpenMP threads per process (default: every core); returns its stdout,
    raises ``StepFailed`` on a non-zero exit or a timeout (``timeout_s``, default the mode's)."""
    cmd = [sys.executable, *args]
    log = ctx.logs / f"{name}.log"
    timeout_s = timeout_s or ctx.mode.timeout_s
    # a rank that crashes prints its Python stack (PYTHONFAULTHANDLER), which tells a gloo limitation from a defect
    env = os.environ | {
        "PYTHONUNBUFFERED": "1",
        "PYTHONFAULTHANDLER": "1",
        "OMP_NUM_THREADS": str(threads or ctx.cores),
    }
    ctx.say(f"  {name}: started (log {log})")
    began = time.perf_counter()
    proc = ctx.start(name, cmd, env)
    ctx._started(name, proc, began)
    timed_out = False
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        stdout, stderr = proc.communicate()
        timed_out = True
    except BaseException:  # the check is being stopped while this command ran in its own thread
        ctx.interrupt()
        raise
    log.write_text(f"$ {shlex.join(cmd)}\n{stdout}{stderr}")
    seconds = time.perf_counter() - began
    if not ctx._finished(name):
        raise StepFailed(f"{name} was interrupted after {seconds:.0f} s (log {log})", log)
    failed = timed_out or proc.returncode != 0
    ctx.ended(name, "failed" if failed else "done", seconds)
    if failed:
        why = (
            f"was stopped at its time limit of {timeout_s} s"
            if timed_out
            else f"exited {proc.returncode}"
        )
        lines = [line for line in (stdout + stderr).splitlines() if line.strip()]
        tail = "\n".join(f"    {line}" for line in lines[-30:])
        raise StepFailed(
            f"{name} {why} ({seconds:.0f} s): {lines[-1].strip() if lines else 'no output'} "
            f"(log {log})\n{tail}",
            log,
        )
    ctx.say(f"  {name}: done in {seconds:.1f} s")
    return stdout


def threads_per_process(ctx: Context, jobs: list[Job]) -> dict[str, int]:
    """OpenMP threads for each process of each job, so that the processes that run at once share the cores: one job
    at a time takes every core for its ranks; jobs side by side split the cores over the most processes that can run
    together (a 2-rank job is two processes)."""
    if ctx.mode.jobs == 1:
        return {job.name: max(1, ctx.cores // job.ranks) for job in jobs}
    together = sum(sorted((job.ranks for job in jobs), reverse=True)[: ctx.mode.jobs])
    return {job.name: max(1, ctx.cores // together) for job in jobs}


def run_jobs(ctx: Context, jobs: list[Job]) -> dict[str, BaseException | None]:
    """Each job's commands in order, ``mode.jobs`` jobs at once; after all ended, each job's error (None: it
    succeeded) by name. An interruption ends the commands under way before it goes on."""
    threads = threads_per_process(ctx, jobs)

    def run_job(job: Job):
        for name, args in job.commands:
            mhf_dist(
                ctx,
                name,
                args,
                timeout_s=ctx.mode.gloo_timeout_s if job.ranks > 1 else None,
                threads=threads[job.name],
            )

    pool = concurrent.futures.ThreadPoolExecutor(ctx.mode.jobs)
    try:
        futures = {job.name: pool.submit(run_job, job) for job in jobs}
        concurrent.futures.wait(futures.values())
    except BaseException:
        ctx.interrupt()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return {name: future.exception() for name, future in futures.items()}


def metrics(run: Path) -> dict[int, dict]:
    """The run's ``metrics.jsonl`` records by step."""
    from mhf_dist.train.metrics import read_metrics

    return {r["step"]: r for r in read_metrics(run)}
