"""Starting and watching ranks: ``mhf-dist train --nproc-per-node N`` on one machine, and each task of a scheduler's
job step (there the scheduler signals and stops the tasks, so nothing is forwarded).

The N local ranks are plain child processes with torchrun's environment, in a session of their own: CPU ranks are
forked once the launcher has imported what they import, GPU ranks start fresh interpreters. SIGUSR1, SIGTERM and a
first Ctrl-C are forwarded to every rank; a second Ctrl-C kills them at once (``ABORTED_EXIT_CODE``). The exit code
is the ranks' (``PREEMPTED_EXIT_CODE`` when they stopped on a signal after saving), ``RANK_LOST_EXIT_CODE`` when a
rank died by a signal, or the code of a rank that failed; either stops the others. Every rank is reaped before the
launcher returns, and a rank dies with its launcher. Why and how: docs/design-training.md ("Training loop"); what a
user sees: docs/training.md and docs/faults.md.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import importlib
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence

from mhf_dist.backend import RANK_MODULES
from mhf_dist.errors import ABORTED_EXIT_CODE, PREEMPTED_EXIT_CODE, RANK_LOST_EXIT_CODE
from mhf_dist.parallel.rendezvous import free_port

STOP_GRACE_S = (
    5  # after a rank failed: time for the others to report their own error before they are killed
)
POLL_S = 0.2
HANDLED = (
    signal.SIGUSR1,
    signal.SIGTERM,
    signal.SIGINT,
)  # passed on to the ranks (in a job step: sat out)
PR_SET_PDEATHSIG = 1  # prctl(2)
PR_SET_NAME = 15
# what a training rank imports: a forked one's parent imports it once for all (the tokenizers' module brings
# transformers, a second and a half of every rank's start where each imports it)
RANK_PRELOAD = (
    "mhf_dist.train.loop",
    "mhf_dist.vocab.tokenizers",
    "mhf_dist.vocab.signatures",
    *RANK_MODULES,
)
RANK_NAME = "mhf-dist r{rank}"  # a forked rank's process name (ps -o comm, top), at most 15 bytes

Entry = Callable[[list[str]], int]  # the command line's entry point: argv -> exit code


def launch_local(
    nproc: int,
    argv: list[str],
    lost_work: Callable[[], str],
    main: Entry | None = None,
    preload: Sequence[str] = (),
) -> int:
    """Run ``mhf-dist <argv>`` as ``nproc`` ranks; returns their common exit code (see the module's docstring).
    ``lost_work``: what stopping without a save loses, said when a rank dies or a second Ctrl-C aborts.
    ``main``: the command line's entry point, which ranks forked from this process run once it has imported
    ``preload`` (CPU ranks only, and only from a process that has not used torch's thread pool); None: fresh
    interpreters."""
    base = os.environ | {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
    }
    base.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    envs = [base | {"RANK": str(r), "LOCAL_RANK": str(r)} for r in range(nproc)]
    if main is not None:
        for module in preload:
            importlib.import_module(module)
    return RankSupervisor(argv, lost_work, forward=True, fork=main).run(envs)


def supervise_task(argv: list[str], lost_work: Callable[[], str], rank_env: dict[str, str]) -> int:
    """Run ``mhf-dist <argv>`` as the rank of this task of a job step (``rank_env``: what the scheduler tells it),
    watched; returns its exit code."""
    return RankSupervisor(argv, lost_work, forward=False).run([os.environ | rank_env])


# prctl(2), looked up here: a rank's pre-exec hook should only call it
_prctl = ctypes.CDLL(None).prctl if sys.platform == "linux" else None


def _die_with_parent() -> None:
    """In a rank before it starts: the kernel kills it if the launcher dies (killed itself, it cannot reap)."""
    if _prctl is not None:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def run_forked(main: Entry, argv: list[str], env: dict[str, str]) -> int:
    """``main(argv)`` (the command line's entry point) in ``env``, in a process forked from one that has imported
    what the command needs, to its end as a fresh interpreter would run it: its non-daemon threads finished and its
    exit handlers run. Returns the exit code such an interpreter would have; one that dies by a signal (a Ctrl-C not
    handled) dies by it here."""
    code = 1
    # what the parent imported stays: full collections (DeepSpeed's ZeRO-3 runs one as it builds) walk only what
    # the command makes, not the half million objects of torch, DeepSpeed and transformers (0.6 s each)
    gc.freeze()
    try:
        os.environ.clear()
        os.environ.update(env)
        import torch

        if "OMP_NUM_THREADS" in env:  # the OpenMP runtime read it when the parent process loaded it
            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        sys.argv[1:] = argv
        code = main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    except KeyboardInterrupt:
        code = -signal.SIGINT
    except BaseException:
        traceback.print_exc()
    # as the interpreter exits: threading's exit hooks (an executor's workers are told to stop there, torch's
    # compile pool among them), its non-daemon threads joined, then the exit handlers
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


class ForkedRank:
    """A rank forked from the launcher, running ``main(argv)`` in ``env`` as a fresh interpreter would (its
    non-daemon threads finished and its exit handlers run before it exits); to the supervisor, what it uses of a
    ``subprocess.Popen``."""

    def __init__(
        self, main: Entry, argv: list[str], env: dict[str, str], new_session: bool, handlers: dict
    ):
        sys.stdout.flush()  # nothing buffered before the fork is written twice
        sys.stderr.flush()
        self.returncode: int | None = None
        self.pid = os.fork()
        if self.pid == 0:
            code = 1
            try:
                code = self._rank(main, argv, env, new_session, handlers)
            finally:  # never back into the launcher's frames
                os._exit(code)

    @staticmethod
    def _rank(
        main: Entry, argv: list[str], env: dict[str, str], new_session: bool, handlers: dict
    ) -> int:
        """The child, before it runs the command: its own session (when asked), its death with the launcher's, its
        name (the launcher's command line is every forked rank's) and the launcher's signal handlers from before it
        watched its ranks."""
        if new_session:
            os.setsid()
        _die_with_parent()
        if _prctl is not None:
            _prctl(PR_SET_NAME, RANK_NAME.format(rank=env["RANK"]).encode())
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        return run_forked(main, argv, env)

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def exit_description(rank: int, proc: subprocess.Popen | ForkedRank) -> str:
    """``rank 1 (pid 4242) was killed by SIGKILL`` / ``... exited with code 2``."""
    code = proc.returncode
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    return f"rank {rank} (pid {proc.pid}) {how}"


class RankSupervisor:
    """Ranks started as child processes and watched until every one has ended (see the module's docstring)."""

    def __init__(
        self,
        argv: list[str],
        lost_work: Callable[[], str],
        forward: bool,
        fork: Entry | None = None,
    ):
        self.argv, self.lost_work, self.forward, self.fork = (
            argv,
            lost_work,
            forward,
            fork,
        )  # fork: forked ranks' entry
        self.procs: dict[int, subprocess.Popen | ForkedRank] = {}  # rank -> process
        self.world = 1
        self.interrupts = 0
        # signals this supervisor got: a rank they ended did not fail
        self.received: set[int] = set()
        self.killed: set[int] = set()  # ranks this supervisor killed (not failures either)

    def run(self, envs: list[dict[str, str]]) -> int:
        """Start a rank per environment and watch them; returns the exit code of the whole."""
        self.world = int(envs[0]["WORLD_SIZE"])
        # before the first rank starts
        previous = {s: signal.signal(s, self._on_signal) for s in HANDLED}
        try:
            for env in envs:
                self.procs[int(env["RANK"])] = self._start(env, previous)
            return self._watch()
        finally:
            self._kill_all()  # also after an error of the launcher itself: no rank outlives it
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _start(self, env: dict[str, str], handlers: dict) -> subprocess.Popen | ForkedRank:
        if self.fork is not None:
            return ForkedRank(self.fork, self.argv, env, self.forward, handlers)
        return subprocess.Popen(
            [sys.executable, "-m", "mhf_dist", *self.argv],
            env=env,
            start_new_session=self.forward,
            preexec_fn=_die_with_parent,
        )

    def _on_signal(self, signum, _frame):
        self.received.add(signum)
        if not self.forward:  # the scheduler signalled the rank itself
            return
        self.interrupts += signum == signal.SIGINT
        if self.interrupts < 2:  # the watch loop answers a second Ctrl-C
            for rank in self._running():
                self.procs[rank].send_signal(signum)

    def _running(self) -> list[int]:
        return [rank for rank, proc in self.procs.items() if proc.poll() is None]

    def _watch(self) -> int:
        """Wait for every rank; after a failure, the others get ``STOP_GRACE_S`` to end on their own."""
        failure = deadline = None
        while self._running():
            if self.interrupts > 1:
                self._kill_all()
                print(f"aborted without saving: {self.lost_work()}", file=sys.stderr)
                return ABORTED_EXIT_CODE
            if failure is None and (failure := self._first_failure()) is not None:
                self._report(failure)
                deadline = time.monotonic() + STOP_GRACE_S
            if deadline is not None and time.monotonic() > deadline:
                self._kill_all()  # the others would wait on collectives with the failed rank forever
            time.sleep(POLL_S)
        if failure is None and (failure := self._first_failure()) is not None:
            self._report(failure)  # it ended with the others, between two looks
        if failure is None:
            return self._common_code()
        code = self.procs[failure].returncode
        return RANK_LOST_EXIT_CODE if code < 0 else code

    def _common_code(self) -> int:
        """The ranks' code when none failed: 85 when they saved on a signal (all of them did, or none), else 0, or
        128 + N for a rank that signal N (sent to the launcher too) ended, as a shell reports it."""
        codes = [
            code if code >= 0 else 128 - code
            for code in (p.returncode for p in self.procs.values())
        ]
        return PREEMPTED_EXIT_CODE if PREEMPTED_EXIT_CODE in codes else max(codes)

    def _first_failure(self) -> int | None:
        """A rank that ended with an error (one killed by a signal first), None while there is none."""
        failed = [
            rank
            for rank, proc in self.procs.items()
            if proc.returncode not in (None, 0, PREEMPTED_EXIT_CODE)
            and rank not in self.killed
            and -proc.returncode not in self.received
        ]
        return min(failed, key=lambda rank: (self.procs[rank].returncode >= 0, rank), default=None)

    def _report(self, rank: int) -> None:
        """A rank killed by a signal cannot say so itself: name it, and what the stop loses (a rank that ended with
        an error code printed its error)."""
        if self.procs[rank].returncode >= 0:
            return
        others = "; stopping the others" if self.world > 1 else ""
        print(f"{exit_description(rank, self.procs[rank])}{others}", file=sys.stderr)
        print(self.lost_work(), file=sys.stderr)

    def _kill_all(self) -> None:
        for rank in self._running():
            self.procs[rank].kill()
            self.killed.add(rank)
        for proc in self.procs.values():
            proc.wait()
