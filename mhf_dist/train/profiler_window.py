"""Profiler windows inside a run: ``ProfilerWindow`` records the steps of ``train.profile_steps``, and those a
``RUN/profile-now`` file asks a running run for, with ``torch.profiler`` on the ranks of ``train.profile_ranks``: a
trace per rank, and on GPUs each rank's CUDA memory history, in ``RUN/profiles/step-FIRST-LAST/``
(``Recording``). How the ranks agree on a window, and why so: docs/design-training.md ("Training loop");
what a window costs: docs/profiling.md ("Profiling inside a run").
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

from mhf_dist.config import TrainConfig
from mhf_dist.storage.run_dir import MEMORY_FILE, TRACE_FILE, RunDir
from mhf_dist.train.callbacks import Callback, RunContext, Stepped

MEMORY_ENTRIES = 100_000  # the allocations and frees a CUDA memory history keeps (the newest)


# The CUDA memory history has no public API: these two private functions of torch.cuda.memory are the package's
# only use of it, kept here; tests/test_profiler_window.py checks them against the installed torch.
def start_memory_history(device: torch.device) -> None:
    """Record every allocation and free on ``device`` from now on, with its Python stack."""
    torch.cuda.memory._record_memory_history(
        max_entries=MEMORY_ENTRIES, stacks="python", device=device
    )


def stop_memory_history(device: torch.device) -> None:
    torch.cuda.memory._record_memory_history(enabled=None, device=device)


def dump_memory_history(path: Path, device: torch.device) -> None:
    """Write what was recorded on ``device`` (a snapshot for https://pytorch.org/memory_viz), then stop."""
    try:
        torch.cuda.memory._dump_snapshot(str(path))
    finally:
        stop_memory_history(device)


def _written(path: Path, write) -> Path:
    """``write(name)`` into a name beside ``path``, then renamed to it: a listing never finds a file half written."""
    partial = path.with_name(path.name + ".partial")
    try:
        write(str(partial))
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path


class Recording:
    """One window's profiler on this rank, started at its first step: the operators with their shapes and Python
    stacks (and the device's kernels), each step inside a ``ProfilerStep#N`` range, as ``torch.profiler``'s own
    schedule names them; on a GPU the memory history too."""

    def __init__(self, device: torch.device):
        from torch.profiler import ProfilerActivity, profile

        self.device, self.cuda = device, device.type == "cuda"
        self.marker: torch.profiler.record_function | None = None
        if self.cuda:
            start_memory_history(device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        try:
            self.profiler = profile(activities=activities, record_shapes=True, with_stack=True)
            self.profiler.start()
        except Exception:
            if self.cuda:
                stop_memory_history(device)
            raise

    def begin(self, step: int) -> None:
        self.marker = torch.profiler.record_function(f"ProfilerStep#{step}")
        self.marker.__enter__()

    def end(self) -> None:
        if self.marker is not None:
            self.marker.__exit__(None, None, None)
            self.marker = None

    def finish(self, folder: Path, rank: int) -> list[Path]:
        """Stop and write this rank's files into ``folder`` (the memory history first: it records until then);
        returns them."""
        self.end()
        self.profiler.stop()
        trace, memory = folder / TRACE_FILE.format(rank), folder / MEMORY_FILE.format(rank)
        written = []
        try:
            folder.mkdir(parents=True, exist_ok=True)
            if self.cuda:
                written.append(
                    _written(memory, lambda p: dump_memory_history(Path(p), self.device))
                )
        finally:
            if self.cuda and not written:  # the history stops whatever failed
                stop_memory_history(self.device)
        return [_written(trace, self.profiler.export_chrome_trace), *written]


def trigger_steps(text: str, default: int) -> tuple[int, str | None]:
    """The steps a ``RUN/profile-now`` file holding ``text`` asks for (empty: ``default``), and what is wrong with
    the text, if anything (then ``default``)."""
    text = text.strip()
    if not text:
        return default, None
    if text.isdigit() and int(text) >= 1:
        return int(text), None
    return default, f"holds {text[:40]!r}, not a number of steps"


class ProfilerWindow(Callback):
    """The profiler windows of a run: the steps of ``train.profile_steps``, and the ``train.profile_window`` steps
    (or the number the file holds) after a step at whose end rank 0 found ``RUN/profile-now`` (it removes the file).
    Rank 0's request rides on the step's agreed flags (``Callback.flag``), so every rank profiles the same steps;
    a window's steps are those in a row that either names. The ranks of ``train.profile_ranks`` record it
    (``Recording``); outside a window no profiler exists."""

    def __init__(self, train: TrainConfig):
        self.steps, self.window, self.ranks = (
            train.profiled_steps,
            train.profile_window,
            train.profile_ranks,
        )
        self.flagged: int | None = None  # the step the ranks agreed a file's window records next
        self.asked = 0  # rank 0: steps the file asked for that are still to begin
        self.first: int | None = None  # the window under way: its first step
        self.last = 0  # and its last so far
        self.recording: Recording | None = None  # this rank's, while a window is under way
        self.unreadable = False  # rank 0 could not take the file (said once)

    def on_start(self, run: RunContext) -> None:
        self.run: RunDir = run.run
        self.rank, self.device = run.job.rank, run.job.device
        self.records = self.ranks is None or self.rank in self.ranks
        # the lowest recording rank says where a window went
        self.says = self.rank == min(self.ranks or [0])
        if self.rank == 0 and (
            lacking := sorted({r for r in self.ranks or [] if r >= run.job.world})
        ):
            self._warn(
                f"train.profile_ranks names {', '.join(map(str, lacking))}, which this job of "
                f"{run.job.world} ranks lacks: they record nothing"
            )

    def profiles(self, step: int) -> bool:
        """Whether ``step`` is in a window (alike on every rank, as soon as the step before it ended)."""
        return step == self.flagged or (
            self.steps is not None and self.steps[0] <= step <= self.steps[1]
        )

    def flag(self) -> bool:
        """Rank 0: whether the next step is one a ``RUN/profile-now`` asked for (looked for at each step's end)."""
        if self.rank == 0:
            self._take_trigger()
        return self.asked > 0

    def _take_trigger(self) -> None:
        trigger = self.run.profile_trigger
        try:
            text = trigger.read_text(errors="replace")
            trigger.unlink()
        except FileNotFoundError:
            return
        except OSError as e:  # unreadable, or kept: said once, the run goes on
            if not self.unreadable:
                self._warn(f"{trigger} cannot be read and removed ({e}); remove it to ask again")
            self.unreadable = True
            return
        self.unreadable = False
        steps, problem = trigger_steps(text, self.window)
        if problem is not None:
            self._warn(f"{trigger} {problem}: profiling train.profile_window={self.window} steps")
        self.asked = max(self.asked, steps)
        tqdm.write(f"{trigger}: profiling the next {steps} step{'s' if steps > 1 else ''}")

    def flag_agreed(self, step: int, raised: bool) -> None:
        self.flagged = step + 1 if raised else None
        self.asked = max(0, self.asked - raised)

    def before_step(self, step: int) -> None:
        if not self.profiles(step):
            return
        if self.first is None:
            self.first = step
            try:
                self.recording = Recording(self.device) if self.records else None
            except Exception as e:  # a profiler that cannot start leaves the run as it was
                self._warn(f"rank {self.rank} records no profile from step {step}: {e}")
        self.last = step
        if self.recording is not None:
            self.recording.begin(step)

    def after_step(self, step: int, stepped: Stepped) -> None:
        if self.recording is not None:
            self.recording.end()
        if self.first is not None and not self.profiles(step + 1):
            self._finish()

    def _finish(self) -> None:
        """The window under way ends: this rank's files written."""
        if self.first is None:
            return
        first, last, recording = self.first, self.last, self.recording
        self.first, self.recording = None, None
        if recording is None:
            return
        folder = self.run.profile_dir(first, last)
        try:
            written = recording.finish(folder, self.rank)
        except Exception as e:  # a full disk, say: the run goes on
            self._warn(f"rank {self.rank}'s profile of steps {first}-{last} was not written: {e}")
            return
        if self.says:
            tqdm.write(
                f"profiled step{'s' if last > first else ''} {first}"
                + (f"-{last}" if last > first else "")
                + f": {folder}/ ({', '.join(p.name for p in written)}, and each profiled rank's)"
            )

    def on_rollback(self, step: int) -> None:
        """Going back ends a window, and what a file asked for that is still ahead."""
        self._finish()
        self.flagged, self.asked = None, 0

    def on_end(self, step: int) -> None:
        self._finish()

    def close(self, finished: bool) -> None:
        """After an error inside a window, what was recorded is still written (an out-of-memory's history)."""
        self._finish()

    def _warn(self, text: str) -> None:
        print(f"warning: {text}", file=sys.stderr, flush=True)
