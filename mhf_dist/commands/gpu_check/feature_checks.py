"""Step 2's checks of the layout and feature runs (``training`` runs them): a
failed 2-rank run told as a gloo limitation or a defect; a run's losses and gradient norms against the reference run;
and each feature's own rule (grad-accum, compile, engram-offload, document-masking, profiler-window, p-inf-tp2-bf16,
profile-tp2-gloo). docs/profiling.md, "GPU check", gives the rules and their tolerances."""

from __future__ import annotations

import gc
import json
import math
import pickle
import re
import statistics
from pathlib import Path

from mhf_dist.commands.gpu_check import runner
from mhf_dist.commands.gpu_check.runner import (
    FAIL,
    MEASURED,
    NOT_RUNNABLE,
    PASS,
    Check,
    Context,
    Job,
    metrics,
)

P_INF_WEIGHT = 0.5  # model.hash.p_inf_loss_weight of the p-inf-tp2-bf16 run
PROFILED = (
    2,
    3,
)  # train.profile_steps of the profiler-window run (inside steps 1..C: C is at least 3)
PROFILED_TOLERANCE = (
    1e-5  # relative: its losses against the unprofiled run's (the GPU's fp32 resume tolerance)
)
STEP_MARKER = re.compile(r"ProfilerStep#(\d+)")


# gloo's own errors when a collective meets what it cannot carry (docs/profiling.md, "GPU check"); group 1 (when
# present) or the whole match is reported
GLOO_LIMITS = (
    # no CUDA implementation of the op
    re.compile(r"ProcessGroupGloo::\w+: unsupported device type \w+"),
    re.compile(r"Backend gloo does not support \w+"),  # no implementation on any device
    re.compile(
        r'distributed_c10d\.py", line \d+, in \w+\n(?:[ \t][^\n]*\n){0,4}\w*Error: (Invalid scalar type)'
    ),
    # send/recv: the device pointer reached a CPU socket
    re.compile(r"[^\n]*gloo[^\n]*Bad address[^\n]*"),
)
# the innermost Python frame of a thread in PYTHONFAULTHANDLER's dump, when it is torch.distributed's send/recv
P2P_CRASH = re.compile(
    r'\(most recent call first\):\n\s+File "[^"]*distributed_c10d\.py", line \d+ in '
    r"(i?send|i?recv)\b"
)


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
    layouts = {runner.layout_check_name(layout): layout for layout in ctx.mode.gloo_layouts}
    try:
        if job.name in layouts:
            return comparison_check(
                ctx,
                job.name,
                ctx.run(job.name),
                f"2 ranks, {layouts[job.name]} (dp 1) over gloo, fp32 on {ctx.mode.device}",
            )
        return {
            "grad-accum": grad_accum_check,
            "compile": compile_check,
            "engram-offload": engram_offload_check,
            "engram-sharded": lambda ctx: engram_offload_check(ctx, "engram-sharded"),
            "document-masking": document_masking_check,
            "profiler-window": profiler_window_check,
            "p-inf-tp2-bf16": p_inf_check,
            "profile-tp2-gloo": profile_tp2_check,
        }[job.name](ctx)
    except Exception as e:
        return Check(
            job.name,
            FAIL,
            f"its run ended, but reading its results failed: {type(e).__name__}: {e}",
        )


def failed_run_check(job: Job, error: BaseException) -> Check:
    log = getattr(error, "log", None)
    reason = (
        gloo_limitation(log.read_text())
        if job.ranks > 1 and log is not None and log.is_file()
        else None
    )
    if reason:
        return Check(
            job.name,
            NOT_RUNNABLE,
            f"gloo cannot carry a collective of this run on CUDA tensors: {reason!r} (log {log})",
        )
    return Check(job.name, FAIL, str(error).splitlines()[0])


def relative_differences(
    run: dict[int, dict], reference: dict[int, dict], steps: range, key: str
) -> list[float]:
    return [abs(run[s][key] - reference[s][key]) / abs(reference[s][key]) for s in steps]


def compare(ctx: Context, run: Path, reference: Path) -> tuple[bool, str, dict[str, float]]:
    """Steps 1..C of ``run`` against ``reference``: the loss and (when both log it) the gradient norm agree to the
    mode's tolerance, and the loss falls. (passed, what it found, values)."""
    m, steps = ctx.mode, range(1, ctx.mode.compare_steps + 1)
    got, want = metrics(run), metrics(reference)
    missing = [s for s in steps if s not in got or s not in want]
    if missing:
        return False, f"no metrics at steps {missing} of {run.name} or {reference.name}", {}
    keys = ["loss"] + (
        ["grad_norm"] if all("grad_norm" in r[s] for r in (got, want) for s in steps) else []
    )
    values = {
        f"max_rel_diff_{key}": max(relative_differences(got, want, steps, key)) for key in keys
    }
    first, last = got[1]["loss"], got[m.compare_steps]["loss"]
    finite = all(math.isfinite(got[s][key]) for s in steps for key in keys)
    # on a GPU the device probe times every logged step (train.device_probe's default there)
    probed = m.device != "cuda" or all(got[s].get("device_s", 0) > 0 for s in steps)
    ok = finite and probed and max(values.values()) <= m.compare_tolerance and last < first
    found = (
        f"steps 1-{m.compare_steps} against {reference.name}: max relative difference "
        + ", ".join(f"{key.replace('_', ' ')} {values[f'max_rel_diff_{key}']:.2g}" for key in keys)
        + f" (tolerance {m.compare_tolerance:g}); loss {first:.3f} -> {last:.3f}"
        + ("" if probed else "; the device probe timed no step")
    )
    if m.device == "cuda" and probed:  # the probe's measured cost, per logged step
        values["device_probe_s"] = statistics.median(got[s]["device_s"] for s in steps)
    return (
        ok,
        found,
        values
        | {"tolerance_rel": m.compare_tolerance, "steps_compared": len(steps), "last_loss": last},
    )


def comparison_check(ctx: Context, name: str, run: Path, what: str) -> Check:
    ok, found, values = compare(ctx, run, ctx.run("mhf-fp32"))
    return Check(name, PASS if ok else FAIL, f"{what}: {found}", values)


def grad_accum_check(ctx: Context) -> Check:
    from mhf_dist.config import load_config

    cfg = load_config(path=ctx.run("grad-accum") / "config.yaml")
    micro, batch = cfg.train.micro_batch_size, cfg.train.global_batch_size
    return comparison_check(
        ctx,
        "grad-accum",
        ctx.run("grad-accum"),
        f"global batch {batch} = {batch // micro} micro-batches of {micro} x dp 1, fp32",
    )


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
    values |= {
        "first_step_s": compiled[1],
        "step_ms": statistics.median(compiled[s] for s in later) * 1e3,
        "eager_step_ms": statistics.median(eager[s] for s in later) * 1e3,
    }
    return Check(
        "compile",
        PASS,
        f"train.compile=true, fp32: {found}; first step {values['first_step_s']:.1f} s "
        f"(compilation), then {values['step_ms']:.0f} ms/step against {values['eager_step_ms']:.0f} eager "
        "(runs side by side: not a speed comparison)",
        values,
    )


def engram_offload_check(ctx: Context, name: str = "engram-offload") -> Check:
    """Host tables (``name``: engram-offload, whole; engram-sharded, sharded over the one rank, through the
    exchange thread) against the device tables: the same losses and gradient norms, and on a GPU less device
    memory."""
    device, host = (
        ctx.run(name.replace("offload", "device").replace("sharded", "sharded-device")),
        ctx.run(name),
    )
    ok, found, values = compare(ctx, host, device)
    memory = {
        name: max(r["memory_gb"] for r in metrics(run).values())
        for name, run in (("device", device), ("host", host))
    }
    values |= {"device_tables_memory_gb": memory["device"], "host_tables_memory_gb": memory["host"]}
    on_gpu = ctx.mode.device == "cuda"
    if on_gpu:  # on CPU both are host memory
        ok = ok and memory["host"] < memory["device"]
    what = "peak device memory" if on_gpu else "peak RSS"
    kind = "host tables" if name == "engram-offload" else "sharded host tables"
    return Check(
        name,
        PASS if ok else FAIL,
        f"tiny-h4b16k+engram, 2 micro-batches per step, fp32, {kind} against device tables: {found}; "
        f"{what} {memory['host']:.3f} GB against {memory['device']:.3f} GB",
        values,
    )


def document_masking_check(ctx: Context) -> Check:
    """``data.document_masking=true`` took effect and, on a GPU, computes what it computes on the CPU: the masked
    run's loss or gradient norm differs from the unmasked one-rank run's (mhf-fp32: same weights, data and learning
    rate) by more than the comparison tolerance at some step 1..C (the shards hold an EOS after every document, so
    some rows hold two documents); on a GPU its steps 1..C equal the same masked run's on the CPU to that tolerance,
    with the loss falling and the device probe timing every step; on the CPU, where it is that run, its losses and
    gradient norms are finite and the loss falls."""
    m, steps = ctx.mode, range(1, ctx.mode.compare_steps + 1)
    run, unmasked = ctx.run("document-masking"), ctx.run("mhf-fp32")
    got, plain = metrics(run), metrics(unmasked)
    missing = [s for s in steps if s not in got or s not in plain]
    if missing:
        return Check(
            "document-masking",
            FAIL,
            f"no metrics at steps {missing} of {run.name} or {unmasked.name}",
        )
    keys = ["loss"] + (
        ["grad_norm"] if all("grad_norm" in r[s] for r in (got, plain) for s in steps) else []
    )
    effect = {
        f"unmasked_max_rel_diff_{key}": max(relative_differences(got, plain, steps, key))
        for key in keys
    }
    took_effect = all(math.isfinite(v) for v in effect.values()) and (
        max(effect.values()) > m.compare_tolerance
    )
    if m.device == "cuda":
        ok, found, values = compare(ctx, run, ctx.run("document-masking-cpu"))
    else:
        first, last = got[1]["loss"], got[m.compare_steps]["loss"]
        ok = all(math.isfinite(got[s][key]) for s in steps for key in keys) and last < first
        found = f"the CPU is its reference device; loss {first:.3f} -> {last:.3f}"
        values = {"steps_compared": len(steps), "last_loss": last}
    differences = ", ".join(
        f"{key.replace('_', ' ')} {effect[f'unmasked_max_rel_diff_{key}']:.2g}" for key in keys
    )
    verdict = (
        "" if took_effect else f", not above {m.compare_tolerance:g}: the masking took no effect"
    )
    return Check(
        "document-masking",
        PASS if ok and took_effect else FAIL,
        f"tiny-h4b16k fp32, data.document_masking=true on {m.device}: {found}; against the unmasked "
        f"{unmasked.name}: steps 1-{m.compare_steps} max relative difference {differences}{verdict}",
        values | effect | {"tolerance_rel": m.compare_tolerance},
    )


def parsed(path: Path):
    """A large JSON file's contents, read with the cyclic garbage collector paused: a trace holds about a million
    small objects, which it would otherwise scan again and again as they are made (twice the time)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return json.loads(path.read_bytes())
    finally:
        if enabled:
            gc.enable()


def trace_findings(trace: Path, cuda: bool) -> tuple[list[str], dict[str, float]]:
    """What is wrong with a profiler window's trace of steps ``PROFILED`` (nothing: an empty list), and its numbers:
    its ``ProfilerStep#N`` markers name those steps exactly, and on a GPU its CUDA kernels lie within their span
    (the ranges on the host and their projections on the device)."""
    try:
        events = parsed(trace)["traceEvents"]
    except (ValueError, KeyError, TypeError) as e:
        return [f"{trace.name} does not parse: {type(e).__name__}: {e}"], {}
    steps = [(e, STEP_MARKER.fullmatch(str(e.get("name", "")))) for e in events]
    steps = [(e, int(found[1])) for e, found in steps if found and "ts" in e]
    problems, values = [], {"trace_mb": trace.stat().st_size / 2**20}
    marked = sorted({n for _, n in steps})
    if marked != list(range(PROFILED[0], PROFILED[1] + 1)):
        problems.append(f"its step markers are {marked or 'none'}, not {list(PROFILED)}")
    if not cuda:
        return problems, values
    kernels = [e for e in events if e.get("cat") == "kernel"]
    values["kernels"] = len(kernels)
    if not kernels:
        return problems + ["it holds no CUDA kernel"], values
    if steps:
        begin = min(e["ts"] for e, _ in steps)
        end = max(e["ts"] + e.get("dur", 0) for e, _ in steps)
        outside = [k for k in kernels if k["ts"] < begin or k["ts"] + k.get("dur", 0) > end]
        if outside:
            problems.append(
                f"{len(outside)} of its {len(kernels)} CUDA kernels lie outside the profiled steps"
            )
    return problems, values


def memory_findings(snapshot: Path) -> tuple[list[str], dict[str, float]]:
    """What is wrong with a rank's CUDA memory history (a pickled ``torch.cuda.memory._snapshot()``): it holds the
    ``segments`` and ``device_traces``, and allocations made by the package's code, by their Python frames."""
    if not snapshot.is_file():
        return [f"no {snapshot.name}"], {}
    try:
        history = pickle.loads(snapshot.read_bytes())
    except Exception as e:  # unpickling raises whatever the bytes lead it to
        return [f"{snapshot.name} does not load: {type(e).__name__}: {e}"], {}
    missing = [key for key in ("segments", "device_traces") if key not in history]
    if missing:
        return [f"{snapshot.name} holds no {' or '.join(missing)}"], {}
    allocs = [e for trace in history["device_traces"] for e in trace if e.get("action") == "alloc"]
    ours = [
        e
        for e in allocs
        if any("mhf_dist/" in str(f.get("filename", "")) for f in e.get("frames") or [])
    ]
    values = {"memory_allocs": len(allocs), "memory_allocs_mhf_dist": len(ours)}
    if not ours:
        return [f"{snapshot.name}: none of its {len(allocs)} allocations names mhf_dist/"], values
    return [], values


def listed_window(ctx: Context, run: Path) -> dict | None:
    """The profiler window of steps ``PROFILED`` as ``mhf-dist status --json RUN`` lists it, or None."""
    status = json.loads(
        runner.mhf_dist(ctx, "status-profiler-window", ["status", "--json", str(run)])
    )
    name = f"step-{PROFILED[0]}-{PROFILED[1]}"
    return next((p for p in status.get("profiles") or [] if p.get("name") == name), None)


def profiler_window_check(ctx: Context) -> Check:
    """``train.profile_steps`` recorded its window and changed no number: the trace's step markers are the profiled
    steps, on a GPU its kernels lie within them and the memory history holds the package's allocations (on the CPU
    no memory history is written), ``status --json`` lists the window, and the losses of steps 1..C equal the
    unprofiled one-rank run's (mhf-fp32) to ``PROFILED_TOLERANCE``. The profiled steps' seconds are reported."""
    m, (first, last), cuda = ctx.mode, PROFILED, ctx.mode.device == "cuda"
    run, reference = ctx.run("profiler-window"), ctx.run("mhf-fp32")
    folder, steps = run / "profiles" / f"step-{first}-{last}", range(1, m.compare_steps + 1)
    got, want = metrics(run), metrics(reference)
    missing = [s for s in steps if s not in got or s not in want]
    if missing:
        return Check(
            "profiler-window",
            FAIL,
            f"no metrics at steps {missing} of {run.name} or {reference.name}",
        )
    trace = folder / "rank-0.pt.trace.json"
    problems, values = trace_findings(trace, cuda) if trace.is_file() else ([f"no {trace}"], {})
    memory = folder / "memory-rank-0.pickle"
    if cuda:
        found, more = memory_findings(memory)
        problems, values = problems + found, values | more
    elif memory.exists():
        problems.append(f"{memory.name} was written on the CPU")
    listed = listed_window(ctx, run)
    expected = {"traces": [trace.name], "memory_snapshots": [memory.name] if cuda else []}
    if listed is None or any(listed.get(key) != names for key, names in expected.items()):
        problems.append(f"status --json lists {listed}, not the window's {expected}")
    values["max_rel_diff_loss"] = max(relative_differences(got, want, steps, "loss"))
    if not values["max_rel_diff_loss"] <= PROFILED_TOLERANCE:
        problems.append(f"the profiled run's losses are not {reference.name}'s")
    seconds = {s: got[s]["step_s"] for s in steps}
    values |= {f"step_{s}_s": seconds[s] for s in range(first, last + 1)}
    others = [seconds[s] for s in steps if s > 1 and not first <= s <= last]
    if others:
        values["unprofiled_step_s"] = statistics.median(others)
    if problems:
        found = "; ".join(problems)
    else:
        found = f"the trace marks steps {first}-{last}" + (
            f", {values['kernels']:.0f} CUDA kernels within them, {values['memory_allocs_mhf_dist']:.0f} "
            "allocations from mhf_dist/ in the memory history"
            if cuda
            else ", no memory history (CPU)"
        )
        found += ", status --json lists it"
    profiled = ", ".join(f"{seconds[s]:.2f}" for s in range(first, last + 1))
    return Check(
        "profiler-window",
        FAIL if problems else PASS,
        f"tiny-h4b16k fp32, train.profile_steps={first}-{last} on {m.device}: {found}; steps 1-{m.compare_steps} "
        f"against {reference.name}: max relative loss difference {values['max_rel_diff_loss']:.2g} (tolerance "
        f"{PROFILED_TOLERANCE:g}); profiled steps {profiled} s"
        + (f" against {values['unprofiled_step_s']:.2f} s unprofiled" if others else ""),
        values | {"tolerance_rel": PROFILED_TOLERANCE, "steps_compared": len(steps)},
    )


def p_inf_check(ctx: Context) -> Check:
    c, tol = ctx.mode.compare_steps, runner.BF16_TOLERANCE
    records, reference = metrics(ctx.run("p-inf-tp2-bf16")), metrics(ctx.run("mhf-bf16"))
    steps = range(1, c + 1)
    if any(s not in records or "p_inf_loss" not in records[s] for s in steps) or 1 not in reference:
        return Check("p-inf-tp2-bf16", FAIL, f"no loss or p_inf_loss logged at some of steps 1-{c}")
    finite = all(math.isfinite(records[s][k]) for s in steps for k in ("loss", "p_inf_loss"))
    total = max(
        abs(r["loss"] - sum(r["head_losses"]) - P_INF_WEIGHT * r["p_inf_loss"]) / abs(r["loss"])
        for r in (records[s] for s in steps)
    )
    first = abs(sum(records[1]["head_losses"]) - reference[1]["loss"]) / abs(reference[1]["loss"])
    p_first, p_last = records[1]["p_inf_loss"], records[c]["p_inf_loss"]
    ok = finite and total <= tol and first <= tol and p_last < p_first
    return Check(
        "p-inf-tp2-bf16",
        PASS if ok else FAIL,
        f"2 ranks tp=2 over gloo, bf16, p_inf_loss_weight {P_INF_WEIGHT:g}: p_inf_loss {p_first:.3f} -> "
        f"{p_last:.3f}; loss = heads + {P_INF_WEIGHT:g} p_inf_loss to {total:.2g}, step-1 heads against "
        f"the one-rank bf16 loss {first:.2g} (tolerance {tol:g} each)",
        {
            "p_inf_loss_first": p_first,
            "p_inf_loss_last": p_last,
            "max_rel_diff_total": total,
            "rel_diff_step1_heads": first,
            "tolerance_rel": tol,
        },
    )


def profile_tp2_check(ctx: Context) -> Check:
    rows = json.loads((ctx.work / "profile-tp2-gloo" / "profile.json").read_text())["training"]
    row = rows[0]
    values = {
        "tokens_per_s": row["tokens_per_s"],
        "step_s": row["step_s"],
        "comm_s": row["comm_s"],
        "comm_mb_per_step": row["comm_bytes_per_step"] / 2**20,
        "memory_gb": row["memory_gb"],
    }
    ok = (
        len(rows) == 1
        and row["layout"] == "tp=2"
        and all(math.isfinite(v) and v > 0 for v in values.values())
    )
    return Check(
        "profile-tp2-gloo",
        MEASURED if ok else FAIL,
        f"mhf-dist profile --layout tp=2, {row['size']}-{row['hash']} {row['dtype']} seq {row['seq_len']}, "
        f"2 ranks over gloo: {row['tokens_per_s']:,.0f} tokens/s, {values['comm_mb_per_step']:.1f} MB of "
        "tensor-parallel collectives per step (beside other runs: it runs, its speed means nothing)",
        values,
    )
