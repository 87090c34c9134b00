"""The hang watchdog: a thread on every rank that writes the rank's heartbeat (``mhf_dist.storage.heartbeats``) and
ends a job that makes no progress, never one whose work is only long.

The training thread marks its phases (``Watchdog.mark``: a step, an evaluation, a save begins) and their progress
(``Watchdog.advance``: an evaluation's micro-batch); a save's progress is its directory's content changing, looked
at only when its budget runs out. Each phase has a budget: ``train.hang_timeout_s``, the longer
``train.first_step_timeout_s`` for a start's first step and evaluation, a profiled step and a rollback's load, and
twice the expired one for the phase the previous start was ended in (``hang.json``). A phase that outlasts its
budget without progress, or a hang another rank declared (a new folder in ``RUN/hangs/``: the ranks meet on the
shared filesystem, not the network), ends the job: every live rank writes its threads' Python stacks there, the
lowest names the ranks that stopped answering or fell behind (``summary.txt``), and each exits with
``HUNG_EXIT_CODE`` (requeued), or with ``ERROR_EXIT_CODE`` where the previous start ended too, naming the setting
that would let healthy work finish. Ranks whose heartbeat is ``train.peer_timeout_s`` old are lost: the first rank to
see it names them in ``RUN/heartbeats/lost.json``; every rank exits with ``NODE_LOST_EXIT_CODE``.
``HangWatch`` is the watchdog as a run's callback: the loop's hooks mark its phases.
"""

from __future__ import annotations

import faulthandler
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from mhf_dist.config import TrainConfig
from mhf_dist.errors import ERROR_EXIT_CODE, HUNG_EXIT_CODE, NODE_LOST_EXIT_CODE
from mhf_dist.storage.hang_record import HangRecord, newest_hang_record, read_hang_record
from mhf_dist.storage.heartbeats import (
    IDLE_PHASES,
    answers,
    doing,
    node_name,
    rank_health,
    read_heartbeats,
    record_lost,
    write_heartbeat,
)
from mhf_dist.storage.run_dir import RunDir
from mhf_dist.train.callbacks import Callback, RunContext

MAX_BEAT_S = 10.0
MIN_BEAT_S = 0.5
LINGER_BEATS = (
    3  # heartbeats to wait, after writing the stacks, for the other live ranks to write theirs
)
WAITING_BEATS = 3  # heartbeats without progress before a rank reads its peers' heartbeats
WARMING_PHASES = (
    "step",
    "eval",
)  # their first run in a start compiles and allocates: the first-step budget
LOADING_PHASES = (
    "rollback",
)  # a checkpoint's load, as long as a start's: the first-step budget every time
HANG_SETTING, FIRST_SETTING = "train.hang_timeout_s", "train.first_step_timeout_s"


def beat_interval(*timeouts_s: float | None) -> float:
    """Seconds between heartbeats: a tenth of the shorter timeout (hang, peer), within [0.5, 10]."""
    set_ = [t for t in timeouts_s if t is not None]
    return min(MAX_BEAT_S, max(MIN_BEAT_S, min(set_) / 10)) if set_ else MAX_BEAT_S


def last_change(directory: Path) -> float:
    """When ``directory``, its subdirectories or their files last changed (a file written, one added or removed)."""
    newest = 0
    for root, _, names in os.walk(directory):
        for path in (root, *(os.path.join(root, name) for name in names)):
            try:
                newest = max(newest, os.stat(path).st_mtime_ns)
            except OSError:  # removed while listed
                continue
    return newest / 1e9


@dataclass(frozen=True)
class HangSettings:
    """``train.hang_timeout_s`` (None: heartbeats only), ``train.peer_timeout_s``, ``train.first_step_timeout_s``."""

    hang_timeout_s: float | None
    peer_timeout_s: float | None = None
    first_step_timeout_s: float | None = None

    @classmethod
    def of(cls, train: TrainConfig) -> HangSettings:
        return cls(train.hang_timeout_s, train.peer_timeout_s, train.first_step_timeout_s)


@dataclass(frozen=True)
class Phase:
    """What the training thread is doing, replaced whole (the watchdog thread reads it)."""

    step: int
    name: str  # start, step, eval, save, rollback, end, finished
    since: float  # its last progress
    budget_s: float | None = None  # how long it may go without progress (None: not watched)
    setting: str = HANG_SETTING  # the setting the budget comes from
    retried: bool = False  # the previous start was ended at this step and phase
    files: Path | None = None  # a directory whose changes are its progress


class Watchdog:
    """Rank ``rank``'s heartbeat and hang watch in run ``run``, from step ``resumed_at``."""

    def __init__(self, run: RunDir, rank: int, settings: HangSettings, resumed_at: int = 0):
        self.run, self.rank, self.timeout_s = run, rank, settings.hang_timeout_s
        self.peer_timeout_s, self.first_timeout_s = (
            settings.peer_timeout_s,
            settings.first_step_timeout_s,
        )
        self.beat_s = beat_interval(self.timeout_s, self.peer_timeout_s)
        self.started = time.time()
        # earlier starts' hangs: a start that follows one the watchdog ended within a second must not take the
        # folder the last of those ranks wrote into as a hang of its own
        self._earlier = self._hang_folders()
        record = newest_hang_record(run) if self.timeout_s is not None else None
        # still ahead
        self.previous = record if record is not None and record.step > resumed_at else None
        self._phase = Phase(resumed_at, "start", self.started)
        self._begun: set[str] = set()  # phases that ran in this start
        # the training thread marks, the watchdog thread records progress
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self.run.heartbeats_dir.mkdir(parents=True, exist_ok=True)
        if self.previous is not None and self.rank == 0:
            budget, _, _ = self._budget(self.previous.step, self.previous.phase, first=False)
            print(
                f"note: the previous start was ended by the hang watchdog after {self.previous.stuck_s:.0f} s "
                f"without progress {doing({'phase': self.previous.phase, 'step': self.previous.step})} "
                f"({self.previous.setting}={self.previous.budget_s:g}); this start allows it {budget:g} s, and stops "
                f"without requeueing if it ends there again",
                file=sys.stderr,
                flush=True,
            )
        self._beat()
        self._thread.start()
        return self

    def mark(self, step: int, phase: str, files: Path | None = None, longer: bool = False) -> None:
        """``phase`` (``step``, ``eval``, ``save``, ``rollback``, ``end``) of ``step`` begins now; a phase that
        writes into ``files`` progresses while that directory's content changes; one known to be ``longer`` (a
        profiled step) gets the first-step budget."""
        first = (
            (phase in WARMING_PHASES and phase not in self._begun)
            or phase in LOADING_PHASES
            or longer
        )
        self._begun.add(phase)
        budget, setting, retried = self._budget(step, phase, first)
        with self._lock:
            self._phase = Phase(step, phase, time.time(), budget, setting, retried, files)

    def advance(self) -> None:
        """The phase under way made progress (an evaluation's micro-batch)."""
        with self._lock:
            self._phase = replace(self._phase, since=time.time())

    def finish(self) -> None:
        """The rank's training ended: no more hang watch; the heartbeat says so."""
        with self._lock:
            self._phase = Phase(self._phase.step, "finished", time.time())
        self._stop.set()
        self._thread.join()
        self._beat()

    def _budget(self, step: int, phase: str, first: bool) -> tuple[float | None, str, bool]:
        """How long ``phase`` of ``step`` may go without progress, the setting that says so, and whether the
        previous start was ended there (then twice what it had, at least)."""
        if self.timeout_s is None:
            return None, HANG_SETTING, False
        budget, setting = self.timeout_s, HANG_SETTING
        if first and self.first_timeout_s is not None and self.first_timeout_s > budget:
            budget, setting = self.first_timeout_s, FIRST_SETTING
        retried = self.previous is not None and self.previous.at(step, phase)
        if retried:
            budget = max(budget, self.previous.retry_budget_s)
        return budget, setting, retried

    # ------------------------------------------------------------------ the thread
    def _beat(self) -> None:
        p = self._phase
        write_heartbeat(
            self.run,
            {
                "rank": self.rank,
                "node": node_name(),
                "pid": os.getpid(),
                "step": p.step,
                "phase": p.name,
                "since": p.since,
                "beat": time.time(),
                "beat_s": self.beat_s,
                "hang_timeout_s": p.budget_s,
                "started": self.started,
            },
        )

    def _watch(self) -> None:
        while not self._stop.wait(self.beat_s):
            try:
                self._beat()
            except OSError as e:  # a filesystem hiccup must not end the rank; the next beat retries
                print(
                    f"warning: rank {self.rank}'s heartbeat was not written: {e}", file=sys.stderr
                )
            phase = self._phase
            idle = time.time() - phase.since
            if (
                phase.name not in IDLE_PHASES
                and idle > WAITING_BEATS * self.beat_s
                and self.peer_timeout_s is not None
                and (lost := self._lost_peers())
            ):
                self._lose(lost)
            if self.timeout_s is None:
                continue
            declared = self._declared_hang()
            if (
                declared is None
                and phase.budget_s is not None
                and idle > phase.budget_s
                and not self._progressed(phase)
                and (current := self._phase).name == phase.name
            ):
                declared = self._declare(current, time.time() - current.since)
            if declared is not None and not self._stop.is_set():
                self._end(declared)

    def _progressed(self, phase: Phase) -> bool:
        """Once ``phase``'s budget ran out: whether the directory it writes changed within the budget (the phase then
        counts from that change)."""
        if phase.files is None:
            return False
        changed = min(last_change(phase.files), time.time())  # a file server's clock may run ahead
        if changed > phase.since:
            with self._lock:
                if self._phase is phase:  # not replaced by a mark meanwhile
                    self._phase = replace(phase, since=changed)
        return time.time() - changed <= phase.budget_s

    def _lost_peers(self) -> list[dict]:
        """The other ranks whose heartbeat is ``peer_timeout_s`` old (finished ones are not lost)."""
        now = time.time()
        return [
            b
            for b in read_heartbeats(self.run)
            if b["rank"] != self.rank
            and b.get("phase") != "finished"
            and now - b.get("beat", now) > self.peer_timeout_s
        ]

    def _lose(self, lost: list[dict]) -> None:
        """Peers were lost with their node: the first rank to see it records and names them; every rank exits."""
        nodes = sorted({str(b.get("node")) for b in lost})
        if record_lost(self.run, nodes, [b["rank"] for b in lost], self._phase.step, time.time()):
            print(
                f"lost node{'s' if len(nodes) > 1 else ''} {', '.join(nodes)}: rank{'s' if len(lost) > 1 else ''} "
                f"{', '.join(str(b['rank']) for b in lost)} sent no heartbeat for over {self.peer_timeout_s:g} s "
                f"(train.peer_timeout_s), {doing(lost[0])}; stopping without a save (exit {NODE_LOST_EXIT_CODE}); "
                "the next start resumes from the newest checkpoint",
                file=sys.stderr,
                flush=True,
            )
        sys.stdout.flush()
        os._exit(NODE_LOST_EXIT_CODE)

    def _hang_folders(self) -> set[str]:
        hangs = self.run.hangs_dir
        return {p.name for p in hangs.iterdir() if p.is_dir()} if hangs.is_dir() else set()

    def _declared_hang(self) -> Path | None:
        """The folder of a hang another rank of this job declared (one made since this rank's watchdog started)."""
        found = [self.run.hangs_dir / name for name in self._hang_folders() - self._earlier]
        return max(found, key=lambda p: p.stat().st_mtime, default=None)

    def _declare(self, phase: Phase, stuck_s: float) -> Path:
        """This rank saw no progress for its phase's budget: the hang's folder, with what it ended on."""
        folder = self.run.hangs_dir / time.strftime("%Y-%m-%dT%H-%M-%SZ", time.gmtime())
        folder.mkdir(parents=True, exist_ok=True)  # ranks declaring in the same second share it
        record = HangRecord(
            phase.step, phase.name, round(stuck_s, 1), phase.budget_s, phase.setting, phase.retried
        )
        record.write(folder)
        allowed = (
            f"{phase.budget_s:g} s, twice what the previous start allowed it"
            if phase.retried
            else f"{phase.setting}={phase.budget_s:g}"
        )
        print(
            f"rank {self.rank}: no progress for {stuck_s:.0f} s {doing({'phase': phase.name, 'step': phase.step})} "
            f"({allowed}): a hang",
            file=sys.stderr,
            flush=True,
        )
        return folder

    def _end(self, folder: Path) -> None:
        """Write this rank's stacks, let the others write theirs, name the culprits (lowest live rank), exit."""
        phase = self._phase
        path = folder / f"rank-{self.rank}.txt"
        with open(path.with_suffix(".tmp"), "w") as f:
            f.write(
                f"rank {self.rank} on {node_name()}, pid {os.getpid()}: {time.time() - phase.since:.0f} s "
                f"without progress {doing({'phase': phase.name, 'step': phase.step})}\n\n"
            )
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        os.replace(path.with_suffix(".tmp"), path)
        time.sleep(LINGER_BEATS * self.beat_s)
        record = read_hang_record(folder)
        code = ERROR_EXIT_CODE if record is not None and record.retried else HUNG_EXIT_CODE
        now = time.time()
        beats = read_heartbeats(self.run)
        live = [b["rank"] for b in beats if answers(b, now)]
        if live and self.rank == min(live):
            health = rank_health(beats, now)
            then = (
                ""
                if code == ERROR_EXIT_CODE
                else "; its next start resumes from the newest checkpoint"
            )
            lines = [
                f"hang at step {health.step if health else phase.step}: the job stops (exit {code}, nothing "
                f"saved{then})",
                *(health.describe(now) if health else []),
                f"stacks of ranks {', '.join(map(str, stacks_in(folder)))} in {folder}",
                *(advice(record) if record is not None else []),
            ]
            (folder / "summary.txt").write_text("\n".join(lines) + "\n")
            print("\n".join(lines), file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(code)


class HangWatch(Callback):
    """The watchdog of a run, its phases marked at the loop's hooks: each step, evaluation (and its progress),
    rollback and save, and the end, whose last save is waited for while its files change. ``profiled`` says which
    steps a profiler window records: those get the first-step budget."""

    def __init__(self, settings: HangSettings, profiled: Callable[[int], bool] | None = None):
        self.settings, self.profiled = settings, profiled

    def on_start(self, run: RunContext) -> None:
        self.files = run.checkpointer.dir  # a save's progress
        self.watchdog = Watchdog(run.run, run.job.rank, self.settings, run.progress.start).start()

    def before_step(self, step: int) -> None:
        self.watchdog.mark(step, "step", longer=self.profiled is not None and self.profiled(step))

    def before_eval(self, step: int) -> None:
        self.watchdog.mark(step, "eval")

    def eval_progress(self) -> None:
        self.watchdog.advance()

    def on_rollback(self, step: int) -> None:
        self.watchdog.mark(step, "rollback")

    def before_save(self, step: int) -> None:
        self.watchdog.mark(step, "save", files=self.files)

    def on_end(self, step: int) -> None:
        self.watchdog.mark(step, "end", files=self.files)

    def close(self, finished: bool) -> None:
        if finished:  # a rank that failed leaves its heartbeat to age: the others see it lost
            self.watchdog.finish()


def stacks_in(folder: Path) -> list[int]:
    return sorted(int(p.stem.split("-")[1]) for p in folder.glob("rank-*.txt"))


def advice(record: HangRecord) -> list[str]:
    """What would let the phase finish if it is healthy work, and what the next start does."""
    where = doing({"phase": record.phase, "step": record.step})
    keep = f"--set {record.setting}={math.ceil(4 * record.budget_s)}"
    if record.retried:
        return [
            f"the previous start was ended {where} too, with half this budget: not requeued, as it would end "
            f"there again; if that phase is healthy work that takes longer, resubmit with {keep} or more; if it "
            "is not, the stacks show where it waits"
        ]
    return [
        f"if {where} is healthy work that takes longer than {record.budget_s:g} s, the next start allows it "
        f"{record.retry_budget_s:g} s once (ended there again, the job stops without requeueing); to allow "
        f"it for good: {keep}"
    ]
