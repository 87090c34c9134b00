"""The main job end to end on one GPU: training and resume, layouts and features, export, generation, evaluation
and throughput.

Run it on a machine with one GPU (estimated 9 minutes on one H200 with 16 cores, see the budget below; nothing is
downloaded, the tiny runs build their tokenizer and shards from the embedded corpus)::

    mhf-dist gpu-check [--out gpu_check/] [--work DIR] [--skip compile,layout-pp2-gloo,...]

(``bash tools/gpu_check.sh ...`` in a checkout runs the same with the checkout's ``.venv``)

(``--skip`` leaves out layout and feature runs of step 2 by their check names.)

and, at tiny sizes and in fp32, on any machine without one (CI does; about 5.5 minutes on 2 cores)::

    mhf-dist gpu-check --cpu [--out DIR]

Steps (each prints a line when it starts and ends; a command that later steps depend on stops the check when it
fails, any other failure is its own row):

1. **Preflight.** ``build``: which torch build runs, read from ``torch.version.hip`` (a ROCm build; its GPUs are
   ``cuda`` devices to torch and DeepSpeed), then ``torch.version.cuda``, else "CPU build", and the devices seen.
   ``sdpa``: which scaled-dot-product-attention backend runs the model's attention call (causal, GQA through
   ``enable_gqa``, forward and backward) at the shape of the profiled size (1b: 16 query and 8 kv heads of 128,
   seq 2048; tiny with ``--cpu``), per dtype (bf16 and fp32 on a GPU, fp32 on CPU). It is read from the aten op
   that torch's profiler records (``_scaled_dot_product_flash_attention``: flash,
   ``..._efficient_attention``: efficient, ``..._cudnn_attention``: cudnn, ``..._attention_math``: math,
   ``..._flash_attention_for_cpu``: flash (CPU)), so it names what ran, on CUDA, ROCm and CPU alike. GQA falls
   back to math in fp32 and on older ROCm builds. Both rows are measurements.

2. **Training: resume, layouts, features.** ``tiny-standard`` trains first; it trains the tokenizer and prepares
   the shards of the embedded corpus that every later run reads (``data.path``). Then, per dtype (bf16 and fp32
   on a GPU, fp32 with ``--cpu``), ``tiny-h4b16k`` trains N steps (30; 8 with ``--cpu``) with a checkpoint at
   N/2, and trains again in a second run directory, stopped at N/2 (``train.stop_at_step``) and resumed to N
   (``--resume auto``, the default). The losses of steps N/2+1..N in the two ``metrics.jsonl`` must agree, and
   the second start must report that it resumed at step N/2. Tolerances, as the max relative difference of the
   per-step losses:

   - CPU, fp32: **0**. Resume is bit-identical in fp32 on CPU.
   - GPU, fp32: **1e-5**. Atomics-based CUDA kernels (index_add, embedding backward, split-K matmuls) do not
     fix their order of summation, so two uninterrupted runs may already differ in the last bits, and
     training amplifies that a little from step to step. The loss moves by about 1% per step or more in
     these runs, so a lost optimizer, scheduler or data state is far above the tolerance.
   - GPU, bf16: **1e-2**. bf16 keeps 8 significant bits (relative rounding 2^-9 = 2e-3), so one update that
     rounds the other way moves a weight by that much. The fp32 pair is the sharp test of resume.

   Beside them (the same shards and batch of 8 sequences; each run stops at step C = 10, 4 with ``--cpu``, with
   ``train.stop_at_step``, so its learning rate follows the N-step schedule of the runs it is compared with, and
   evaluates 8 validation sequences there):

   - ``layout-tp2-gloo``, ``layout-pp2-gloo`` (pp=2 on a GPU only): ``mhf-dist train --nproc-per-node 2`` at
     tp=2, then pp=2, fp32. NCCL refuses two ranks on one device, so on a GPU both ranks share it over gloo
     (``train.dist_backend=gloo``; local rank r on GPU r mod the device count): every collective then runs on
     CUDA tensors, which checks their device placement, though not NCCL. On CPU gloo is the default.
   - ``grad-accum``: one rank, micro-batch 2, so each step accumulates 4 micro-batches (global batch 8 = 4 × 2 ×
     dp 1).
   - ``compile`` (GPU): ``train.compile=true`` (each backbone block compiled, under ZeRO-3 and activation
     checkpointing), fp32; its first step's time (compilation) and the later steps' median are reported.

   These compare steps 1..C with the one-rank fp32 run above (same initial weights, data and learning rate):
   the max relative difference of the loss and of the gradient norm (before clipping) must be at most **1e-4**
   (the layout tests' tolerance; fp32 sums in another order differ by about 1e-6 per step), and the loss must
   fall. A wrong gradient scale hides from the loss behind Adam and clipping, not from the gradient norm.

   - ``engram-offload`` (GPU): ``tiny-h4b16k+engram`` with 2 micro-batches per step, first with its tables on
     the device, then in pinned host memory (``model.engram.offload=true``: the CUDA branch, whose side stream
     gathers the next micro-batch's rows while the current one computes), fp32. The losses and gradient norms of
     steps 1..C must agree to **1e-4** relative, and the host-table run's peak device memory must be below the
     device-table run's.
   - ``p-inf-tp2-bf16`` (GPU): ``model.hash.p_inf_loss_weight=0.5`` at tp=2 in bf16, 2 ranks over gloo. Every
     logged loss and ``p_inf_loss`` of steps 1..C must be finite, each step's loss must equal its head losses plus
     0.5 × ``p_inf_loss`` to **1e-2** relative (the head losses are logged in bf16, together up to 3e-3 off; the
     term is about 10% of the loss), the head losses of step 1 must be the bf16 one-rank run's loss of step 1 to
     **1e-2** (the same weights and batch), and ``p_inf_loss`` must fall from step 1 to C.
   - ``profile-tp2-gloo`` (GPU): ``mhf-dist profile --size 100m --hash h4b16k --layout tp=2 --seq-len 512`` with
     ``--set train.dist_backend=gloo`` (2 ranks on the GPU). A measurement: its row must be finite and positive,
     of layout tp=2, with tensor-parallel traffic. It runs beside the other runs, so its speed means nothing.

   A 2-rank run over gloo may fail because gloo has no implementation of a collective for CUDA tensors. That is
   reported as **not runnable with gloo**, not as a failure, when the log holds one of gloo's own errors
   (:data:`GLOO_LIMITS`): ``ProcessGroupGloo::<op>: unsupported device type cuda``, ``Backend gloo does not
   support <op>``, ``Invalid scalar type`` raised from a torch.distributed collective, a gloo transport error
   "Bad address" (gloo's send/recv hand the CUDA tensor's device pointer to a CPU socket), or a segmentation
   fault whose Python stack (``PYTHONFAULTHANDLER``) is in torch.distributed's send or recv. Any other failure,
   a timeout included (180 s on a GPU, about three times such a run's expected time), is FAIL.

3. **Export and inference.** ``mhf-dist export-hf`` writes the fp32 MHF run and the Standard run as Hugging
   Face models. ``mhf-dist generate`` must print a continuation of the prompt. Decoding speed comes from the
   Python API that the command calls (``mhf_dist.commands.generate.load_for_inference`` and ``generate``), eager and
   with ``compile=True`` (``generate --compile``: static KV cache, compiled decode step, CUDA graphs on
   GPUs). Each variant has warm-up calls first, so compilation is not timed. Then the median of 3 calls,
   synchronised, over the tokens generated (prefill included), in fp32. Compiled decoding must produce
   the eager tokens (greedy). ``mhf-dist eval --data SHARDS`` must reproduce the perplexity that the
   training loop measured on the same validation split: the runs evaluate the whole split
   (``train.eval_sequences``), so both average the same tokens, in fp32. The tolerance is 1e-4 relative on
   ``-log P_inf`` (CPU and GPU): the exported model's logits are the trained model's ``log P_inf`` (tests
   hold them to 1e-5 in fp32), and the two average in different orders.

4. **Throughput.** ``mhf-dist profile`` at ``--size 1b`` and ``100m`` (``tiny`` with ``--cpu``) for
   ``standard`` and ``h4b16k``: the timed training step (``profile-1b-h4b16k`` is the timed bf16 1B step: its
   median step time, tokens/s and MFU), MFU against the peak the profile measures (a timed matmul) and, on a
   GPU, against the nominal dense bf16 peak (``--nominal-tflops``, default 989: an H200), peak memory, the
   MHF/Standard step-time ratio next to the analytic FLOP ratio (``mhf_dist.model.flops.forward_flops``),
   and the inference heads' time per token. On a GPU: bf16, seq 2048, micro-batch 1, 2 warm-up and 5
   measured steps, heads at V = 32,768 and 131,072. These rows are measurements; they fail only when a
   number is not finite or not positive.

Time on one H200 with 16 cores (estimates; nothing here has been timed on a GPU yet): preflight 10 s (the
attention probe at 1b's shape); step 2 about 3 minutes: ``tiny-standard`` 30 s, then 11 jobs side by side
(12 training processes, a profile and its 2 ranks), bounded by the compile run (a start of 15-20 s, 60-90 s of
compilation and again 20-30 s for its final evaluation's no-grad graphs) and by the stop-and-resume pairs (two
starts of 20-30 s each); the 2-rank runs compile nothing on CUDA, and each job's steps take seconds. Step 3
about 3 minutes (decoding with ``compile=True`` dominates); step 4 about 2.5 minutes (each 1B configuration builds
its model in a fresh process). In all about 9 minutes; ``--skip compile`` saves up to a minute. With ``--cpu``
step 2 adds two runs (tp=2 and accumulation), 60-90 s on 2 idle cores (the check took 4.3 minutes without them).

Then one table, printed and written as ``gpu_check.md`` and ``gpu_check.json`` in ``--out``. It gives the
date, the device, the torch build and the DeepSpeed version. Both files are rewritten after every step, so a
check stopped from outside still leaves what it measured, and the JSON holds each step's seconds. The exit
code is 1 if any check failed ("not runnable with gloo" is not a failure). Command logs go to ``OUT/logs/``.
Runs, models and profiles go to ``--work`` (default ``OUT/work``, emptied at the start). On a GPU the tiny
trainings of step 2 run side by side.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import functools
import importlib.metadata
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mhf_dist.backend import versions as backend_versions
from mhf_dist.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]  # a checkout's root when installed editable (its .venv, its commit)
PROMPT = "In the beginning God created"
PASS, FAIL, MEASURED, SKIPPED = "PASS", "FAIL", "measured", "skipped"
NOT_RUNNABLE = "not runnable with gloo"  # a 2-rank run that gloo cannot carry on CUDA tensors (not a failure)
P_INF_WEIGHT = 0.5  # model.hash.p_inf_loss_weight of the p-inf-tp2-bf16 run
BF16_TOLERANCE = 1e-2  # relative: bf16 keeps 8 significant bits (see the resume tolerances)


@dataclass(frozen=True)
class Mode:
    """Sizes and tolerances of one way of running the check."""

    name: str
    device: str
    dtypes: tuple[str, ...]  # training dtypes whose resume is checked
    steps: int  # training steps per run
    split: int  # checkpoint, stop and resume step
    resume_tolerance: dict[str, float]  # per dtype: max relative difference of the losses after resuming
    eval_tolerance: float  # relative difference of -log P_inf, eval vs the training loop
    new_tokens: int  # tokens generated per timed call
    profiles: tuple[tuple[str, int], ...]  # (size, seq_len)
    profile_dtype: str
    profile_steps: int
    profile_warmup: int
    vocab_sizes: str  # registered vocabularies of the profile's inference-head timing
    jobs: int  # training runs at once (a GPU runs several tiny ones side by side)
    timeout_s: int  # per command
    compare_steps: int  # C: the layout and feature runs stop here and are compared over steps 1..C
    compare_tolerance: float  # max relative difference of their losses and gradient norms (fp32)
    gloo_layouts: tuple[str, ...]  # 2-rank layouts trained over gloo ("tp=2", "pp=2")
    features: tuple[str, ...]  # further runs, by check name: "compile", "engram-offload", "grad-accum", ...
    sdpa_dtypes: tuple[str, ...]  # dtypes whose attention backend is reported
    gloo_timeout_s: int  # per command of a 2-rank run (a collective gloo cannot carry may hang, not fail)


GPU = Mode(name="gpu", device="cuda", dtypes=("bf16", "fp32"), steps=30, split=15,
           resume_tolerance={"bf16": BF16_TOLERANCE, "fp32": 1e-5}, eval_tolerance=1e-4, new_tokens=64,
           profiles=(("1b", 2048), ("100m", 2048)), profile_dtype="bf16", profile_steps=5, profile_warmup=2,
           vocab_sizes="32768,131072", jobs=12, timeout_s=300, compare_steps=10, compare_tolerance=1e-4,
           gloo_layouts=("tp=2", "pp=2"),
           features=("compile", "engram-offload", "grad-accum", "p-inf-tp2-bf16", "profile-tp2-gloo"),
           sdpa_dtypes=("bf16", "fp32"), gloo_timeout_s=180)
CPU = Mode(name="cpu", device="cpu", dtypes=("fp32",), steps=8, split=4,
           resume_tolerance={"fp32": 0.0}, eval_tolerance=1e-4, new_tokens=8,
           profiles=(("tiny", 128),), profile_dtype="fp32", profile_steps=1, profile_warmup=1,
           vocab_sizes="4096", jobs=1, timeout_s=600, compare_steps=4, compare_tolerance=1e-4,
           gloo_layouts=("tp=2",), features=("grad-accum",), sdpa_dtypes=("fp32",), gloo_timeout_s=600)


@dataclass
class Check:
    """One row of the summary table."""

    name: str
    status: str  # PASS, FAIL, MEASURED, SKIPPED or NOT_RUNNABLE
    result: str
    values: dict[str, float] = field(default_factory=dict)


class StepFailed(Exception):
    """A command or an expectation that the later steps depend on failed; ``log``: the command's output."""

    def __init__(self, message: str, log: Path | None = None):
        super().__init__(message)
        self.log = log


@dataclass
class Job:
    """Commands run in order, beside the step's other jobs; ``name`` is its check (or run) name."""

    name: str
    commands: list[tuple[str, list[str]]]
    required: bool = True  # later checks read its runs: a failure stops the check
    ranks: int = 1  # 2: two ranks over gloo, whose failure may be a gloo limitation


class Context:
    """The mode, the output folders, and the printing shared by the steps."""

    def __init__(self, mode: Mode, out: Path, work: Path, nominal_tflops: float):
        self.mode, self.out, self.work, self.nominal_tflops = mode, out, work, nominal_tflops
        self.logs = out / "logs"
        self._lock = threading.Lock()

    def say(self, message: str) -> None:
        with self._lock:
            print(message, flush=True)

    def run(self, name: str) -> Path:
        return self.work / "runs" / name

    def model(self, name: str) -> Path:
        return self.work / "models" / name


# ------------------------------------------------------------------ commands
def mhf_dist(ctx: Context, name: str, args: list[str], timeout_s: int | None = None) -> str:
    """Run ``mhf-dist ARGS`` (its output in ``OUT/logs/NAME.log``); returns its stdout, raises
    :class:`StepFailed` on a non-zero exit or a timeout (``timeout_s``, default the mode's)."""
    cmd = [sys.executable, "-m", "mhf_dist", *args]
    log = ctx.logs / f"{name}.log"
    timeout_s = timeout_s or ctx.mode.timeout_s
    ctx.say(f"  {name}: started (log {log})")
    began = time.perf_counter()
    # its own process group, so that a timeout also ends the ranks a command starts; a rank that crashes prints
    # its Python stack (PYTHONFAULTHANDLER), which tells a gloo limitation from a defect
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=os.environ | {"PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"})
    timed_out = False
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        timed_out = True
    log.write_text(f"$ {shlex.join(cmd)}\n{stdout}{stderr}")
    seconds = time.perf_counter() - began
    if timed_out or proc.returncode != 0:
        why = f"was stopped at its time limit of {timeout_s} s" if timed_out else f"exited {proc.returncode}"
        lines = [line for line in (stdout + stderr).splitlines() if line.strip()]
        tail = "\n".join(f"    {line}" for line in lines[-30:])
        raise StepFailed(f"{name} {why} ({seconds:.0f} s): {lines[-1].strip() if lines else 'no output'} "
                         f"(log {log})\n{tail}", log)
    ctx.say(f"  {name}: done in {seconds:.1f} s")
    return stdout


def run_jobs(ctx: Context, jobs: list[Job]) -> dict[str, BaseException | None]:
    """Each job's commands in order, ``mode.jobs`` jobs at once; after all ended, each job's error (None: it
    succeeded) by name."""

    def run_job(job: Job):
        for name, args in job.commands:
            mhf_dist(ctx, name, args, ctx.mode.gloo_timeout_s if job.ranks > 1 else None)

    with concurrent.futures.ThreadPoolExecutor(ctx.mode.jobs) as pool:
        futures = {job.name: pool.submit(run_job, job) for job in jobs}
    return {name: future.exception() for name, future in futures.items()}


# ------------------------------------------------------------------ step 2: training, resume, layouts, features
def train_args(ctx: Context, run: Path, preset: str, dtype: str, *overrides: str) -> list[str]:
    m = ctx.mode
    args = ["train", "--preset", preset, "--run-dir", str(run)]
    for o in (f"train.max_steps={m.steps}", f"train.checkpoint_interval={m.split}", "train.log_interval=1",
              f"train.dtype={dtype}", f"train.device={m.device}", *overrides):
        args += ["--set", o]
    return args


def metrics(run: Path) -> dict[int, dict]:
    """The run's ``metrics.jsonl`` records by step."""
    from mhf_dist.train.metrics import read_metrics

    return {r["step"]: r for r in read_metrics(run)}


def validation_sequences(shards: Path) -> int:
    return json.loads((shards / "manifest.json").read_text())["splits"]["val"]["samples"]


def step_train(ctx: Context) -> list[Check]:
    from mhf_dist.config import load_config

    m = ctx.mode
    standard = ctx.run("standard")
    mhf_dist(ctx, "train-standard", train_args(ctx, standard, "tiny-standard", "fp32"))
    shards = standard / "data"
    val = validation_sequences(shards)
    micro = load_config("tiny-h4b16k").train.micro_batch_size  # the training loop evaluates whole micro-batches
    if val % micro:
        raise StepFailed(f"the validation split of {shards} holds {val} sequences, not a multiple of {micro}: "
                         "the training loop would not evaluate all of it, and eval could not be compared")
    jobs = training_jobs(ctx, shards, val)
    errors = run_jobs(ctx, jobs)
    failed = [errors[job.name] for job in jobs if job.required and errors[job.name] is not None]
    if failed:
        raise failed[0]
    checks = [standard_check(ctx, standard)] + [resume_check(ctx, dtype) for dtype in m.dtypes]
    return checks + [feature_check(ctx, job, errors[job.name]) for job in jobs if not job.required]


def training_jobs(ctx: Context, shards: Path, val: int) -> list[Job]:
    """The trainings on the prepared shards (``val`` validation sequences), all side by side: the resume pairs
    (required by the later steps; they evaluate the whole split), then the layout and feature runs (each its own
    check; they evaluate one batch of 8 sequences at their end), longest first."""
    m, jobs = ctx.mode, []
    shared = (f"data.path={shards}", f"train.eval_sequences={val}")
    for dtype in m.dtypes:
        whole, resumed = ctx.run(f"mhf-{dtype}"), ctx.run(f"mhf-{dtype}-resumed")
        jobs.append(Job(f"mhf-{dtype}", [(f"train-mhf-{dtype}", train_args(ctx, whole, "tiny-h4b16k", dtype,
                                                                            *shared))]))
        jobs.append(Job(f"mhf-{dtype}-resumed", [
            (f"train-mhf-{dtype}-stop", train_args(ctx, resumed, "tiny-h4b16k", dtype, *shared,
                                                   f"train.stop_at_step={m.split}")),
            (f"train-mhf-{dtype}-resume", train_args(ctx, resumed, "tiny-h4b16k", dtype, *shared)),
        ]))

    def run(name: str, preset: str, dtype: str, *overrides: str, ranks: int = 1) -> tuple[str, list[str]]:
        args = train_args(ctx, ctx.run(name), preset, dtype, f"data.path={shards}", "train.eval_sequences=8",
                          f"train.stop_at_step={m.compare_steps}", *overrides,
                          *(gloo_overrides(ctx) if ranks > 1 else ()))
        return f"train-{name}", args + (["--nproc-per-node", str(ranks)] if ranks > 1 else [])

    def feature(name: str, *commands: tuple[str, list[str]], ranks: int = 1) -> Job:
        return Job(name, list(commands), required=False, ranks=ranks)

    engram = ("tiny-h4b16k+engram", "fp32", "train.micro_batch_size=4")
    p_inf = ("tiny-h4b16k", "bf16", "parallel.tp=2", f"model.hash.p_inf_loss_weight={P_INF_WEIGHT}")
    features = {
        "compile": feature("compile", run("compile", "tiny-h4b16k", "fp32", "train.compile=true")),
        "engram-offload": feature("engram-offload", run("engram-device", *engram),
                                  run("engram-offload", *engram, "model.engram.offload=true")),
        "p-inf-tp2-bf16": feature("p-inf-tp2-bf16", run("p-inf-tp2-bf16", *p_inf, ranks=2), ranks=2),
        "profile-tp2-gloo": feature("profile-tp2-gloo", ("profile-tp2-gloo", profile_tp2_args(ctx)), ranks=2),
        "grad-accum": feature("grad-accum", run("grad-accum", "tiny-h4b16k", "fp32", "train.micro_batch_size=2")),
    }
    jobs += [features[name] for name in ("compile", "engram-offload") if name in m.features]
    for layout in m.gloo_layouts:
        name = layout_check_name(layout)
        jobs.append(feature(name, run(name, "tiny-h4b16k", "fp32", f"parallel.{layout}", ranks=2), ranks=2))
    return jobs + [features[name] for name in ("grad-accum", "p-inf-tp2-bf16", "profile-tp2-gloo")
                   if name in m.features]


def without(mode: Mode, names: set[str]) -> Mode:
    """``mode`` less the layout and feature runs named (``--skip``)."""
    layouts = {layout_check_name(layout): layout for layout in mode.gloo_layouts}
    unknown = names - layouts.keys() - set(mode.features)
    if unknown:
        raise ValueError(f"--skip {','.join(sorted(unknown))}: not a layout or feature run of the {mode.name} mode "
                         f"(those are {', '.join([*layouts, *mode.features])})")
    return dataclasses.replace(mode, features=tuple(name for name in mode.features if name not in names),
                               gloo_layouts=tuple(layout for name, layout in layouts.items() if name not in names))


def layout_check_name(layout: str) -> str:
    return f"layout-{layout.replace('=', '')}-gloo"  # tp=2: layout-tp2-gloo


def gloo_overrides(ctx: Context) -> tuple[str, ...]:
    """Two ranks on the one GPU: NCCL refuses two ranks on one device, so they share it over gloo (on CPU gloo is
    the default already)."""
    return ("train.dist_backend=gloo",) if ctx.mode.device == "cuda" else ()


def profile_tp2_args(ctx: Context) -> list[str]:
    """``mhf-dist profile --layout tp=2`` of 100m-h4b16k, 2 ranks on the one GPU over gloo."""
    args = ["profile", "--size", "100m", "--hash", "h4b16k", "--layout", "tp=2", "--dtype", ctx.mode.profile_dtype,
            "--seq-len", "512", "--steps", "2", "--warmup", "1", "--vocab-sizes", "32768",
            "--out", str(ctx.work / "profile-tp2-gloo")]
    for o in gloo_overrides(ctx):
        args += ["--set", o]
    return args


def standard_check(ctx: Context, run: Path) -> Check:
    records = metrics(run)
    first, last = records[1]["loss"], records[ctx.mode.steps]["loss"]
    ok = math.isfinite(last) and last < first
    return Check("train-standard", PASS if ok else FAIL,
                 f"tiny-standard fp32, {ctx.mode.steps} steps: loss {first:.3f} -> {last:.3f}",
                 {"first_loss": first, "last_loss": last})


def resumed_at(ctx: Context, dtype: str) -> int | None:
    """The step the resumed start reported continuing from, or None."""
    found = re.search(r"resumed from \S+ at step (\d+)", (ctx.logs / f"train-mhf-{dtype}-resume.log").read_text())
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
        return Check(name, FAIL, f"the second start did not resume at step {m.split} (it reported: {at})")
    abs_diffs = [abs(whole[s]["loss"] - resumed[s]["loss"]) for s in steps]
    rel_diffs = [d / abs(whole[s]["loss"]) for d, s in zip(abs_diffs, steps)]
    max_abs, max_rel, tol = max(abs_diffs), max(rel_diffs), m.resume_tolerance[dtype]
    ok = max_rel <= tol and all(math.isfinite(whole[s]["loss"]) for s in steps)
    bound = "exact" if tol == 0 else f"relative {tol:g}"
    first, last = whole[1]["loss"], whole[m.steps]["loss"]
    return Check(name, PASS if ok else FAIL,
                 f"stop at {m.split}, resume to {m.steps}: steps {steps[0]}-{steps[-1]} max loss difference "
                 f"{max_abs:.3g} (relative {max_rel:.3g}; tolerance {bound}); loss {first:.3f} -> {last:.3f}",
                 {"max_abs_diff": max_abs, "max_rel_diff": max_rel, "tolerance_rel": tol,
                  "steps_compared": len(steps), "last_loss": last})


# ------------------------------------------------------------------ the layout and feature runs' checks
# gloo's own errors when a collective meets what it cannot carry (see the module docstring); group 1 (when present)
# or the whole match is reported
GLOO_LIMITS = (
    re.compile(r"ProcessGroupGloo::\w+: unsupported device type \w+"),  # no CUDA implementation of the op
    re.compile(r"Backend gloo does not support \w+"),  # no implementation on any device
    re.compile(r'distributed_c10d\.py", line \d+, in \w+\n(?:[ \t][^\n]*\n){0,4}\w*Error: (Invalid scalar type)'),
    re.compile(r"[^\n]*gloo[^\n]*Bad address[^\n]*"),  # send/recv: the device pointer reached a CPU socket
)
# the innermost Python frame of a thread in PYTHONFAULTHANDLER's dump, when it is torch.distributed's send/recv
P2P_CRASH = re.compile(r'\(most recent call first\):\n\s+File "[^"]*distributed_c10d\.py", line \d+ in '
                       r'(i?send|i?recv)\b')


def gloo_limitation(log: str) -> str | None:
    """The error text in a failed 2-rank run's log that makes it a gloo limitation, or None (a defect)."""
    for pattern in GLOO_LIMITS:
        found = pattern.search(log)
        if found:
            return (found[1] if found.groups() else found[0]).strip()
    crash = P2P_CRASH.search(log) if "Segmentation fault" in log else None
    if crash:
        return f"segmentation fault in torch.distributed.{crash[1]}"
    return None


def feature_check(ctx: Context, job: Job, error: BaseException | None) -> Check:
    """The check of a layout or feature run: its rule, or why its run failed. An error in reading its results is
    its own failure, not the step's (the other rows still count)."""
    if error is not None:
        return failed_run_check(job, error)
    layouts = {layout_check_name(layout): layout for layout in ctx.mode.gloo_layouts}
    try:
        if job.name in layouts:
            return comparison_check(ctx, job.name, ctx.run(job.name),
                                    f"2 ranks, {layouts[job.name]} (dp 1) over gloo, fp32 on {ctx.mode.device}")
        return {"grad-accum": grad_accum_check, "compile": compile_check, "engram-offload": engram_offload_check,
                "p-inf-tp2-bf16": p_inf_check, "profile-tp2-gloo": profile_tp2_check}[job.name](ctx)
    except Exception as e:
        return Check(job.name, FAIL, f"its run ended, but reading its results failed: {type(e).__name__}: {e}")


def failed_run_check(job: Job, error: BaseException) -> Check:
    log = getattr(error, "log", None)
    reason = gloo_limitation(log.read_text()) if job.ranks > 1 and log is not None and log.is_file() else None
    if reason:
        return Check(job.name, NOT_RUNNABLE, f"gloo cannot carry a collective of this run on CUDA tensors: "
                     f"{reason!r} (log {log})")
    return Check(job.name, FAIL, str(error).splitlines()[0])


def relative_differences(run: dict[int, dict], reference: dict[int, dict], steps: range, key: str) -> list[float]:
    return [abs(run[s][key] - reference[s][key]) / abs(reference[s][key]) for s in steps]


def compare(ctx: Context, run: Path, reference: Path) -> tuple[bool, str, dict[str, float]]:
    """Steps 1..C of ``run`` against ``reference``: the loss and (when both log it) the gradient norm agree to the
    mode's tolerance, and the loss falls. (passed, what it found, values)."""
    m, steps = ctx.mode, range(1, ctx.mode.compare_steps + 1)
    got, want = metrics(run), metrics(reference)
    missing = [s for s in steps if s not in got or s not in want]
    if missing:
        return False, f"no metrics at steps {missing} of {run.name} or {reference.name}", {}
    keys = ["loss"] + (["grad_norm"] if all("grad_norm" in r[s] for r in (got, want) for s in steps) else [])
    values = {f"max_rel_diff_{key}": max(relative_differences(got, want, steps, key)) for key in keys}
    first, last = got[1]["loss"], got[m.compare_steps]["loss"]
    finite = all(math.isfinite(got[s][key]) for s in steps for key in keys)
    ok = finite and max(values.values()) <= m.compare_tolerance and last < first
    found = (f"steps 1-{m.compare_steps} against {reference.name}: max relative difference "
             + ", ".join(f"{key.replace('_', ' ')} {values[f'max_rel_diff_{key}']:.2g}" for key in keys)
             + f" (tolerance {m.compare_tolerance:g}); loss {first:.3f} -> {last:.3f}")
    return ok, found, values | {"tolerance_rel": m.compare_tolerance, "steps_compared": len(steps), "last_loss": last}


def comparison_check(ctx: Context, name: str, run: Path, what: str) -> Check:
    ok, found, values = compare(ctx, run, ctx.run("mhf-fp32"))
    return Check(name, PASS if ok else FAIL, f"{what}: {found}", values)


def grad_accum_check(ctx: Context) -> Check:
    from mhf_dist.config import load_config

    cfg = load_config(path=ctx.run("grad-accum") / "config.yaml")
    micro, batch = cfg.train.micro_batch_size, cfg.train.global_batch_size
    return comparison_check(ctx, "grad-accum", ctx.run("grad-accum"),
                            f"global batch {batch} = {batch // micro} micro-batches of {micro} x dp 1, fp32")


def step_seconds(run: Path) -> dict[int, float]:
    """Each logged step's seconds, from its tokens/s and the run's tokens per step."""
    from mhf_dist.config import load_config

    cfg = load_config(path=run / "config.yaml")
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    return {step: tokens / r["tokens_per_s"] for step, r in metrics(run).items()}


def compile_check(ctx: Context) -> Check:
    run, reference, c = ctx.run("compile"), ctx.run("mhf-fp32"), ctx.mode.compare_steps
    ok, found, values = compare(ctx, run, reference)
    if not ok:
        return Check("compile", FAIL, f"train.compile=true, fp32: {found}", values)
    compiled, eager = step_seconds(run), step_seconds(reference)
    later = range(2, c + 1)
    values |= {"first_step_s": compiled[1], "step_ms": statistics.median(compiled[s] for s in later) * 1e3,
               "eager_step_ms": statistics.median(eager[s] for s in later) * 1e3}
    return Check("compile", PASS, f"train.compile=true, fp32: {found}; first step {values['first_step_s']:.1f} s "
                 f"(compilation), then {values['step_ms']:.0f} ms/step against {values['eager_step_ms']:.0f} eager "
                 "(runs side by side: not a speed comparison)", values)


def engram_offload_check(ctx: Context) -> Check:
    device, host = ctx.run("engram-device"), ctx.run("engram-offload")
    ok, found, values = compare(ctx, host, device)
    memory = {name: max(r["memory_gb"] for r in metrics(run).values()) for name, run in (("device", device),
                                                                                          ("host", host))}
    values |= {"device_tables_memory_gb": memory["device"], "host_tables_memory_gb": memory["host"]}
    on_gpu = ctx.mode.device == "cuda"
    if on_gpu:  # on CPU both are host memory
        ok = ok and memory["host"] < memory["device"]
    what = "peak device memory" if on_gpu else "peak RSS"
    return Check("engram-offload", PASS if ok else FAIL,
                 f"tiny-h4b16k+engram, 2 micro-batches per step, fp32, host tables against device tables: {found}; "
                 f"{what} {memory['host']:.3f} GB against {memory['device']:.3f} GB", values)


def p_inf_check(ctx: Context) -> Check:
    c, tol = ctx.mode.compare_steps, BF16_TOLERANCE
    records, reference = metrics(ctx.run("p-inf-tp2-bf16")), metrics(ctx.run("mhf-bf16"))
    steps = range(1, c + 1)
    if any(s not in records or "p_inf_loss" not in records[s] for s in steps) or 1 not in reference:
        return Check("p-inf-tp2-bf16", FAIL, f"no loss or p_inf_loss logged at some of steps 1-{c}")
    finite = all(math.isfinite(records[s][k]) for s in steps for k in ("loss", "p_inf_loss"))
    total = max(abs(r["loss"] - sum(r["head_losses"]) - P_INF_WEIGHT * r["p_inf_loss"]) / abs(r["loss"])
                for r in (records[s] for s in steps))
    first = abs(sum(records[1]["head_losses"]) - reference[1]["loss"]) / abs(reference[1]["loss"])
    p_first, p_last = records[1]["p_inf_loss"], records[c]["p_inf_loss"]
    ok = finite and total <= tol and first <= tol and p_last < p_first
    return Check("p-inf-tp2-bf16", PASS if ok else FAIL,
                 f"2 ranks tp=2 over gloo, bf16, p_inf_loss_weight {P_INF_WEIGHT:g}: p_inf_loss {p_first:.3f} -> "
                 f"{p_last:.3f}; loss = heads + {P_INF_WEIGHT:g} p_inf_loss to {total:.2g}, step-1 heads against "
                 f"the one-rank bf16 loss {first:.2g} (tolerance {tol:g} each)",
                 {"p_inf_loss_first": p_first, "p_inf_loss_last": p_last, "max_rel_diff_total": total,
                  "rel_diff_step1_heads": first, "tolerance_rel": tol})


def profile_tp2_check(ctx: Context) -> Check:
    rows = json.loads((ctx.work / "profile-tp2-gloo" / "profile.json").read_text())["training"]
    row = rows[0]
    values = {"tokens_per_s": row["tokens_per_s"], "step_s": row["step_s"], "comm_s": row["comm_s"],
              "comm_mb_per_step": row["comm_bytes_per_step"] / 2**20, "memory_gb": row["memory_gb"]}
    ok = len(rows) == 1 and row["layout"] == "tp=2" and sane(values)
    return Check("profile-tp2-gloo", MEASURED if ok else FAIL,
                 f"mhf-dist profile --layout tp=2, {row['size']}-{row['hash']} {row['dtype']} seq {row['seq_len']}, "
                 f"2 ranks over gloo: {row['tokens_per_s']:,.0f} tokens/s, {values['comm_mb_per_step']:.1f} MB of "
                 "tensor-parallel collectives per step (beside other runs: it runs, its speed means nothing)", values)


# ------------------------------------------------------------------ step 3: export, generation, evaluation
def step_inference(ctx: Context) -> list[Check]:
    models = {"mhf": ctx.model("mhf"), "standard": ctx.model("standard")}
    for name, run in (("mhf", ctx.run("mhf-fp32")), ("standard", ctx.run("standard"))):
        mhf_dist(ctx, f"export-hf-{name}", ["export-hf", str(run), str(models[name])])
    checks = [export_check(models), generate_cli_check(ctx, models["mhf"])]
    timings = {name: decoding_speed(ctx, name, path) for name, path in models.items()}
    checks += [decoding_check(name, t) for name, t in timings.items()]
    checks += [decoding_ratio_check(timings), eval_check(ctx, models["mhf"])]
    return checks


def export_check(models: dict[str, Path]) -> Check:
    sizes = {name: sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20
             for name, path in models.items()}
    ok = all((path / "config.json").is_file() for path in models.values())
    return Check("export-hf", PASS if ok else FAIL,
                 ", ".join(f"{name} {mb:.1f} MB" for name, mb in sizes.items()),
                 {f"{name}_mb": mb for name, mb in sizes.items()})


def generate_cli_check(ctx: Context, model: Path) -> Check:
    out = mhf_dist(ctx, "generate-cli", ["generate", "--model", str(model), "--prompt", PROMPT,
                                         "--max-new-tokens", str(ctx.mode.new_tokens), "--device", ctx.mode.device])
    text = out[out.find(PROMPT):].strip() if PROMPT in out else ""  # after DeepSpeed's log lines, if any
    ok = len(text) > len(PROMPT)
    return Check("generate-cli", PASS if ok else FAIL,
                 f"mhf-dist generate, {ctx.mode.new_tokens} tokens: {text[:60]!r}" + ("..." if len(text) > 60 else ""),
                 {"characters": len(text)})


def decoding_speed(ctx: Context, name: str, model_dir: Path) -> dict:
    """Milliseconds per generated token, eager and compiled, and whether both decode the same tokens."""
    import torch

    from mhf_dist.commands.generate import generate, load_for_inference

    ctx.say(f"  decoding-{name}: started")
    began = time.perf_counter()
    model, tokenizer = load_for_inference(model_dir, "fp32", ctx.mode.device)
    sync = torch.cuda.synchronize if ctx.mode.device == "cuda" else (lambda: None)
    result = {}
    for variant, compiled in (("eager", False), ("compiled", True)):
        call = functools.partial(generate, model, tokenizer, PROMPT, max_new_tokens=ctx.mode.new_tokens,
                                 compile=compiled)
        for _ in range(2):  # compilation, CUDA-graph capture, first-use allocations
            call()
        times = []
        for _ in range(3):
            sync()
            t0 = time.perf_counter()
            ids = call()
            sync()
            times.append(time.perf_counter() - t0)
        result[variant] = {"ms_per_token": statistics.median(times) / len(ids) * 1e3, "ids": ids.tolist()}
    del model
    if ctx.mode.device == "cuda":
        torch.cuda.empty_cache()
    ctx.say(f"  decoding-{name}: done in {time.perf_counter() - began:.1f} s")
    return result


def decoding_check(name: str, timing: dict) -> Check:
    eager, compiled = timing["eager"], timing["compiled"]
    same = eager["ids"] == compiled["ids"]
    return Check(f"generate-{name}", PASS if same else FAIL,
                 f"{eager['ms_per_token']:.2f} ms/token eager, {compiled['ms_per_token']:.2f} compiled "
                 f"({len(eager['ids'])} tokens; compiled tokens {'equal' if same else 'DIFFER FROM'} eager)",
                 {"eager_ms_per_token": eager["ms_per_token"], "compiled_ms_per_token": compiled["ms_per_token"],
                  "tokens": len(eager["ids"])})


def decoding_ratio_check(timings: dict) -> Check:
    ratios = {v: timings["mhf"][v]["ms_per_token"] / timings["standard"][v]["ms_per_token"]
              for v in ("eager", "compiled")}
    return Check("generate-ratio", MEASURED,
                 f"MHF/Standard time per token: {ratios['eager']:.2f}x eager, {ratios['compiled']:.2f}x compiled",
                 {f"{v}_ratio": r for v, r in ratios.items()})


def eval_check(ctx: Context, model: Path) -> Check:
    out = ctx.work / "eval.json"
    mhf_dist(ctx, "eval", ["eval", "--model", str(model), "--data", str(ctx.run("standard") / "data"),
                           "--device", ctx.mode.device, "--out", str(out)])
    ppl = json.loads(out.read_text())["perplexity"]
    trained = metrics(ctx.run("mhf-fp32"))[ctx.mode.steps]
    nll, reference = ppl["p_inf_nll"], trained["val_p_inf_nll"]
    rel = abs(nll - reference) / reference
    ok = math.isfinite(nll) and rel <= ctx.mode.eval_tolerance
    return Check("eval-perplexity", PASS if ok else FAIL,
                 f"perplexity {ppl['perplexity']:.2f} over {ppl['sequences']} val sequences; training loop "
                 f"{trained['val_ppl']:.2f} (-log P_inf rel diff {rel:.2g}; tolerance {ctx.mode.eval_tolerance:g})",
                 {"perplexity": ppl["perplexity"], "training_val_ppl": trained["val_ppl"], "rel_diff_nll": rel,
                  "sequences": ppl["sequences"]})


# ------------------------------------------------------------------ step 4: throughput
def step_profile(ctx: Context) -> list[Check]:
    m, checks = ctx.mode, []
    for size, seq_len in m.profiles:
        out = ctx.work / f"profile-{size}"
        mhf_dist(ctx, f"profile-{size}", [
            "profile", "--size", size, "--hash", "standard,h4b16k", "--dtype", m.profile_dtype,
            "--seq-len", str(seq_len), "--steps", str(m.profile_steps), "--warmup", str(m.profile_warmup),
            "--vocab-sizes", m.vocab_sizes, "--out", str(out)])
        result = json.loads((out / "profile.json").read_text())
        rows = {row["hash"]: row for row in result["training"]}
        checks += [training_row_check(ctx, size, row) for row in rows.values()]
        checks.append(step_ratio_check(size, seq_len, rows))
        checks.append(scoring_check(size, result["scoring"]))
    return checks


def sane(values: dict[str, float]) -> bool:
    return all(math.isfinite(v) and v > 0 for v in values.values())


def training_row_check(ctx: Context, size: str, row: dict) -> Check:
    values = {"tokens_per_s": row["tokens_per_s"], "step_s": row["step_s"], "tflops": row["tflops"],
              "mfu_measured_peak": row["mfu"], "peak_tflops_measured": row["peak_tflops_measured"],
              "memory_gb": row["memory_gb"]}
    nominal = ""
    if ctx.mode.device == "cuda":
        values["mfu_nominal_peak"] = row["tflops"] / ctx.nominal_tflops
        nominal = f", {values['mfu_nominal_peak']:.1%} of {ctx.nominal_tflops:g}"
    return Check(f"profile-{size}-{row['hash']}", MEASURED if sane(values) else FAIL,
                 f"timed training step, {row['dtype']} seq {row['seq_len']} x micro-batch {row['micro_batch']}: "
                 f"{row['step_s'] * 1e3:,.1f} ms (median of {ctx.mode.profile_steps}), {row['tokens_per_s']:,.0f} "
                 f"tokens/s, MFU {row['mfu']:.1%} of measured {row['peak_tflops_measured']:.3g} TFLOP/s{nominal}, "
                 f"{row['memory_gb']:.2f} GB", values)


def flop_ratio(size: str, seq_len: int) -> float:
    """Analytic training FLOPs per token, MHF-H4B16K over Standard (the profile's vocabulary for Standard)."""
    from mhf_dist.config import load_config
    from mhf_dist.model.flops import forward_flops
    from mhf_dist.profiling.training import VOCAB

    mhf = forward_flops(load_config(f"{size}-h4b16k").model, seq_len).train
    return mhf / forward_flops(load_config(f"{size}-standard").model, seq_len, vocab_rows=VOCAB).train


def step_ratio_check(size: str, seq_len: int, rows: dict[str, dict]) -> Check:
    values = {"step_time_ratio": rows["h4b16k"]["step_s"] / rows["standard"]["step_s"],
              "flop_ratio": flop_ratio(size, seq_len)}
    return Check(f"profile-{size}-ratio", MEASURED if sane(values) else FAIL,
                 f"step time MHF/Standard {values['step_time_ratio']:.2f} vs analytic FLOP ratio "
                 f"{values['flop_ratio']:.2f}", values)


def scoring_check(size: str, scoring: list[dict]) -> Check:
    values, parts = {}, []
    for s in scoring:
        v = s["vocab_size"]
        values |= {f"mhf_ms_per_token_v{v}": s["mhf_s_per_token"] * 1e3,
                   f"standard_ms_per_token_v{v}": s["standard_s_per_token"] * 1e3}
        parts.append(f"V={v:,}: MHF {s['mhf_s_per_token'] * 1e3:.3f} ms, Standard "
                     f"{s['standard_s_per_token'] * 1e3:.3f} ms ({s['ratio']:.2f}x; FLOP ratio {s['flop_ratio']:.2f})")
    return Check(f"profile-{size}-head", MEASURED if sane(values) else FAIL,
                 "inference head per token, " + "; ".join(parts), values)


# ------------------------------------------------------------------ step 1: preflight
def step_preflight(ctx: Context) -> list[Check]:
    import torch

    if ctx.mode.device == "cuda":
        if not torch.cuda.is_available():
            raise StepFailed(f"torch {torch.__version__} ({build_name()}) sees no GPU; run on a GPU machine with a "
                             "CUDA or ROCm torch, or pass --cpu")
        if os.environ.get("DS_ACCELERATOR", "cuda") != "cuda":  # ROCm GPUs are DeepSpeed's cuda accelerator too
            raise StepFailed(f"DS_ACCELERATOR={os.environ['DS_ACCELERATOR']} would keep DeepSpeed off the GPU; "
                             "unset it")
    return [build_check(ctx), sdpa_check(ctx)]


def build_name() -> str:
    """The torch build: ROCm (``torch.version.hip``; its GPUs are torch's ``cuda`` devices), CUDA, or CPU only."""
    import torch

    if torch.version.hip:
        return f"ROCm {torch.version.hip}"
    return f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build"


def build_check(ctx: Context) -> Check:
    import torch

    devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    seen = f"{devices} GPU(s), the first {torch.cuda.get_device_name()}" if devices else "no GPU visible"
    return Check("build", MEASURED, f"torch {torch.__version__}: {build_name()}; {seen}",
                 {"rocm": float(bool(torch.version.hip)), "cuda": float(bool(torch.version.cuda)),
                  "devices": float(devices)})


SDPA_OPS = {  # the aten op each scaled-dot-product-attention backend runs as, in the profiler's events
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash (CPU)",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_fused_attention_overrideable": "overrideable",
    "aten::_scaled_dot_product_attention_math": "math",
}


def sdpa_backend(device: str, dtype: str, heads: int, kv_heads: int, head_dim: int, seq_len: int) -> tuple[str, float]:
    """The backend that runs the model's attention call (``mhf_dist.model.backbone.Attention``: causal, GQA) at
    this shape, forward and backward, and its milliseconds (median of 3)."""
    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    from mhf_dist.profiling.timing import torch_dtype

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, seq_len, head_dim, generator=gen).to(device, torch_dtype(dtype)).requires_grad_()
               for n in (heads, kv_heads, kv_heads))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def call():
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=heads != kv_heads).sum().backward()
        sync()

    call()  # first-use set-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        call()
    ran = {event.name for event in prof.events()}
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return "/".join(backend for op, backend in SDPA_OPS.items() if op in ran) or "none seen", \
        statistics.median(times) * 1e3


def sdpa_check(ctx: Context) -> Check:
    from mhf_dist.config import load_config

    size, seq_len = ctx.mode.profiles[0]
    cfg = load_config(f"{size}-h4b16k").model
    shape = (cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim, seq_len)
    try:
        found = {dtype: sdpa_backend(ctx.mode.device, dtype, *shape) for dtype in ctx.mode.sdpa_dtypes}
    except Exception as e:  # a backend that fails to run is a finding, not the end of the check
        return Check("sdpa", FAIL, f"scaled_dot_product_attention failed: {type(e).__name__}: {e}")
    return Check("sdpa", MEASURED,
                 f"attention backend at {size}'s shape ({shape[0]} query / {shape[1]} kv heads of {shape[2]}, seq "
                 f"{seq_len}, causal GQA, forward + backward): "
                 + ", ".join(f"{dtype} {backend} ({ms:.2f} ms)" for dtype, (backend, ms) in found.items()),
                 {f"{dtype}_ms": ms for dtype, (_, ms) in found.items()})


# ------------------------------------------------------------------ the report
STEPS = (("preflight", step_preflight), ("training: resume, layouts, features", step_train),
         ("export, generation, evaluation", step_inference), ("throughput", step_profile))


def environment(mode: Mode) -> dict:
    import torch

    if mode.device == "cuda" and torch.cuda.is_available():
        device = torch.cuda.get_device_name()
    else:
        device = f"CPU {platform.processor() or platform.machine()}, {os.cpu_count()} cores"

    def version(package: str) -> str:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
            "device": device, "torch": torch.__version__, "cuda": torch.version.cuda, "hip": torch.version.hip,
            "build": build_name(), **backend_versions(), "transformers": version("transformers"),
            "commit": commit.stdout.strip() or "unknown"}


def markdown(mode: Mode, env: dict, checks: list[Check], elapsed: float, finished: int) -> str:
    failed = [c.name for c in checks if c.status == FAIL]
    verdict = f"FAILED {', '.join(failed)}" if failed else "all passed"
    gloo = [c.name for c in checks if c.status == NOT_RUNNABLE]
    if gloo:
        verdict += f" ({NOT_RUNNABLE}: {', '.join(gloo)})"
    if finished < len(STEPS):
        verdict += f" so far (in progress: {finished} of {len(STEPS)} steps finished)"
    lines = [f"# mhf-dist main-job check ({mode.name.upper()})", "",
             f"- date: {env['date']}, commit {env['commit']}",
             f"- device: {env['device']}",
             f"- torch {env['torch']} ({env['build']}), "
             + "".join(f"{name} {env[name]}, " for name in backend_versions()) + f"transformers {env['transformers']}",
             f"- {len(checks)} checks in {elapsed:.0f} s: {verdict}",
             "", "| check | result | status |", "|---|---|---|"]
    lines += [f"| {c.name} | {' '.join(c.result.replace('|', '/').split())} | {c.status} |" for c in checks]
    return "\n".join(lines) + "\n"


class Report:
    """``gpu_check.md`` and ``gpu_check.json``, rewritten after every step, so that a check stopped from outside
    (a machine's time limit) still leaves what it had measured."""

    def __init__(self, ctx: Context, env: dict):
        self.ctx, self.env, self.began = ctx, env, time.perf_counter()

    def write(self, checks: list[Check], timings: list[dict]) -> str:
        mode, out, elapsed = self.ctx.mode, self.ctx.out, time.perf_counter() - self.began
        text = markdown(mode, self.env, checks, elapsed, len(timings))
        (out / "gpu_check.md").write_text(text)
        (out / "gpu_check.json").write_text(json.dumps(
            {"mode": mode.name, **self.env, "elapsed_s": elapsed, "complete": len(timings) == len(STEPS),
             "passed": not any(c.status == FAIL for c in checks), "steps": timings,
             "tolerances": {"resume_rel": mode.resume_tolerance, "eval_rel": mode.eval_tolerance,
                            "compare_rel": mode.compare_tolerance},
             "checks": [asdict(c) for c in checks]}, indent=1))
        return text


def run_steps(ctx: Context, report: Report) -> tuple[list[Check], list[dict]]:
    """Every step in order; after a failed step the remaining ones are listed as skipped."""
    checks, timings, failed = [], [], None
    for i, (title, step) in enumerate(STEPS, 1):
        if failed:
            checks.append(Check(title, SKIPPED, f"not run: step {failed!r} failed"))
            timings.append({"step": title, "status": "skipped", "seconds": 0.0})
            continue
        ctx.say(f"== step {i}/{len(STEPS)}: {title}")
        began = time.perf_counter()
        try:
            checks += step(ctx)
            status = "done"
        except Exception as e:  # any failure ends the check with its message
            message = str(e) if isinstance(e, StepFailed) else f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
            checks.append(Check(title, FAIL, message.splitlines()[0]))
            ctx.say(f"step {title!r} FAILED: {message}")
            failed, status = title, "failed"
        timings.append({"step": title, "status": status, "seconds": time.perf_counter() - began})
        ctx.say(f"== step {i}/{len(STEPS)}: {title} {status} in {timings[-1]['seconds']:.0f} s")
        report.write(checks, timings)
    return checks, timings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``mhf-dist gpu-check``'s options."""
    parser.add_argument("--cpu", action="store_true", help="tiny sizes, fp32, on CPU (what CI runs)")
    parser.add_argument("--out", default="gpu_check", help="where gpu_check.md, gpu_check.json and logs/ go")
    parser.add_argument("--work", help="runs, models and profiles (emptied first; default OUT/work)")
    parser.add_argument("--nominal-tflops", type=float, default=989.0,
                        help="the GPU's nominal dense bf16 peak per device, for MFU (default: H200, 989)")
    parser.add_argument("--skip", default="", metavar="NAMES",
                        help="layout and feature runs of step 2 to leave out, by check name, comma-separated "
                        "(e.g. compile,layout-pp2-gloo)")


def run(args: argparse.Namespace) -> int:
    """The whole check with ``args`` (:func:`add_arguments`); 1 if any check failed."""
    try:
        mode = without(CPU if args.cpu else GPU, {name for name in args.skip.split(",") if name})
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if args.cpu:  # children too: no GPU, DeepSpeed on its CPU accelerator
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if Path(sys.prefix).resolve() == (ROOT / ".venv").resolve():  # DeepSpeed's compiled ops, built once per venv
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

    report = Report(ctx, environment(mode))
    ctx.say(f"mhf-dist main-job check, {mode.name} mode: {report.env['device']}; output in {out}")
    checks, timings = run_steps(ctx, report)
    print("\n" + report.write(checks, timings), flush=True)
    print(f"wrote {out / 'gpu_check.md'} and {out / 'gpu_check.json'}", flush=True)
    return 1 if any(c.status == FAIL for c in checks) else 0
