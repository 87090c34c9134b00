"""``mhf-dist gpu-check``: the main job end to end on one GPU (training and resume, layouts and features, export,
generation, evaluation and throughput), as one dated table; ``--cpu`` runs the same steps at tiny size in fp32.

About 9 minutes on one H200; ``bash tools/gpu_check.sh`` runs it with a checkout's ``.venv``. What each step checks,
its tolerances, the time budget and the report: docs/profiling.md, "GPU check".

Here: the options and the command (the steps in order, the report rewritten after each, the end on a signal). The
steps are ``preflight.py``, ``training.py`` (the layout and feature runs' checks in ``feature_checks.py``),
``inference.py`` and ``throughput.py``; the modes and the commands run side by side ``runner.py`` (with ``--cpu``
forked from one server that has imported what they import, ``forked.py``); the table ``report.py``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path

from mhf_dist.commands.gpu_check import report as reporting
from mhf_dist.commands.gpu_check.inference import step_inference
from mhf_dist.commands.gpu_check.preflight import step_preflight
from mhf_dist.commands.gpu_check.runner import (
    CPU,
    FAIL,
    GPU,
    ROOT,
    SKIPPED,
    Check,
    Context,
    Mode,
    StepFailed,
    without,
)
from mhf_dist.commands.gpu_check.throughput import step_profile
from mhf_dist.commands.gpu_check.training import step_train
from mhf_dist.config import ConfigError

STEPS = (
    ("preflight", step_preflight),
    ("training: resume, layouts, features", step_train),
    ("export, generation, evaluation", step_inference),
    ("throughput", step_profile),
)


def minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 60 else f"{seconds / 60:.1f} min"


def plan(mode: Mode) -> str:
    """What the check prints first: its estimated time per step and in all, and when a command is stopped."""
    steps = ", ".join(f"{title} {minutes(s)}" for (title, _), s in zip(STEPS, mode.estimates_s))
    limit = f"A command is stopped at {mode.timeout_s} s"
    if mode.gloo_timeout_s != mode.timeout_s:
        limit += f" (a 2-rank run's at {mode.gloo_timeout_s} s)"
    return f"estimated {minutes(sum(mode.estimates_s))} in all ({steps}). {limit}."


def run_steps(ctx: Context, report: reporting.Report, steps) -> tuple[list[Check], list[dict]]:
    """Every step in order; after a failed step the remaining ones are listed as skipped. An interruption (Ctrl-C,
    SIGTERM) marks the step under way, writes the report and goes on up."""
    checks, timings, failed = [], [], None
    for i, (title, step) in enumerate(steps, 1):
        if failed:
            checks.append(Check(title, SKIPPED, f"not run: step {failed!r} failed"))
            timings.append({"step": title, "status": "skipped", "seconds": 0.0})
            continue
        ctx.say(f"== step {i}/{len(steps)}: {title}")
        began = time.perf_counter()
        try:
            checks += step(ctx)
            status = "done"
        except Exception as e:  # any failure ends the check with its message
            message = (
                str(e)
                if isinstance(e, StepFailed)
                else f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
            )
            checks.append(Check(title, FAIL, message.splitlines()[0]))
            ctx.say(f"step {title!r} FAILED: {message}")
            failed, status = title, "failed"
        except BaseException:
            ctx.interrupt()
            timings.append(
                {"step": title, "status": "interrupted", "seconds": time.perf_counter() - began}
            )
            report.write(checks, timings)
            ctx.say(
                f"== step {i}/{len(steps)}: {title} interrupted; the report holds what ended "
                f"({ctx.out / 'gpu_check.md'})"
            )
            raise
        timings.append({"step": title, "status": status, "seconds": time.perf_counter() - began})
        ctx.say(f"== step {i}/{len(steps)}: {title} {status} in {timings[-1]['seconds']:.0f} s")
        report.write(checks, timings)
    return checks, timings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``mhf-dist gpu-check``'s options."""
    parser.add_argument(
        "--cpu", action="store_true", help="tiny sizes, fp32, on CPU (what CI runs)"
    )
    parser.add_argument(
        "--out", default="gpu_check", help="where gpu_check.md, gpu_check.json and logs/ go"
    )
    parser.add_argument(
        "--work", help="runs, models and profiles (emptied first; default OUT/work)"
    )
    parser.add_argument(
        "--nominal-tflops",
        type=float,
        default=989.0,
        help="the GPU's nominal dense bf16 peak per device, for MFU (default: H200, 989)",
    )
    parser.add_argument(
        "--skip",
        default="",
        metavar="NAMES",
        help="layout and feature runs of step 2 to leave out, by check name, comma-separated "
        "(e.g. compile,layout-pp2-gloo)",
    )


def terminated(signum, frame):
    """SIGTERM (a machine's time limit, a scheduler) ends the check as Ctrl-C does, through its handlers."""
    raise SystemExit(128 + signum)


def run(args: argparse.Namespace) -> int:
    """The whole check with ``args`` (``add_arguments``); 1 if any check failed."""
    try:
        mode = without(CPU if args.cpu else GPU, {name for name in args.skip.split(",") if name})
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if args.cpu:  # children too: no GPU, DeepSpeed on its CPU accelerator
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if (
        Path(sys.prefix).resolve() == (ROOT / ".venv").resolve()
    ):  # DeepSpeed's compiled ops, built once per venv
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".venv" / "torch_extensions"))
    out = Path(args.out).resolve()
    work = Path(args.work).resolve() if args.work else out / "work"
    shutil.rmtree(work, ignore_errors=True)  # a run directory left from before would be resumed
    shutil.rmtree(out / "logs", ignore_errors=True)
    for stale in ("gpu_check.md", "gpu_check.json"):
        (out / stale).unlink(missing_ok=True)
    (out / "logs").mkdir(parents=True)
    work.mkdir(parents=True)
    ctx = Context(mode, out, work, args.nominal_tflops)

    steps = STEPS
    report = reporting.Report(ctx, reporting.environment(mode), len(steps))
    ctx.say(
        f"mhf-dist main-job check, {mode.name} mode: {report.env['device']}, commit {report.env['commit']}; "
        f"output in {out}"
    )
    ctx.say(plan(mode))
    # Ctrl-C and SIGTERM interrupt the check, whatever handlers the process had (restored after)
    previous = {
        signal.SIGTERM: signal.signal(signal.SIGTERM, terminated),
        signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler),
    }
    try:
        checks, timings = run_steps(ctx, report, steps)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    print("\n" + report.write(checks, timings), flush=True)
    print(f"wrote {out / 'gpu_check.md'} and {out / 'gpu_check.json'}", flush=True)
    return 1 if any(c.status == FAIL for c in checks) else 0
