"""The hang watchdog: a thread on every rank that writes the rank's heartbeat (:mod:`mhf_dist.storage.heartbeats`)
and ends a job that makes no progress.

The training thread marks its progress (:meth:`Watchdog.mark`: a step, an evaluation, a save begins) and nothing
else: no file and no collective per step. The thread rewrites the heartbeat every ``beat_s`` seconds. When the phase
under way has made no progress for ``train.hang_timeout_s`` (a collective waiting on a rank that will never come, a
save stuck on a filesystem), or when another rank of the job has declared a hang (a new folder in ``RUN/hangs/``:
the ranks meet on the shared filesystem, not the network, which may be what failed), it

1. writes every thread's Python stack of this rank to ``RUN/hangs/<time>/rank-N.txt`` (``faulthandler``, which needs
   neither the GIL's holder nor the training thread);
2. waits a few heartbeats for the other live ranks to write theirs (a scheduler ends every task once one exits);
3. on the lowest rank that still answers, names in the log (and ``summary.txt``) the ranks that stopped answering
   and those that did not reach the furthest step, from their heartbeats;
4. exits with :data:`~mhf_dist.errors.HUNG_EXIT_CODE` without saving (a hung collective cannot be trusted to
   finish a save); the job script requeues on it and the next start resumes from the newest checkpoint.

A lost node is told apart sooner: once this rank has been waiting a few heartbeats, it reads the other ranks'
heartbeats, and ranks whose heartbeat is ``train.peer_timeout_s`` old are lost (their node died or dropped off the
network, and with it their heartbeat thread). The first rank to see it names the node and its ranks and writes
them to ``RUN/heartbeats/lost.json``; every rank exits with :data:`~mhf_dist.errors.NODE_LOST_EXIT_CODE`, on which
an elastic job continues on the nodes left. A healthy job never reads its peers' heartbeats.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from pathlib import Path

from mhf_dist.errors import HUNG_EXIT_CODE, NODE_LOST_EXIT_CODE
from mhf_dist.storage.heartbeats import (
    answers,
    doing,
    node_name,
    rank_health,
    read_heartbeats,
    record_lost,
    write_heartbeat,
)
from mhf_dist.storage.run_dir import RunDir

MAX_BEAT_S = 10.0
MIN_BEAT_S = 0.5
LINGER_BEATS = 3  # heartbeats to wait, after writing the stacks, for the other live ranks to write theirs
WAITING_BEATS = 3  # heartbeats without progress before a rank reads its peers' heartbeats


def beat_interval(*timeouts_s: float | None) -> float:
    """Seconds between heartbeats: a tenth of the shorter timeout (hang, peer), within [0.5, 10]."""
    set_ = [t for t in timeouts_s if t is not None]
    return min(MAX_BEAT_S, max(MIN_BEAT_S, min(set_) / 10)) if set_ else MAX_BEAT_S


class Watchdog:
    """Rank ``rank``'s heartbeat and hang watch in run ``run`` (``hang_timeout_s`` None: heartbeats only)."""

    def __init__(self, run: RunDir, rank: int, hang_timeout_s: float | None, peer_timeout_s: float | None = None):
        self.run, self.rank, self.timeout_s, self.peer_timeout_s = run, rank, hang_timeout_s, peer_timeout_s
        self.beat_s = beat_interval(hang_timeout_s, peer_timeout_s)
        self.started = time.time()
        self._progress = (0, "start", self.started)  # (step, phase, since), replaced whole by the training thread
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self.run.heartbeats_dir.mkdir(parents=True, exist_ok=True)
        self._beat()
        self._thread.start()
        return self

    def mark(self, step: int, phase: str) -> None:
        """Progress: ``phase`` (``step``, ``eval``, ``save``, ``end``) of ``step`` begins now."""
        self._progress = (step, phase, time.time())

    def finish(self) -> None:
        """The rank's training ended: no more hang watch; the heartbeat says so."""
        self._progress = (self._progress[0], "finished", time.time())
        self._stop.set()
        self._thread.join()
        self._beat()

    # ------------------------------------------------------------------ the thread
    def _beat(self) -> None:
        step, phase, since = self._progress
        write_heartbeat(self.run, {"rank": self.rank, "node": node_name(), "pid": os.getpid(), "step": step,
                                   "phase": phase, "since": since, "beat": time.time(), "beat_s": self.beat_s,
                                   "hang_timeout_s": self.timeout_s, "started": self.started})

    def _watch(self) -> None:
        while not self._stop.wait(self.beat_s):
            try:
                self._beat()
            except OSError as e:  # a filesystem hiccup must not end the rank; the next beat retries
                print(f"warning: rank {self.rank}'s heartbeat was not written: {e}", file=sys.stderr)
            step, phase, since = self._progress
            waiting = phase not in ("start", "finished") and time.time() - since > WAITING_BEATS * self.beat_s
            if waiting and self.peer_timeout_s is not None and (lost := self._lost_peers()):
                self._lose(lost)
            if self.timeout_s is None:
                continue
            declared = self._declared_hang()
            if declared is None and phase not in ("start", "finished") and time.time() - since > self.timeout_s:
                declared = self._declare(step, phase, time.time() - since)
            if declared is not None and not self._stop.is_set():
                self._end(declared)

    def _lost_peers(self) -> list[dict]:
        """The other ranks whose heartbeat is ``peer_timeout_s`` old (finished ones are not lost)."""
        now = time.time()
        return [b for b in read_heartbeats(self.run) if b["rank"] != self.rank and b.get("phase") != "finished"
                and now - b.get("beat", now) > self.peer_timeout_s]

    def _lose(self, lost: list[dict]) -> None:
        """Peers were lost with their node: the first rank to see it records and names them; every rank exits."""
        nodes = sorted({str(b.get("node")) for b in lost})
        if record_lost(self.run, nodes, [b["rank"] for b in lost], self._progress[0], time.time()):
            print(f"lost node{'s' if len(nodes) > 1 else ''} {', '.join(nodes)}: rank{'s' if len(lost) > 1 else ''} "
                  f"{', '.join(str(b['rank']) for b in lost)} sent no heartbeat for over {self.peer_timeout_s:g} s "
                  f"(train.peer_timeout_s), {doing(lost[0])}; stopping without a save (exit {NODE_LOST_EXIT_CODE}); "
                  "the next start resumes from the newest checkpoint", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(NODE_LOST_EXIT_CODE)

    def _declared_hang(self) -> Path | None:
        """The folder of a hang another rank of this job declared (made since this rank's watchdog started)."""
        if not self.run.hangs_dir.is_dir():
            return None
        found = [p for p in self.run.hangs_dir.iterdir() if p.is_dir() and p.stat().st_mtime >= self.started - 1]
        return max(found, key=lambda p: p.stat().st_mtime, default=None)

    def _declare(self, step: int, phase: str, stuck_s: float) -> Path:
        folder = self.run.hangs_dir / time.strftime("%Y-%m-%dT%H-%M-%SZ", time.gmtime())
        folder.mkdir(parents=True, exist_ok=True)  # ranks declaring in the same second share it
        print(f"rank {self.rank}: no progress for {stuck_s:.0f} s {doing({'phase': phase, 'step': step})} "
              f"(train.hang_timeout_s={self.timeout_s:g}): a hang", file=sys.stderr, flush=True)
        return folder

    def _end(self, folder: Path) -> None:
        """Write this rank's stacks, let the others write theirs, name the culprits (lowest live rank), exit."""
        step, phase, since = self._progress
        path = folder / f"rank-{self.rank}.txt"
        with open(path.with_suffix(".tmp"), "w") as f:
            f.write(f"rank {self.rank} on {node_name()}, pid {os.getpid()}: {time.time() - since:.0f} s without "
                    f"progress {doing({'phase': phase, 'step': step})}\n\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        os.replace(path.with_suffix(".tmp"), path)
        time.sleep(LINGER_BEATS * self.beat_s)
        now = time.time()
        beats = read_heartbeats(self.run)
        live = [b["rank"] for b in beats if answers(b, now)]
        if live and self.rank == min(live):
            health = rank_health(beats, now)
            stacks = sorted(int(p.stem.split("-")[1]) for p in folder.glob("rank-*.txt"))
            lines = [f"hang at step {health.step if health else step}: the job stops (exit {HUNG_EXIT_CODE}, "
                     "nothing saved; its next start resumes from the newest checkpoint)",
                     *(health.describe(now) if health else []),
                     f"stacks of ranks {', '.join(map(str, stacks))} in {folder}"]
            (folder / "summary.txt").write_text("\n".join(lines) + "\n")
            print("\n".join(lines), file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(HUNG_EXIT_CODE)
