"""The main job end to end on one GPU: training and resume, layouts and features, export, generation, evaluation
and throughput.

Run it on a machine with one GPU (estimated 9 minutes on one H200 with 16 cores, see the budget below; nothing is
downloaded, the tiny runs build their tokenizer and shards from the embedded corpus)::

    mhf-dist gpu-check [--out gpu_check/] [--work DIR] [--skip compile,layout-pp2-gloo,...]

(``bash tools/gpu_check.sh ...`` in a checkout runs the same with the checkout's ``.venv``; ``--skip`` leaves out
layout and feature runs of step 2 by their check names) and, at tiny sizes and in fp32, on any machine without one
(CI does; about 2 minutes on 2 idle cores)::

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
     checkpointing) and the compiled fused head, fp32; its first step's time (compilation) and the later steps'
     median are reported. It is the only run of the step that compiles: every other one runs the fused head
     eagerly (``train.fused_head_kernel=eager``; ``auto`` would compile it in each CUDA run side by side).

   These compare steps 1..C with the one-rank fp32 run above (same initial weights, data and learning rate):
   the max relative difference of the loss and of the gradient norm (before clipping) must be at most **1e-4**
   (the layout tests' tolerance; fp32 sums in another order differ by about 1e-6 per step), and the loss must
   fall. A wrong gradient scale hides from the loss behind Adam and clipping, not from the gradient norm. On a GPU
   each compared step must also carry the device probe's time (``device_s``, ``train.device_probe``: on by default
   on GPUs), which times the probe's products with the device's events.

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
every training run has 1,024 buckets instead of the preset's 16,384 (a CPU step in a seventh of the time) and step 2
adds two runs (tp=2 and accumulation): 124 s in all on 2 idle cores (2026-12-03; 184 s with 16,384 buckets).

The check prints this estimate and a command's time limit first, then each command's and each step's seconds as
they end. Each command gets ``OMP_NUM_THREADS`` = the cores over the processes that can run beside it (on a GPU
the 15 processes of step 2 at once; with ``--cpu`` two jobs at a time, as the side-by-side path is what a GPU
runs), so side-by-side runs do not oversubscribe the CPU that feeds the GPU.

Then one table, printed and written as ``gpu_check.md`` and ``gpu_check.json`` in ``--out``. It gives the
date, the commit (git's when there is one, else the one pip recorded, else the package's version: no git is
needed), the device, the torch build and the DeepSpeed version. Both files are replaced whole after every command
and step, so a check stopped from outside still leaves what it measured; the JSON holds each command's and each
step's seconds. Ctrl-C or SIGTERM (a machine's time limit) ends the commands under way, marks them and the step
"interrupted", and writes the report before the check exits. The exit code is 1 if any check failed ("not runnable
with gloo" is not a failure). Command logs go to ``OUT/logs/``. Runs, models and profiles go to ``--work``
(default ``OUT/work``, emptied at the start).
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
from mhf_dist.commands.gpu_check.runner import CPU, FAIL, GPU, ROOT, SKIPPED, Check, Context, Mode, StepFailed, without
from mhf_dist.commands.gpu_check.throughput import step_profile
from mhf_dist.commands.gpu_check.training import step_train
from mhf_dist.config import ConfigError

STEPS = (("preflight", step_preflight), ("training: resume, layouts, features", step_train),
         ("export, generation, evaluation", step_inference), ("throughput", step_profile))


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
            message = str(e) if isinstance(e, StepFailed) else f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
            checks.append(Check(title, FAIL, message.splitlines()[0]))
            ctx.say(f"step {title!r} FAILED: {message}")
            failed, status = title, "failed"
        except BaseException:
            ctx.interrupt()
            timings.append({"step": title, "status": "interrupted", "seconds": time.perf_counter() - began})
            report.write(checks, timings)
            ctx.say(f"== step {i}/{len(steps)}: {title} interrupted; the report holds what ended "
                    f"({ctx.out / 'gpu_check.md'})")
            raise
        timings.append({"step": title, "status": status, "seconds": time.perf_counter() - began})
        ctx.say(f"== step {i}/{len(steps)}: {title} {status} in {timings[-1]['seconds']:.0f} s")
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


def terminated(signum, frame):
    """SIGTERM (a machine's time limit, a scheduler) ends the check as Ctrl-C does, through its handlers."""
    raise SystemExit(128 + signum)


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

    steps = STEPS
    report = reporting.Report(ctx, reporting.environment(mode), len(steps))
    ctx.say(f"mhf-dist main-job check, {mode.name} mode: {report.env['device']}, commit {report.env['commit']}; "
            f"output in {out}")
    ctx.say(plan(mode))
    # Ctrl-C and SIGTERM interrupt the check, whatever handlers the process had (restored after)
    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, terminated),
                signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler)}
    try:
        checks, timings = run_steps(ctx, report, steps)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    print("\n" + report.write(checks, timings), flush=True)
    print(f"wrote {out / 'gpu_check.md'} and {out / 'gpu_check.json'}", flush=True)
    return 1 if any(c.status == FAIL for c in checks) else 0
