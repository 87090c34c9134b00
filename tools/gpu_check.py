"""The main job end to end on one GPU: training and resume, export, generation, evaluation and throughput.

Run it on a machine with one GPU (sized for about 8 minutes on one H200; nothing is downloaded, the tiny runs
build their tokenizer and shards from the embedded corpus)::

    bash tools/gpu_check.sh [--out gpu_check/] [--work DIR]

and, at tiny sizes and in fp32, on any machine without one (CI does; about 4 minutes on 2 cores)::

    bash tools/gpu_check.sh --cpu [--out DIR]

Steps (each prints a line when it starts and ends; a command that fails stops the check there):

1. **Training and resume.** ``tiny-standard`` trains first; it trains the tokenizer and prepares the shards of
   the embedded corpus that every later run reads (``data.path``). Then, per dtype (bf16 and fp32 on a GPU,
   fp32 with ``--cpu``), ``tiny-h4b16k`` trains N steps (30; 8 with ``--cpu``) with a checkpoint at N/2,
   and trains again in a second run directory, stopped at N/2 (``train.stop_at_step``) and resumed to N
   (``--resume auto``, the default). The losses of steps N/2+1..N in the two ``metrics.jsonl`` must agree,
   and the second start must report that it resumed at step N/2. Tolerances, as the max relative
   difference of the per-step losses:

   - CPU, fp32: **0**. Resume is bit-identical in fp32 on CPU.
   - GPU, fp32: **1e-5**. Atomics-based CUDA kernels (index_add, embedding backward, split-K matmuls) do not
     fix their order of summation, so two uninterrupted runs may already differ in the last bits, and
     training amplifies that a little from step to step. The loss moves by about 1% per step or more in
     these runs, so a lost optimizer, scheduler or data state is far above the tolerance.
   - GPU, bf16: **1e-2**. bf16 keeps 8 significant bits (relative rounding 2^-9 = 2e-3), so one update that
     rounds the other way moves a weight by that much. The fp32 pair is the sharp test of resume.

2. **Export and inference.** ``mhf-dist export-hf`` writes the fp32 MHF run and the Standard run as Hugging
   Face models. ``mhf-dist generate`` must print a continuation of the prompt. Decoding speed comes from the
   Python API that the command calls (``mhf_dist.inference.load_for_inference`` and ``generate``), eager and
   with ``compile=True`` (``generate --compile``: static KV cache, compiled decode step, CUDA graphs on
   GPUs). Each variant has warm-up calls first, so compilation is not timed. Then the median of 3 calls,
   synchronised, over the tokens generated (prefill included), in fp32. Compiled decoding must produce
   the eager tokens (greedy). ``mhf-dist eval --data SHARDS`` must reproduce the perplexity that the
   training loop measured on the same validation split: the runs evaluate the whole split
   (``train.eval_sequences``), so both average the same tokens, in fp32. The tolerance is 1e-4 relative on
   ``-log P_inf`` (CPU and GPU): the exported model's logits are the trained model's ``log P_inf`` (tests
   hold them to 1e-5 in fp32), and the two average in different orders.

3. **Throughput.** ``mhf-dist profile`` at ``--size 1b`` and ``100m`` (``tiny`` with ``--cpu``) for
   ``standard`` and ``h4b16k``: tokens/s, MFU against the peak the profile measures (a timed matmul) and, on
   a GPU, against the nominal dense bf16 peak (``--nominal-tflops``, default 989: an H200), peak memory, the
   MHF/Standard step-time ratio next to the analytic FLOP ratio (``mhf_dist.model.flops.forward_flops``),
   and the inference heads' time per token. On a GPU: bf16, seq 2048, micro-batch 1, 2 warm-up and 5
   measured steps, heads at V = 32,768 and 131,072. These rows are measurements; they fail only when a
   number is not finite or not positive.

Then one table, printed and written as ``gpu_check.md`` and ``gpu_check.json`` in ``--out``. It gives the
date, the device, and the torch and deepspeed versions. Both files are rewritten after every step, so a
check stopped from outside still leaves what it measured, and the JSON holds each step's seconds. The exit
code is 1 if any check failed. Command logs go to ``OUT/logs/``. Runs, models and profiles go to ``--work``
(default ``OUT/work``, emptied at the start). On a GPU the four tiny MHF trainings run side by side.
"""

from __future__ import annotations

import argparse
import concurrent.futures
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

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "In the beginning God created"
PASS, FAIL, MEASURED, SKIPPED = "PASS", "FAIL", "measured", "skipped"


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


GPU = Mode(name="gpu", device="cuda", dtypes=("bf16", "fp32"), steps=30, split=15,
           resume_tolerance={"bf16": 1e-2, "fp32": 1e-5}, eval_tolerance=1e-4, new_tokens=64,
           profiles=(("1b", 2048), ("100m", 2048)), profile_dtype="bf16", profile_steps=5, profile_warmup=2,
           vocab_sizes="32768,131072", jobs=4, timeout_s=300)
CPU = Mode(name="cpu", device="cpu", dtypes=("fp32",), steps=8, split=4,
           resume_tolerance={"fp32": 0.0}, eval_tolerance=1e-4, new_tokens=8,
           profiles=(("tiny", 128),), profile_dtype="fp32", profile_steps=1, profile_warmup=1,
           vocab_sizes="4096", jobs=1, timeout_s=600)


@dataclass
class Check:
    """One row of the summary table."""

    name: str
    status: str  # PASS, FAIL, MEASURED or SKIPPED
    result: str
    values: dict[str, float] = field(default_factory=dict)


class StepFailed(Exception):
    """A command or an expectation that the later steps depend on failed."""


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
def mhf_dist(ctx: Context, name: str, args: list[str]) -> str:
    """Run ``mhf-dist ARGS`` (its output in ``OUT/logs/NAME.log``); returns its stdout, raises
    :class:`StepFailed` on a non-zero exit or a timeout."""
    cmd = [sys.executable, "-m", "mhf_dist", *args]
    log = ctx.logs / f"{name}.log"
    ctx.say(f"  {name}: started (log {log})")
    began = time.perf_counter()
    # its own process group, so that a timeout also ends the ranks a command starts
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=os.environ | {"PYTHONUNBUFFERED": "1"})
    timed_out = False
    try:
        stdout, stderr = proc.communicate(timeout=ctx.mode.timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        timed_out = True
    log.write_text(f"$ {shlex.join(cmd)}\n{stdout}{stderr}")
    seconds = time.perf_counter() - began
    if timed_out or proc.returncode != 0:
        why = f"was stopped at its time limit of {ctx.mode.timeout_s} s" if timed_out else f"exited {proc.returncode}"
        lines = [line for line in (stdout + stderr).splitlines() if line.strip()]
        tail = "\n".join(f"    {line}" for line in lines[-30:])
        raise StepFailed(f"{name} {why} ({seconds:.0f} s): {lines[-1].strip() if lines else 'no output'} "
                         f"(log {log})\n{tail}")
    ctx.say(f"  {name}: done in {seconds:.1f} s")
    return stdout


def run_chains(ctx: Context, chains: list[list[tuple[str, list[str]]]]) -> None:
    """Each chain's commands in order, ``mode.jobs`` chains at once; the first failure is raised after all ended."""

    def run_chain(chain):
        for name, args in chain:
            mhf_dist(ctx, name, args)

    with concurrent.futures.ThreadPoolExecutor(ctx.mode.jobs) as pool:
        futures = [pool.submit(run_chain, chain) for chain in chains]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        raise errors[0]


# ------------------------------------------------------------------ step 1: training and resume
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
    shared = (f"data.path={shards}", f"train.eval_sequences={val}")
    chains = []
    for dtype in m.dtypes:
        whole, resumed = ctx.run(f"mhf-{dtype}"), ctx.run(f"mhf-{dtype}-resumed")
        chains.append([(f"train-mhf-{dtype}", train_args(ctx, whole, "tiny-h4b16k", dtype, *shared))])
        chains.append([
            (f"train-mhf-{dtype}-stop", train_args(ctx, resumed, "tiny-h4b16k", dtype, *shared,
                                                   f"train.stop_at_step={m.split}")),
            (f"train-mhf-{dtype}-resume", train_args(ctx, resumed, "tiny-h4b16k", dtype, *shared)),
        ])
    run_chains(ctx, chains)
    return [standard_check(ctx, standard)] + [resume_check(ctx, dtype) for dtype in m.dtypes]


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


# ------------------------------------------------------------------ step 2: export, generation, evaluation
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

    from mhf_dist.inference import generate, load_for_inference

    ctx.say(f"  decoding-{name}: started")
    began = time.perf_counter()
    model, tokenizer = load_for_inference(model_dir, "fp32", ctx.mode.device)
    sync = torch.cuda.synchronize if ctx.mode.device == "cuda" else (lambda: None)
    result = {}
    for variant, compiled in (("eager", False), ("compiled", True)):
        call = functools.partial(generate, model, tokenizer, PROMPT, ctx.mode.new_tokens, compile=compiled)
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


# ------------------------------------------------------------------ step 3: throughput
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
                 f"{row['dtype']} seq {row['seq_len']}: {row['tokens_per_s']:,.0f} tokens/s, MFU {row['mfu']:.1%} "
                 f"of measured {row['peak_tflops_measured']:.3g} TFLOP/s{nominal}, {row['memory_gb']:.2f} GB",
                 values)


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


# ------------------------------------------------------------------ preflight and the report
def step_preflight(ctx: Context) -> list[Check]:
    if ctx.mode.device != "cuda":
        return []
    import torch

    if not torch.cuda.is_available():
        raise StepFailed(f"torch {torch.__version__} sees no CUDA device (CUDA build: {torch.version.cuda}); "
                         "run on a GPU machine with a CUDA torch, or pass --cpu")
    if os.environ.get("DS_ACCELERATOR", "cuda") != "cuda":
        raise StepFailed(f"DS_ACCELERATOR={os.environ['DS_ACCELERATOR']} would keep DeepSpeed off the GPU; unset it")
    return []


STEPS = (("preflight", step_preflight), ("training and resume", step_train),
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
            "device": device, "torch": torch.__version__, "cuda": torch.version.cuda,
            "deepspeed": version("deepspeed"), "transformers": version("transformers"),
            "commit": commit.stdout.strip() or "unknown"}


def markdown(mode: Mode, env: dict, checks: list[Check], elapsed: float, finished: int) -> str:
    failed = [c.name for c in checks if c.status == FAIL]
    verdict = f"FAILED {', '.join(failed)}" if failed else "all passed"
    if finished < len(STEPS):
        verdict += f" so far (in progress: {finished} of {len(STEPS)} steps finished)"
    lines = [f"# mhf-dist main-job check ({mode.name.upper()})", "",
             f"- date: {env['date']}, commit {env['commit']}",
             f"- device: {env['device']}",
             f"- torch {env['torch']} ({'CUDA ' + env['cuda'] if env['cuda'] else 'CPU build'}), "
             f"deepspeed {env['deepspeed']}, transformers {env['transformers']}",
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
             "tolerances": {"resume_rel": mode.resume_tolerance, "eval_rel": mode.eval_tolerance},
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="tiny sizes, fp32, on CPU (what CI runs)")
    parser.add_argument("--out", default="gpu_check", help="where gpu_check.md, gpu_check.json and logs/ go")
    parser.add_argument("--work", help="runs, models and profiles (emptied first; default OUT/work)")
    parser.add_argument("--nominal-tflops", type=float, default=989.0,
                        help="the GPU's nominal dense bf16 peak per device, for MFU (default: H200, 989)")
    args = parser.parse_args(argv)
    mode = CPU if args.cpu else GPU
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


if __name__ == "__main__":
    sys.exit(main())
