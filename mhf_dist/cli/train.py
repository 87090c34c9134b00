"""``mhf-dist train``: its options, and how it starts: local ranks, a job step's task watched, or one rank."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from mhf_dist.backend import accelerator_env
from mhf_dist.cli.options import add_run_options, load_run_config, positive_int, rank_label
from mhf_dist.cluster.launch import RANK_PRELOAD
from mhf_dist.config import ConfigError, RunConfig
from mhf_dist.errors import OOM_EXIT_CODE, PREEMPTED_EXIT_CODE, RANK_LOST_EXIT_CODE

if TYPE_CHECKING:
    from mhf_dist.train.oom import OomFacts


def cmd_train(args) -> int:
    if Path(args.run_dir).exists() and not Path(args.run_dir).is_dir():
        raise ConfigError(
            f"--run-dir {args.run_dir} is a file; name a directory (it is created if missing)"
        )
    cfg = _load_train(args)  # validate before starting any rank
    from mhf_dist.cluster.launch import launch_local, supervise_task
    from mhf_dist.cluster.scheduler import task_env
    from mhf_dist.storage.run_dir import RunDir
    from mhf_dist.train.preemption import StopSignal, lost_work

    def lost() -> str:
        return lost_work(RunDir(args.run_dir), cfg.train.checkpoint_minutes)

    if "RANK" not in os.environ and args.nproc_per_node:
        from mhf_dist.parallel.devices import device_type
        from mhf_dist.train.preflight import preflight

        device = device_type(cfg)
        preflight(cfg, args.nproc_per_node, device)
        # before this process loads the backend for the ranks it forks, and in the environment of those it starts:
        # they compute on train.device even where a GPU is visible (each rank also sets it, for other launchers)
        os.environ.update(accelerator_env(device))
        from mhf_dist.cli import main

        fork = device == "cpu"  # CPU ranks are forked from this process
        return launch_local(
            args.nproc_per_node,
            _without_option(sys.argv[1:], "--nproc-per-node"),
            lost,
            main if fork else None,
            RANK_PRELOAD if fork else (),
        )
    if "RANK" not in os.environ and (
        rank_env := task_env()
    ):  # a job step's task: its rank runs watched, so its
        return supervise_task(sys.argv[1:], lost, rank_env)  # death is named

    # before the training stack loads: from now on a signal is noted, not fatal
    stop = StopSignal(lost)
    # each line out as it is written, also into a job log or a pipe (which Python would otherwise fill in blocks)
    sys.stdout.reconfigure(line_buffering=True)
    from mhf_dist.storage.reading_marks import mark_reading
    from mhf_dist.train.loop import train
    from mhf_dist.train.oom import StepOutOfMemory, out_of_memory, out_of_memory_elsewhere
    from mhf_dist.train.process_group import collective_failure, leave_process_group

    # prepare-data leaves the data alone while this node reads it
    reading = mark_reading(cfg.data, args.run_dir)
    started = time.time()  # the out-of-memory reports of this start are newer
    try:
        result = train(cfg, args.run_dir, args.resume, stop, args.verbose)
    except StepOutOfMemory as e:
        stop.ignore()  # nothing is saved after a step out of memory
        facts = e.facts
        return out_of_memory(facts, lambda: _planned_gb(cfg, facts), started, rank_label())
    except Exception as e:
        if (failure := collective_failure(e)) is None:
            raise
        stop.ignore()  # nothing is left to save, and the job's end (its tasks stopped) must not cut this exit
        if args.debug:
            raise
        rank = int(os.environ.get("RANK", 0))
        if oom := out_of_memory_elsewhere(RunDir(args.run_dir), started, rank):
            if rank != 0:  # rank 0 said it all
                print(
                    f"mhf-dist{rank_label()}: stopping: rank {oom[0]['rank']} ran out of memory",
                    file=sys.stderr,
                )
            return OOM_EXIT_CODE
        print(
            f"mhf-dist{rank_label()}: {failure}; stopping (--debug shows the traceback)",
            file=sys.stderr,
        )
        return RANK_LOST_EXIT_CODE
    finally:  # also after an error: a process group left to interpreter shutdown can abort the process
        leave_process_group()
        reading.release()
    if result.records:  # rank 0
        print(_outcome(result, stop, Path(args.run_dir)))
    return PREEMPTED_EXIT_CODE if result.preempted else 0


def _planned_gb(cfg: RunConfig, facts: OomFacts) -> float:
    """What ``plan`` estimates a step of the rank of out-of-memory ``facts`` to take at its peak, in GB."""
    from mhf_dist.commands.plan import running_plan

    return running_plan(
        cfg, world=facts.world, device=facts.device, vocab_size=facts.vocab_size, stage=facts.stage
    ).step_peak_gb


def _outcome(result, stop, run_dir: Path) -> str:
    """Rank 0's last line: where a Ctrl-C left the run, or the last step's numbers and where the logs are."""
    if stop.interrupted and result.saved is not None:
        return f"interrupted: saved {result.saved.name}; rerun the same command to resume"
    last = result.records[-1]
    return (
        f"{'preempted' if result.preempted else 'done'}: step {last['step']}, loss {last['loss']:.4f}, "
        f"{last['tokens_per_s']:.0f} tokens/s, MFU {last['mfu']:.1%}; run directory {run_dir.resolve()} "
        f"(tensorboard --logdir {run_dir.resolve() / 'tensorboard'})"
    )


def _load_train(args) -> RunConfig:
    """The preset and/or config file with ``--set``; without either, the run's own config.yaml, where ``--set``
    may change only what a resume can (``mhf_dist.train.resume``)."""
    if args.preset or args.config:
        return load_run_config(args)
    from mhf_dist.train.resume import resume_config

    return resume_config(args.run_dir, args.overrides, args.resume)


def _without_option(argv: list[str], option: str) -> list[str]:
    """``argv`` less ``option VALUE`` / ``option=VALUE``."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == option:
            skip = True
        elif not arg.startswith(option + "="):
            out.append(arg)
    return out


# ---------------------------------------------------------------- the parser: one function per command
def train_parser(sub) -> None:
    p = sub.add_parser(
        "train", help="train a model (run under torchrun for many ranks, or use --nproc-per-node)"
    )
    add_run_options(p)
    p.add_argument(
        "--run-dir",
        required=True,
        help="run directory (created if missing); without --preset and "
        "--config, the run resumes with its own config.yaml (--set may change what a resume can)",
    )
    p.add_argument(
        "--nproc-per-node", type=positive_int, help="start this many local ranks on this machine"
    )
    p.add_argument(
        "--resume",
        default="auto",
        help="auto (newest complete checkpoint, if any), none, or a "
        f"checkpoint directory; a run stopped by a signal exits with {PREEMPTED_EXIT_CODE}",
    )
    p.add_argument(
        "--verbose",
        action="store_true",
        help="also show DeepSpeed's start-up lines (op builds, "
        "pipeline topology), which are held back otherwise",
    )
    p.set_defaults(func=cmd_train)
