"""A training step that ran out of memory: what the rank saw (``OomFacts``), the report it writes, what rank 0 says
and the settings it names (``lower_memory``), and ``OomWatch``, rank 0's look for another rank's report.

The loop turns the error (``is_out_of_memory``) into ``StepOutOfMemory``; the command line adds what ``plan``
estimates for the layout and calls ``out_of_memory``, which writes ``RUN/oom/<time>/rank-N.txt`` (``rank-N.json``
beside it for rank 0, ``RUN/oom/last.json`` for the job script) and returns ``OOM_EXIT_CODE``. Rank 0
learns of another rank's report on the shared filesystem, when its collective fails or from ``OomWatch``.
Why: docs/design-training.md ("Training loop"); what a user sees: docs/faults.md.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from mhf_dist.atomic import write_atomic
from mhf_dist.backend import checkpoint_interval, zero_stage
from mhf_dist.config import RunConfig
from mhf_dist.errors import OOM_EXIT_CODE
from mhf_dist.storage.run_dir import RunDir
from mhf_dist.train.callbacks import Callback, RunContext
from mhf_dist.train.checkpoint.store import saved_checkpoints
from mhf_dist.train.profiler_window import dump_memory_history
from mhf_dist.train.throughput import memory_gb

if TYPE_CHECKING:
    from mhf_dist.parallel.layout import Layout
    from mhf_dist.train.process_group import Job

# torch's CPU allocator reports a failed allocation as a plain RuntimeError with this text
CPU_ALLOCATOR_FAILURE = "DefaultCPUAllocator: can't allocate memory"
WATCH_S = 1.0  # how often rank 0 looks for another rank's report
# how long a rank whose collective failed looks for a report (a shared filesystem may show it late)
REPORT_WAIT_S = 2.0
# a report of this start may look this much older than the start (a file server's clock)
CLOCK_SLACK_S = 1.0
GB = 2**30


def is_out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` is a failed allocation: a device's (CUDA, ROCm), the host's, or torch's CPU allocator's."""
    return isinstance(e, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(e, RuntimeError) and CPU_ALLOCATOR_FAILURE in str(e)
    )


@dataclass
class OomFacts:
    """What a rank whose step ran out of memory saw, taken where it was caught (its tensors still held)."""

    rank: int
    world: int
    step: int
    micro_batch: int  # sequences per micro-batch (train.micro_batch_size)
    seq_len: int
    accum: int  # micro-batches per step on this rank
    device: str  # cuda or cpu
    layout: str  # "tp=1 pp=1 dp=2, ZeRO-1, fp32"
    stage: int  # this rank's pipeline stage
    vocab_size: int
    peak_gb: float
    peak_what: str  # what the peak measures
    summary: str | None  # the allocator's summary; None on CPU
    snapshot: str  # the snapshot's file, or why there is none
    error: str
    trace: str
    folder: str  # RUN/oom/<time>
    advice: list[str]  # lower_memory's settings

    @property
    def shape(self) -> str:
        return f"micro-batch {self.micro_batch} × {self.seq_len} tokens"


class StepOutOfMemory(Exception):
    """A training step ran out of memory on this rank (``facts``); the command line writes the report."""

    def __init__(self, facts: OomFacts):
        super().__init__(f"step {facts.step} ran out of memory on rank {facts.rank}")
        self.facts = facts


def caught(
    e: BaseException, *, step: int, cfg: RunConfig, job: Job, run: RunDir, vocab_size: int
) -> StepOutOfMemory:
    """``StepOutOfMemory`` for error ``e`` of ``step``, its facts taken now: the peak, the allocator's summary and, on
    a GPU, a snapshot of its memory into ``RUN/oom/<time>/`` (ranks out of memory in the same second share it)."""
    folder = run.oom_dir / time.strftime("%Y-%m-%dT%H-%M-%SZ", time.gmtime())
    folder.mkdir(parents=True, exist_ok=True)
    cuda, layout, zero = job.device.type == "cuda", job.layout, zero_stage(job.ds_config)
    if cuda:
        total = torch.cuda.get_device_properties(job.device).total_memory / GB
        peak_what = f"the peak allocated by torch (of the device's {total:.1f} GB)"
        summary = _cuda_summary(job.device)
        snapshot = dump_snapshot(folder / f"rank-{job.rank}-snapshot.pickle", job.device)
    else:
        peak_what, summary = "the process's peak resident memory (VmHWM)", None
        snapshot = "none (CPU ranks have no device allocator)"
    return StepOutOfMemory(
        OomFacts(
            rank=job.rank,
            world=job.world,
            step=step,
            micro_batch=cfg.train.micro_batch_size,
            seq_len=cfg.data.seq_len,
            accum=layout.accum,
            device=job.device.type,
            layout=f"tp={layout.tp} pp={layout.pp} dp={layout.dp}, ZeRO-{zero}, {cfg.train.dtype}",
            stage=job.groups.pp_rank,
            vocab_size=vocab_size,
            peak_gb=memory_gb(job.device),
            peak_what=peak_what,
            summary=summary,
            snapshot=snapshot,
            error=f"{type(e).__name__}: {e}",
            trace="".join(traceback.format_exception(e)),
            folder=str(folder),
            advice=lower_memory(cfg, layout, zero, checkpoint_interval(cfg, job.ds_config)),
        )
    )


def _cuda_summary(device: torch.device) -> str:
    try:
        return torch.cuda.memory_summary(device)
    except Exception as e:  # the report is written whatever the allocator answers
        return f"not available: {e}"


def dump_snapshot(path: Path, device: torch.device) -> str:
    """The CUDA caching allocator's snapshot in ``path`` (its segments and blocks now, and the allocations a profiler
    window was recording), for https://pytorch.org/memory_viz; returns the path, or why there is none."""
    try:
        dump_memory_history(path, device)
    except Exception as e:
        return f"none ({type(e).__name__}: {e})"
    return str(path)


def lower_memory(cfg: RunConfig, layout: Layout, zero: int, interval: int) -> list[str]:
    """The settings that lower a rank's memory, in the order they help (``--set`` lines with the value now and what
    changes); a setting already at its least is named at the end. ``zero``: the ZeRO stage, ``interval``: the
    activation checkpointing interval in effect."""
    t, m = cfg.train, cfg.model
    found, least = [], []
    per_replica = t.global_batch_size // layout.dp
    smaller = [b for b in range(t.micro_batch_size - 1, 0, -1) if per_replica % b == 0]
    if smaller:
        found.append(
            f"--set train.micro_batch_size={smaller[0]} (now {t.micro_batch_size}: each micro-batch's activations "
            f"shrink with it; the global batch of {t.global_batch_size} stays, in more micro-batches)"
        )
    else:
        least.append("train.micro_batch_size=1")
    if interval != 1:
        found.append(
            f"--set parallel.activation_checkpoint_interval=1 (now {interval}: every block's activations are "
            "recomputed in backward instead of kept, for about a third more compute)"
        )
    else:
        least.append("parallel.activation_checkpoint_interval=1")
    if zero < 3 and layout.pp == 1 and layout.dp > 1:
        found.append(
            f"--set parallel.zero_stage=3 (now {zero}: weights, gradients and optimizer states are sharded over "
            f"the {layout.dp} data-parallel ranks)"
        )
    elif zero < 3:
        least.append(
            f"parallel.zero_stage={zero} ("
            + (
                "the pipeline engine takes ZeRO-1)"
                if layout.pp > 1
                else "one data-parallel rank: nothing to shard)"
            )
        )
    else:
        least.append("parallel.zero_stage=3")
    if _splits(cfg, tp := 2 * layout.tp):
        found.append(
            f"--set parallel.tp={tp} (now {layout.tp}: the tables, attention heads and FFN are split over {tp} "
            + (
                "ranks, which leaves the same ranks half the data-parallel replicas)"
                if layout.dp % 2 == 0
                else "ranks: launch twice the ranks)"
            )
        )
    tokens = t.micro_batch_size * cfg.data.seq_len
    chunk = m.decoder_chunk_tokens
    if m.hash.p_inf_loss_weight:
        least.append("model.decoder_chunk_tokens (unused: the P_inf loss runs the decoder unfused)")
    elif chunk == 0 or min(chunk, tokens) > 1:
        value = min(8192, tokens) if chunk == 0 else min(chunk, tokens) // 2
        found.append(
            f"--set model.decoder_chunk_tokens={value} (now {chunk}: the decoder's logits are held for "
            f"{value} tokens at a time; a model field, so for a new run: a checkpoint fixes the model)"
        )
    return found + ([f"already at their least: {', '.join(least)}"] if least else [])


def _splits(cfg: RunConfig, tp: int) -> bool:
    """Whether the run's config takes ``parallel.tp=tp`` (the model splits over it)."""
    raw = cfg.model_dump(mode="json")
    raw["parallel"]["tp"] = tp
    try:
        RunConfig.model_validate(raw)
    except ValueError:
        return False
    return True


def newest_checkpoint(run: RunDir) -> str | None:
    """The name of the run's newest complete checkpoint, or None."""
    saved = saved_checkpoints(run)
    return saved[-1].name if saved else None


def out_of_memory(
    facts: OomFacts, estimate: Callable[[], float], since: float, label: str = ""
) -> int:
    """Write this rank's report (with ``estimate()``: the step peak ``plan`` estimates for its stage of this
    layout, in GB), say it (rank 0: the whole message, another rank one line, ``label`` naming it) and return
    ``OOM_EXIT_CODE``. ``since``: when this start began (rank 0 names every report of it)."""
    try:
        planned, why = estimate(), ""
    except Exception as e:  # the report is written whatever the plan makes of this run
        planned, why = None, f"{type(e).__name__}: {e}"
    report = _write(facts, planned, why)
    run = RunDir(Path(facts.folder).parent.parent)
    if facts.rank == 0:
        tell(run, reports_since(run, since) or [_brief(facts, planned, report)])
    else:
        print(
            f"mhf-dist{label}: out of memory at step {facts.step}; report: {report}",
            file=sys.stderr,
        )
    return OOM_EXIT_CODE


def _summary(facts: OomFacts, planned: float | None) -> str:
    against = (
        f"against the {planned:.2f} GB that plan estimates for this layout"
        if planned is not None
        else "(plan made no estimate)"
    )
    return f"rank {facts.rank} at step {facts.step} ({facts.shape}): peak {facts.peak_gb:.2f} GB {against}"


def _brief(facts: OomFacts, planned: float | None, report: Path) -> dict:
    """What ``rank-N.json`` holds: what rank 0 says of this report."""
    return {
        "rank": facts.rank,
        "step": facts.step,
        "summary": _summary(facts, planned),
        "advice": facts.advice,
        "report": str(report),
    }


def _write(facts: OomFacts, planned: float | None, why: str) -> Path:
    """``rank-N.txt`` (for a person), ``rank-N.json`` (for rank 0) and ``RUN/oom/last.json`` (for the job script)."""
    folder = Path(facts.folder)
    report = folder / f"rank-{facts.rank}.txt"
    estimate = (
        f"{planned:.2f} GB, what `mhf-dist plan` estimates for pipeline stage {facts.stage} of this layout "
        "(model states, activations, DeepSpeed's buffers, and on CPU the runtime)"
        if planned is not None
        else f"none ({why})"
    )
    lines = [
        f"rank {facts.rank} of {facts.world} ran out of memory at step {facts.step}",
        f"step: {facts.step}, {facts.accum} micro-batch(es) per step on this rank",
        f"micro-batch shape: [{facts.micro_batch}, {facts.seq_len}] ({facts.micro_batch} sequences × "
        f"{facts.seq_len} tokens: train.micro_batch_size × data.seq_len)",
        f"layout: {facts.layout}; this rank's pipeline stage: {facts.stage}",
        f"peak reached: {facts.peak_gb:.2f} GB, {facts.peak_what}",
        f"estimate: {estimate}",
        "allocator summary: "
        + (
            "below (torch.cuda.memory_summary)"
            if facts.summary
            else "none: a CPU rank allocates through the host's allocator, which keeps no summary"
        ),
        f"memory snapshot: {facts.snapshot}",
        f"error: {facts.error}",
        "",
        "settings that lower memory, in the order they help:",
        *(f"  {a}" for a in facts.advice),
        "",
        facts.trace.rstrip(),
        *(["", facts.summary.rstrip()] if facts.summary else []),
    ]
    write_atomic(report, "\n".join(lines) + "\n")
    brief = _brief(facts, planned, report)
    write_atomic(report.with_suffix(".json"), json.dumps(brief))
    write_atomic(
        folder.parent / "last.json", json.dumps({"folder": str(folder), "step": facts.step})
    )
    return report


def reports_since(run: RunDir, since: float) -> list[dict]:
    """What ``rank-N.json`` says of each step out of memory since ``since`` (this start), by rank."""
    if not run.oom_dir.is_dir():
        return []
    found = []
    for folder in run.oom_dir.iterdir():
        try:
            if not folder.is_dir() or folder.stat().st_mtime < since - CLOCK_SLACK_S:
                continue
            found += [json.loads(p.read_text()) for p in folder.glob("rank-*.json")]
        except (OSError, ValueError):  # being written, or not one of ours
            continue
    return sorted(found, key=lambda r: r["rank"])


_SAYING = threading.Lock()
_SAID = threading.Event()


def tell(run: RunDir, reports: list[dict]) -> None:
    """Rank 0's message, once in this process (a failed collective and ``OomWatch`` may both find the reports):
    which ranks ran out of memory, at which step, their reports, and the settings that lower memory in order."""
    with _SAYING:
        if _SAID.is_set():
            return
        _SAID.set()
    first, others = reports[0], [r["rank"] for r in reports[1:]]
    kept = newest_checkpoint(run)
    lines = [
        f"out of memory: {first['summary']}"
        + (
            f"; rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} too"
            if others
            else ""
        ),
        f"report{'s' if others else ''}: {', '.join(r['report'] for r in reports)}",
        f"the job stops (exit {OOM_EXIT_CODE}, not requeued: the same job would run out again); "
        + (
            f"nothing saved is touched: {kept} stays the newest checkpoint, which a rerun resumes from"
            if kept
            else "no checkpoint was saved yet: a rerun starts from step 0"
        ),
        "settings that lower memory, in the order they help (rerun with the first; add the next if not enough):",
        *(f"  {a}" for a in first["advice"]),
    ]
    print("\n".join(lines), file=sys.stderr, flush=True)


def out_of_memory_elsewhere(run: RunDir, since: float, rank: int) -> list[dict]:
    """After this rank's collective failed: the reports of this start's steps out of memory, looked for for
    ``REPORT_WAIT_S``; rank 0 says them. Empty: the failure was another."""
    deadline = time.monotonic() + REPORT_WAIT_S
    while not (reports := reports_since(run, since)) and time.monotonic() < deadline:
        time.sleep(0.2)
    if reports and rank == 0:
        tell(run, reports)
    return reports


class OomWatch(Callback):
    """Rank 0 looks for another rank's report every ``WATCH_S`` and says it (``tell``) while its training thread
    may still wait in a collective for the rank that left (a GPU collective waits, where gloo's fails at once)."""

    thread: threading.Thread | None = None

    def on_start(self, run: RunContext) -> None:
        self.stop = threading.Event()
        if run.job.rank == 0 and run.job.world > 1:
            self.run, self.since = run.run, time.time()
            self.thread = threading.Thread(target=self._watch, name="oom-watch", daemon=True)
            self.thread.start()

    def _watch(self) -> None:
        while not self.stop.wait(WATCH_S):
            if reports := reports_since(self.run, self.since):
                tell(self.run, reports)
                return

    def close(self, finished: bool) -> None:
        if self.thread is not None:
            self.stop.set()
