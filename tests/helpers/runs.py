"""Run `mhf-dist` in a child process (training initialises torch.distributed, which a test process must not keep)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from mhf_dist.cluster.launch import RANK_NAME

RUN_CACHE: Path | None = (
    None  # where train_run keeps this test run's finished fresh runs (tests/conftest.py sets it)
)


MIXTURE_WEIGHTS = {
    "psalms": 0.5,
    "law": 0.3,
    "gospels": 0.2,
}  # the sources fixture's shard directories


def _forkserver():
    """A process that has imported what the commands import and computed nothing: each ``CliProcess`` is forked
    from it (started with the first; a fork of this test process would carry its state into the command: logging
    handlers, warning filters, a used OpenMP thread pool, which does not survive a fork)."""
    global _CONTEXT
    if _CONTEXT is None:
        from mhf_dist.cli import RANK_PRELOAD

        _CONTEXT = multiprocessing.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(["mhf_dist.cli", *RANK_PRELOAD, "helpers.runs"])
    return _CONTEXT


_CONTEXT = None
STARTED: list[
    CliProcess
] = []  # every CliProcess of the running test (tests/conftest.py stops them after it)


def _command(
    args: list[str],
    env: dict[str, str],
    cwd: str,
    output: str,
    new_session: bool,
    file_size_limit: int | None,
) -> None:
    """In the forked child: ``mhf-dist ARGS`` to its end (see ``CliProcess``)."""
    from mhf_dist.cli import main
    from mhf_dist.cluster.launch import run_forked

    code = 1
    try:
        if new_session:
            os.setsid()
        if (
            file_size_limit is not None
        ):  # files larger than that cannot be written, as on a full disk
            # a write past the limit then fails instead of killing
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(
                resource.RLIMIT_FSIZE,
                (file_size_limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]),
            )
        os.chdir(cwd)
        fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        unbuffered = bool(env.get("PYTHONUNBUFFERED"))
        sys.stdin = open(os.devnull)
        sys.stdout = open(1, "w", buffering=1 if unbuffered else -1, closefd=False)
        sys.stderr = open(2, "w", errors="backslashreplace", buffering=1, closefd=False)
        code = run_forked(main, args, env)
    finally:
        os._exit(code)


class CliProcess:
    """``mhf-dist ARGS`` in a child process, not waited for: what the tests use of a ``subprocess.Popen``.

    The child is forked from a process that has imported torch, DeepSpeed and the package already (``_forkserver``)
    and runs the command as a fresh interpreter would (``mhf_dist.cluster.launch.run_forked``, as the launcher's
    CPU ranks do; a fresh ``python -m mhf_dist`` spends seconds of CPU importing them again): in this process's
    working directory, stdout and stderr appended to ``output`` (unbuffered under PYTHONUNBUFFERED), stdin from
    /dev/null, a session of its own when ``new_session`` (a terminal's job: ``os.killpg(proc.pid, ...)`` reaches it),
    files up to ``file_size_limit`` bytes."""

    def __init__(
        self,
        args: list[str],
        output: Path,
        env: dict[str, str] | None = None,
        new_session: bool = False,
        file_size_limit: int | None = None,
    ):
        self.args, self.new_session = args, new_session
        output.touch()  # there to read from the start
        self.process = _forkserver().Process(
            target=_command,
            args=(
                args,
                dict(os.environ if env is None else env),
                os.getcwd(),
                str(output),
                new_session,
                file_size_limit,
            ),
        )
        self.process.start()
        self.pid = self.process.pid
        STARTED.append(self)

    @property
    def returncode(self) -> int | None:
        """The exit code once it ended (-N: killed by signal N), else None."""
        return self.process.exitcode

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit code; after ``timeout`` seconds, killed and TimeoutExpired."""
        self.process.join(timeout)
        if self.returncode is None:
            self.kill()
            raise subprocess.TimeoutExpired(["mhf-dist", *self.args], timeout)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        """SIGKILL (its ranks die with it), then waited for."""
        self.send_signal(signal.SIGKILL)
        self.process.join()

    def stop(self) -> None:
        """Killed with its process group if still running (a test that failed before its end left it)."""
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL) if self.new_session else os.kill(
                    self.pid, signal.SIGKILL
                )
            self.process.join()

    def rank_pids(self) -> dict[int, int]:
        """``{rank: pid}`` of the ranks it launched (its children named as the launcher names them)."""
        found = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
                name = (stat.parent / "comm").read_text().strip()
            except (OSError, IndexError):
                continue
            if parent == self.pid and (
                match := re.fullmatch(RANK_NAME.format(rank=r"(\d+)"), name)
            ):
                found[int(match[1])] = int(stat.parent.name)
        return found


def run_cli(args: list[str], expect_rc: int = 0, timeout: int = 600) -> str:
    """``mhf-dist ARGS`` in a ``CliProcess``, to its end; asserts the exit code and returns stdout + stderr."""
    with tempfile.TemporaryDirectory() as tmp:
        output = Path(tmp) / "output"
        rc = CliProcess(args, output, os.environ | {"PYTHONUNBUFFERED": "1"}).wait(timeout)
        out = output.read_text(errors="replace")
    assert rc == expect_rc, f"exit {rc} (expected {expect_rc}):\n{out[-5000:]}"
    return out


def train_args(
    run: Path, data: dict, nproc: int, *overrides: str, preset: str = "tiny-h4b16k", steps: int = 3
) -> list[str]:
    """`mhf-dist train` arguments for a tiny run on the shared test shards (fp32, 8 sequences of 64 per step)."""
    args = ["train", "--preset", preset, "--nproc-per-node", str(nproc), "--run-dir", str(run)]
    for o in (
        f"tokenizer.path={data['tokenizer']}",
        f"data.path={data['shards']}",
        "data.seq_len=64",
        "model.hash.num_buckets=256",
        f"train.max_steps={steps}",
        "train.log_interval=1",
        "train.global_batch_size=8",
        "train.micro_batch_size=2",
        "train.eval_sequences=8",
        *overrides,
    ):
        args += ["--set", o]
    return args


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def train_run(
    tmp_path: Path,
    data: dict,
    name: str,
    nproc: int,
    *overrides: str,
    preset: str = "tiny-h4b16k",
    steps: int = 3,
) -> list[dict]:
    """Train to the end (or stop_at_step) in ``tmp_path/name``; returns its metrics records.

    A fresh run (``tmp_path/name`` does not exist yet) that this test run has already trained with the same arguments
    and fault-injection settings is copied from ``RUN_CACHE`` instead of trained again: the runs are
    deterministic, so the copy is the files the training would write. A run into an existing directory (a resume)
    always trains."""
    run = tmp_path / name
    args = train_args(run, data, nproc, *overrides, preset=preset, steps=steps)
    if run.exists() or RUN_CACHE is None:
        run_cli(args)
        return metrics(run)
    injected = sorted(
        (k, v) for k, v in os.environ.items() if k.startswith(("MHF_DIST_", "SLURM_"))
    )
    key = json.dumps([[a for a in args if a != str(run)], injected])
    cached = RUN_CACHE / hashlib.sha256(key.encode()).hexdigest()[:20]
    if cached.exists():
        shutil.copytree(cached, run, symlinks=True)
    else:
        run_cli(args)
        shutil.copytree(run, cached.with_suffix(".partial"), symlinks=True)
        cached.with_suffix(".partial").rename(cached)
    return metrics(run)


def trained_model(run: Path, document_eos: int | None = None):
    """A run's newest checkpoint as our LanguageModel (eval mode), with its tokenizer and signature table;
    ``document_eos``: the model reads the documents of a row apart (``ModelModes.document_eos``)."""
    from mhf_dist.model import build_model
    from mhf_dist.model.modes import ModelModes
    from mhf_dist.train.trained_weights import trained_weights
    from mhf_dist.vocab.signatures import SignatureTable
    from mhf_dist.vocab.tokenizers import load_tokenizer

    tw = trained_weights(run)
    tokenizer = load_tokenizer(tw.run.tokenizer_source(tw.cfg))
    table = SignatureTable.load(tw.run.signatures_dir) if tw.cfg.model.variant == "mhf" else None
    modes = ModelModes(document_eos=document_eos)
    model = build_model(tw.cfg.model, len(tokenizer), table.codes if table else None, modes=modes)
    model.load_state_dict(tw.state)
    return model.eval(), tokenizer, table


def checkpoint_size_estimate(run: Path) -> tuple[int, int]:
    """(the size ``plan`` estimates for a checkpoint of ``run``'s config and layout, the size of its newest one)."""
    import yaml

    from mhf_dist.cluster.job_estimates import checkpoint_bytes as estimated_bytes
    from mhf_dist.config import RunConfig
    from mhf_dist.storage.run_dir import RunDir
    from mhf_dist.train.checkpoint import checkpoint_bytes
    from mhf_dist.train.checkpoint.index import complete_checkpoints, read_marker
    from mhf_dist.vocab.tokenizers import load_tokenizer

    cfg = RunConfig.model_validate(yaml.safe_load((run / "config.yaml").read_text()))
    newest = complete_checkpoints(run / "checkpoints")[-1]
    pp = read_marker(newest)["layout"]["pp"]
    vocab_size = len(load_tokenizer(RunDir(run).tokenizer_source(cfg)))
    return estimated_bytes(cfg, pp, vocab_size), checkpoint_bytes(newest)
