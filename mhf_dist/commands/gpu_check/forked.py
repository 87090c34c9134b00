"""With ``--cpu``, the check's commands (``mhf-dist`` and ``tools/`` scripts) forked from one server process
(multiprocessing's forkserver) that has imported what they import: on the CPU a tiny command's start-up (torch,
DeepSpeed, transformers, the tokenizers, torch's compiler: 5-8 s) was most of its time. Each command still runs as
``python -m mhf_dist`` or ``python SCRIPT`` runs it: in its own process and session, in its own environment and
OpenMP threads, its output captured, its exit code returned; its CPU ranks fork from it as they do from
``mhf-dist train``. The server has not used torch's thread pool when it forks."""

from __future__ import annotations

import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import runpy
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

# what the check's commands import besides a training rank's (RANK_PRELOAD)
PRELOAD = (
    "mhf_dist.cli",
    "mhf_dist.cluster.launch",
    "mhf_dist.storage.reading_marks",
    "mhf_dist.hf.exporter",
    "mhf_dist.commands.generate",
    "mhf_dist.commands.evaluate",
    "mhf_dist.profiling.sweep",
    "mhf_dist.cluster.run_status",
)
# multiprocessing reads a child's exit code once, in the first thread that polls it (a start polls every child):
# starts and joins of commands side by side take turns
_LOCK = threading.Lock()
_server: multiprocessing.context.ForkServerContext | None = None


def server() -> multiprocessing.context.ForkServerContext:
    """The forkserver context; the server itself starts (and imports) with the first command."""
    global _server
    if _server is None:
        from mhf_dist.cluster.launch import RANK_PRELOAD

        _server = multiprocessing.get_context("forkserver")
        _server.set_forkserver_preload([*RANK_PRELOAD, *PRELOAD])
    return _server


def forkable(cmd: list[str]) -> bool:
    """Whether ``cmd`` is ``mhf-dist`` or a Python script run by this interpreter (others start afresh)."""
    return cmd[0] == sys.executable and (cmd[1:3] == ["-m", "mhf_dist"] or cmd[1].endswith(".py"))


class ForkedCommand:
    """``python ARGS`` (``-m mhf_dist ...`` or ``SCRIPT ...``) in ``env``, forked from the server; to the check, what
    it uses of a ``subprocess.Popen`` started with ``start_new_session`` and its output piped as text."""

    def __init__(self, args: list[str], env: dict[str, str]):
        self.args, self.returncode = args, None
        self._outputs = []
        for suffix in (".out", ".err"):
            fd, path = tempfile.mkstemp(prefix="gpu-check-", suffix=suffix)
            os.close(fd)
            self._outputs.append(path)
        with _LOCK:
            self._process = server().Process(target=_command, args=(args, env, *self._outputs))
            self._process.start()
        self.pid = self._process.pid

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        if not multiprocessing.connection.wait([self._process.sentinel], timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        with _LOCK:
            self._process.join()
            self.returncode = self._process.exitcode
        outputs = tuple(Path(path).read_text(errors="replace") for path in self._outputs)
        for path in self._outputs:
            os.unlink(path)
        return outputs

    def kill(self) -> None:
        self._process.kill()


def _command(args: list[str], env: dict[str, str], stdout: str, stderr: str) -> None:
    """The forked child: ``python ARGS`` as a fresh interpreter runs it, its streams in the files ``stdout`` and
    ``stderr`` (line by line, so that a command killed at its time limit leaves what it printed), its Python stack
    printed on a crash (PYTHONFAULTHANDLER)."""
    from mhf_dist.cluster.launch import run_forked

    os.setsid()
    for fd, path in ((1, stdout), (2, stderr)):
        file = os.open(path, os.O_WRONLY)
        os.dup2(file, fd)
        os.close(file)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)
    faulthandler.enable()
    if args[:2] == [
        "-m",
        "mhf_dist",
    ]:  # mhf_dist/__main__.py, as python -m runs it (it exits with main's code)
        os._exit(run_forked(lambda argv: _run(runpy.run_module, "mhf_dist"), args[2:], env))
    script = args[0]
    sys.argv[0], sys.path[0] = script, str(Path(script).parent)
    os._exit(run_forked(lambda argv: _run(runpy.run_path, script), args[1:], env))


def _run(run, what: str) -> int:
    run(what, run_name="__main__")
    return 0  # it ended without sys.exit
