"""Step 4: ``mhf-dist profile`` of Standard and H4B16K per size: the timed training step and its MFU, the step-time
ratio beside the analytic FLOP ratio, and the inference heads' time per token; then ``tools/bench_reference.py``: our
Standard step against transformers' own Qwen3 of the same shape, in interleaved rounds, each model in its own
process."""

from __future__ import annotations

import json
import math

from mhf_dist.commands.gpu_check.runner import (
    FAIL,
    MEASURED,
    ROOT,
    SKIPPED,
    Check,
    Context,
    mhf_dist,
    python,
)

REFERENCE_BENCH = ROOT / "tools" / "bench_reference.py"


def step_profile(ctx: Context) -> list[Check]:
    m, checks = ctx.mode, []
    for size, seq_len in m.profiles:
        out = ctx.work / f"profile-{size}"
        mhf_dist(
            ctx,
            f"profile-{size}",
            [
                "profile",
                "--size",
                size,
                "--hash",
                "standard,h4b16k",
                "--dtype",
                m.profile_dtype,
                "--seq-len",
                str(seq_len),
                "--steps",
                str(m.profile_steps),
                "--warmup",
                str(m.profile_warmup),
                "--vocab-sizes",
                m.vocab_sizes,
                "--out",
                str(out),
            ],
        )
        result = json.loads((out / "profile.json").read_text())
        rows = {row["hash"]: row for row in result["training"]}
        checks += [training_row_check(ctx, size, row) for row in rows.values()]
        checks.append(step_ratio_check(size, seq_len, rows))
        checks.append(scoring_check(size, result["scoring"]))
    checks.append(reference_check(ctx))
    return checks


def reference_check(ctx: Context) -> Check:
    """Our Standard's (and MHF's) training step against transformers' ``Qwen3ForCausalLM`` of the same shape, in
    interleaved rounds, each model in its own process (``tools/bench_reference.py``, a checkout's: skipped without
    one)."""
    m = ctx.mode
    name = f"reference-{m.reference_size}"
    if not REFERENCE_BENCH.is_file():
        return Check(name, SKIPPED, f"{REFERENCE_BENCH} is not here (run from a checkout)", {})
    out = ctx.work / "reference.json"
    python(
        ctx,
        name,
        [
            str(REFERENCE_BENCH),
            "--size",
            m.reference_size,
            "--shapes",
            m.reference_shapes,
            "--rounds",
            str(m.reference_rounds),
            "--device",
            m.device,
            "--dtype",
            m.profile_dtype,
            "--out",
            str(out),
        ],
    )
    return reference_result_check(name, json.loads(out.read_text()))


def reference_result_check(name: str, result: dict) -> Check:
    values, parts = {}, []
    for shape in result["shapes"]:
        key = f"{shape['seq_len']}x{shape['micro_batch']}"
        models = shape["models"]
        values |= {
            f"{model}_tokens_per_s_{key}": row["tokens_per_s"] for model, row in models.items()
        }
        values[f"standard_over_reference_{key}"] = shape["standard_over_reference"]["median"]
        values[f"mhf_over_standard_step_{key}"] = shape["mhf_over_standard_step"]["median"]
        values[f"mhf_over_standard_flops_{key}"] = shape["mhf_over_standard_flops"]
        parts.append(
            f"seq {shape['seq_len']} x {shape['micro_batch']}: Standard "
            f"{shape['standard_over_reference']['median']:.2f}x the reference's tokens/s "
            f"({models['standard']['tokens_per_s']:,.0f} vs {models['reference']['tokens_per_s']:,.0f}), "
            f"MHF/Standard step {shape['mhf_over_standard_step']['median']:.2f} vs FLOPs "
            f"{shape['mhf_over_standard_flops']:.2f}"
        )
    return Check(
        name,
        MEASURED if sane(values) else FAIL,
        f"training step against transformers' Qwen3, {result['dtype']}, median of "
        f"{result['rounds']} rounds: " + "; ".join(parts),
        values,
    )


def sane(values: dict[str, float]) -> bool:
    return all(math.isfinite(v) and v > 0 for v in values.values())


def training_row_check(ctx: Context, size: str, row: dict) -> Check:
    values = {
        "tokens_per_s": row["tokens_per_s"],
        "step_s": row["step_s"],
        "tflops": row["tflops"],
        "mfu_measured_peak": row["mfu"],
        "peak_tflops_measured": row["peak_tflops_measured"],
        "memory_gb": row["memory_gb"],
    }
    nominal = ""
    if ctx.mode.device == "cuda":
        values["mfu_nominal_peak"] = row["tflops"] / ctx.nominal_tflops
        nominal = f", {values['mfu_nominal_peak']:.1%} of {ctx.nominal_tflops:g}"
    return Check(
        f"profile-{size}-{row['hash']}",
        MEASURED if sane(values) else FAIL,
        f"timed training step, {row['dtype']} seq {row['seq_len']} x micro-batch {row['micro_batch']}: "
        f"{row['step_s'] * 1e3:,.1f} ms (median of {ctx.mode.profile_steps}), {row['tokens_per_s']:,.0f} "
        f"tokens/s, MFU {row['mfu']:.1%} of measured {row['peak_tflops_measured']:.3g} TFLOP/s{nominal}, "
        f"{row['memory_gb']:.2f} GB",
        values,
    )


def flop_ratio(size: str, seq_len: int) -> float:
    """Analytic training FLOPs per token, MHF-H4B16K over Standard (the profile's vocabulary for Standard)."""
    from mhf_dist.config import load_config
    from mhf_dist.model.flops import forward_flops
    from mhf_dist.profiling.training import VOCAB

    mhf = forward_flops(load_config(f"{size}-h4b16k").model, seq_len).train
    return (
        mhf / forward_flops(load_config(f"{size}-standard").model, seq_len, vocab_rows=VOCAB).train
    )


def step_ratio_check(size: str, seq_len: int, rows: dict[str, dict]) -> Check:
    values = {
        "step_time_ratio": rows["h4b16k"]["step_s"] / rows["standard"]["step_s"],
        "flop_ratio": flop_ratio(size, seq_len),
    }
    return Check(
        f"profile-{size}-ratio",
        MEASURED if sane(values) else FAIL,
        f"step time MHF/Standard {values['step_time_ratio']:.2f} vs analytic FLOP ratio "
        f"{values['flop_ratio']:.2f}",
        values,
    )


def scoring_check(size: str, scoring: list[dict]) -> Check:
    values, parts = {}, []
    for s in scoring:
        v = s["vocab_size"]
        values |= {
            f"mhf_ms_per_token_v{v}": s["mhf_s_per_token"] * 1e3,
            f"standard_ms_per_token_v{v}": s["standard_s_per_token"] * 1e3,
        }
        parts.append(
            f"V={v:,}: MHF {s['mhf_s_per_token'] * 1e3:.3f} ms, Standard "
            f"{s['standard_s_per_token'] * 1e3:.3f} ms ({s['ratio']:.2f}x; FLOP ratio {s['flop_ratio']:.2f})"
        )
    return Check(
        f"profile-{size}-head",
        MEASURED if sane(values) else FAIL,
        "inference head per token, " + "; ".join(parts),
        values,
    )
