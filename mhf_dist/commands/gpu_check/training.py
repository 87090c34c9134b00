"""Step 2: ``tiny-standard`` prepares the shards; the resume pairs and the layout and feature runs train on them side
by side; each is held to its rule: the resume pairs' here, the layout and feature runs' in
``feature_checks`` (docs/profiling.md, "GPU check", gives the rules and their
tolerances)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from mhf_dist.commands.gpu_check import runner
from mhf_dist.commands.gpu_check.feature_checks import P_INF_WEIGHT, PROFILED, feature_check
from mhf_dist.commands.gpu_check.runner import FAIL, PASS, Check, Context, Job, StepFailed, metrics


def train_args(
    ctx: Context, run: Path, preset: str, dtype: str, *overrides: str, device: str | None = None
) -> list[str]:
    """``mhf-dist train`` of ``preset`` in ``run``, on ``device`` (default the mode's). The fused head runs eagerly:
    ``auto`` would compile it in every CUDA run side by side, and only the ``compile`` run is there to compile (it
    overrides this)."""
    m = ctx.mode
    args = ["train", "--preset", preset, "--run-dir", str(run)]
    for o in (
        f"train.max_steps={m.steps}",
        f"train.checkpoint_interval={m.split}",
        "train.log_interval=1",
        f"train.dtype={dtype}",
        f"train.device={device or m.device}",
        "train.fused_head_kernel=eager",
        *m.train_overrides,
        *overrides,
    ):
        args += ["--set", o]
    return args


def validation_sequences(shards: Path) -> int:
    return json.loads((shards / "manifest.json").read_text())["splits"]["val"]["samples"]


def step_train(ctx: Context) -> list[Check]:
    from mhf_dist.config import load_config

    m = ctx.mode
    standard = ctx.run("standard")
    runner.mhf_dist(ctx, "train-standard", train_args(ctx, standard, "tiny-standard", "fp32"))
    shards = standard / "data"
    val = validation_sequences(shards)
    micro = load_config(
        "tiny-h4b16k"
    ).train.micro_batch_size  # the training loop evaluates whole micro-batches
    if val % micro:
        raise StepFailed(
            f"the validation split of {shards} holds {val} sequences, not a multiple of {micro}: "
            "the training loop would not evaluate all of it, and eval could not be compared"
        )
    jobs = training_jobs(ctx, shards, val)
    errors = runner.run_jobs(ctx, jobs)
    failed = [errors[job.name] for job in jobs if job.required and errors[job.name] is not None]
    if failed:
        raise failed[0]
    checks = [standard_check(ctx, standard)] + [resume_check(ctx, dtype) for dtype in m.dtypes]
    return checks + [feature_check(ctx, job, errors[job.name]) for job in jobs if not job.required]


def training_jobs(ctx: Context, shards: Path, val: int) -> list[Job]:
    """The trainings on the prepared shards (``val`` validation sequences), all side by side: the resume pairs
    (required by the later steps; the uninterrupted runs evaluate the whole split, the stopped and resumed ones too
    unless the mode says otherwise), then the layout and feature runs (each its own check; they evaluate one batch
    of 8 sequences at their end), longest first."""
    m, jobs = ctx.mode, []
    shared = (f"data.path={shards}", f"train.eval_sequences={val}")
    resumed_shared = shared if m.resumed_eval_whole else (shared[0], "train.eval_sequences=8")
    for dtype in m.dtypes:
        whole, resumed = ctx.run(f"mhf-{dtype}"), ctx.run(f"mhf-{dtype}-resumed")
        jobs.append(
            Job(
                f"mhf-{dtype}",
                [(f"train-mhf-{dtype}", train_args(ctx, whole, "tiny-h4b16k", dtype, *shared))],
            )
        )
        jobs.append(
            Job(
                f"mhf-{dtype}-resumed",
                [
                    (
                        f"train-mhf-{dtype}-stop",
                        train_args(
                            ctx,
                            resumed,
                            "tiny-h4b16k",
                            dtype,
                            *resumed_shared,
                            f"train.stop_at_step={m.split}",
                        ),
                    ),
                    (
                        f"train-mhf-{dtype}-resume",
                        train_args(ctx, resumed, "tiny-h4b16k", dtype, *resumed_shared),
                    ),
                ],
            )
        )

    def run(
        name: str,
        preset: str,
        dtype: str,
        *overrides: str,
        ranks: int = 1,
        device: str | None = None,
    ) -> tuple[str, list[str]]:
        args = train_args(
            ctx,
            ctx.run(name),
            preset,
            dtype,
            f"data.path={shards}",
            "train.eval_sequences=8",
            f"train.stop_at_step={m.compare_steps}",
            *overrides,
            *(gloo_overrides(ctx) if ranks > 1 else ()),
            device=device,
        )
        return f"train-{name}", args + (["--nproc-per-node", str(ranks)] if ranks > 1 else [])

    def feature(name: str, *commands: tuple[str, list[str]], ranks: int = 1) -> Job:
        return Job(name, list(commands), required=False, ranks=ranks)

    engram = ("tiny-h4b16k+engram", "fp32", "train.micro_batch_size=4")
    p_inf = ("tiny-h4b16k", "bf16", "parallel.tp=2", f"model.hash.p_inf_loss_weight={P_INF_WEIGHT}")
    masked = ("tiny-h4b16k", "fp32", "data.document_masking=true")
    profiled = ("tiny-h4b16k", "fp32", f"train.profile_steps={PROFILED[0]}-{PROFILED[1]}")
    # on a GPU the masked run is held to the same run on the CPU; with --cpu it is that run
    masked_reference = (
        [run("document-masking-cpu", *masked, device="cpu")] if m.device == "cuda" else []
    )
    features = {
        "compile": feature(
            "compile",
            run(
                "compile",
                "tiny-h4b16k",
                "fp32",
                "train.compile=true",
                "train.fused_head_kernel=compiled",
            ),
        ),
        "engram-offload": feature(
            "engram-offload",
            run("engram-device", *engram),
            run("engram-offload", *engram, "model.engram.offload=true"),
        ),
        # the rows asked of their owner (one rank here) on the exchange thread, through pinned buffers; its own
        # device-table run, as the jobs run side by side
        "engram-sharded": feature(
            "engram-sharded",
            run("engram-sharded-device", *engram),
            run("engram-sharded", *engram, "model.engram.offload=sharded"),
        ),
        "p-inf-tp2-bf16": feature(
            "p-inf-tp2-bf16", run("p-inf-tp2-bf16", *p_inf, ranks=2), ranks=2
        ),
        "profile-tp2-gloo": feature(
            "profile-tp2-gloo", ("profile-tp2-gloo", profile_tp2_args(ctx)), ranks=2
        ),
        "grad-accum": feature(
            "grad-accum", run("grad-accum", "tiny-h4b16k", "fp32", "train.micro_batch_size=2")
        ),
        "document-masking": feature(
            "document-masking", run("document-masking", *masked), *masked_reference
        ),
        "profiler-window": feature("profiler-window", run("profiler-window", *profiled)),
    }
    jobs += [
        features[name]
        for name in ("compile", "engram-offload", "engram-sharded")
        if name in m.features
    ]
    for layout in m.gloo_layouts:
        name = runner.layout_check_name(layout)
        jobs.append(
            feature(name, run(name, "tiny-h4b16k", "fp32", f"parallel.{layout}", ranks=2), ranks=2)
        )
    return jobs + [
        features[name]
        for name in (
            "grad-accum",
            "profiler-window",
            "document-masking",
            "p-inf-tp2-bf16",
            "profile-tp2-gloo",
        )
        if name in m.features
    ]


def gloo_overrides(ctx: Context) -> tuple[str, ...]:
    """Two ranks on the one GPU: NCCL refuses two ranks on one device, so they share it over gloo (on CPU gloo is
    the default already)."""
    return ("train.dist_backend=gloo",) if ctx.mode.device == "cuda" else ()


def profile_tp2_args(ctx: Context) -> list[str]:
    """``mhf-dist profile --layout tp=2`` of 100m-h4b16k, 2 ranks on the one GPU over gloo."""
    args = [
        "profile",
        "--size",
        "100m",
        "--hash",
        "h4b16k",
        "--layout",
        "tp=2",
        "--dtype",
        ctx.mode.profile_dtype,
        "--seq-len",
        "512",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--vocab-sizes",
        "32768",
        "--out",
        str(ctx.work / "profile-tp2-gloo"),
    ]
    for o in ("train.fused_head_kernel=eager", *gloo_overrides(ctx)):
        args += ["--set", o]
    return args


def standard_check(ctx: Context, run: Path) -> Check:
    records = metrics(run)
    first, last = records[1]["loss"], records[ctx.mode.steps]["loss"]
    ok = math.isfinite(last) and last < first
    return Check(
        "train-standard",
        PASS if ok else FAIL,
        f"tiny-standard fp32, {ctx.mode.steps} steps: loss {first:.3f} -> {last:.3f}",
        {"first_loss": first, "last_loss": last},
    )


def resumed_at(ctx: Context, dtype: str) -> int | None:
    """The step the resumed start reported continuing from, or None."""
    found = re.search(
        r"resumed from \S+ at step (\d+)", (ctx.logs / f"train-mhf-{dtype}-resume.log").read_text()
    )
    return int(found[1]) if found else None


def resume_check(ctx: Context, dtype: str) -> Check:
    m, name = ctx.mode, f"resume-{dtype}"
    whole, resumed = metrics(ctx.run(f"mhf-{dtype}")), metrics(ctx.run(f"mhf-{dtype}-resumed"))
    steps = range(m.split + 1, m.steps + 1)
    missing = [s for s in steps if s not in whole or s not in resumed]
    if missing:
        return Check(name, FAIL, f"no loss logged at steps {missing}")
    at = resumed_at(ctx, dtype)
    if at != m.split:
        return Check(
            name, FAIL, f"the second start did not resume at step {m.split} (it reported: {at})"
        )
    abs_diffs = [abs(whole[s]["loss"] - resumed[s]["loss"]) for s in steps]
    rel_diffs = [d / abs(whole[s]["loss"]) for d, s in zip(abs_diffs, steps)]
    max_abs, max_rel, tol = max(abs_diffs), max(rel_diffs), m.resume_tolerance[dtype]
    ok = max_rel <= tol and all(math.isfinite(whole[s]["loss"]) for s in steps)
    bound = "exact" if tol == 0 else f"relative {tol:g}"
    first, last = whole[1]["loss"], whole[m.steps]["loss"]
    return Check(
        name,
        PASS if ok else FAIL,
        f"stop at {m.split}, resume to {m.steps}: steps {steps[0]}-{steps[-1]} max loss difference "
        f"{max_abs:.3g} (relative {max_rel:.3g}; tolerance {bound}); loss {first:.3f} -> {last:.3f}",
        {
            "max_abs_diff": max_abs,
            "max_rel_diff": max_rel,
            "tolerance_rel": tol,
            "steps_compared": len(steps),
            "last_loss": last,
        },
    )
