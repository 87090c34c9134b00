"""Step 3: the trained runs exported as Hugging Face models, generation from the command line and its decoding speed
through the Python API (eager and compiled), and ``eval`` against the training loop's perplexity."""

from __future__ import annotations

import functools
import json
import math
import statistics
import time
from pathlib import Path

from mhf_dist.commands.gpu_check.runner import (
    FAIL,
    MEASURED,
    PASS,
    Check,
    Context,
    metrics,
    mhf_dist,
)

PROMPT = "In the beginning God created"


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
    sizes = {
        name: sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20
        for name, path in models.items()
    }
    ok = all((path / "config.json").is_file() for path in models.values())
    return Check(
        "export-hf",
        PASS if ok else FAIL,
        ", ".join(f"{name} {mb:.1f} MB" for name, mb in sizes.items()),
        {f"{name}_mb": mb for name, mb in sizes.items()},
    )


def generate_cli_check(ctx: Context, model: Path) -> Check:
    out = mhf_dist(
        ctx,
        "generate-cli",
        [
            "generate",
            "--model",
            str(model),
            "--prompt",
            PROMPT,
            "--max-new-tokens",
            str(ctx.mode.new_tokens),
            "--device",
            ctx.mode.device,
        ],
    )
    # after DeepSpeed's log lines, if any
    text = out[out.find(PROMPT) :].strip() if PROMPT in out else ""
    ok = len(text) > len(PROMPT)
    return Check(
        "generate-cli",
        PASS if ok else FAIL,
        f"mhf-dist generate, {ctx.mode.new_tokens} tokens: {text[:60]!r}"
        + ("..." if len(text) > 60 else ""),
        {"characters": len(text)},
    )


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
        call = functools.partial(
            generate, model, tokenizer, PROMPT, max_new_tokens=ctx.mode.new_tokens, compile=compiled
        )
        for _ in range(2):  # compilation, CUDA-graph capture, first-use allocations
            call()
        times = []
        for _ in range(3):
            sync()
            t0 = time.perf_counter()
            ids = call()
            sync()
            times.append(time.perf_counter() - t0)
        result[variant] = {
            "ms_per_token": statistics.median(times) / len(ids) * 1e3,
            "ids": ids.tolist(),
        }
    del model
    if ctx.mode.device == "cuda":
        torch.cuda.empty_cache()
    ctx.say(f"  decoding-{name}: done in {time.perf_counter() - began:.1f} s")
    return result


def decoding_check(name: str, timing: dict) -> Check:
    eager, compiled = timing["eager"], timing["compiled"]
    same = eager["ids"] == compiled["ids"]
    return Check(
        f"generate-{name}",
        PASS if same else FAIL,
        f"{eager['ms_per_token']:.2f} ms/token eager, {compiled['ms_per_token']:.2f} compiled "
        f"({len(eager['ids'])} tokens; compiled tokens {'equal' if same else 'DIFFER FROM'} eager)",
        {
            "eager_ms_per_token": eager["ms_per_token"],
            "compiled_ms_per_token": compiled["ms_per_token"],
            "tokens": len(eager["ids"]),
        },
    )


def decoding_ratio_check(timings: dict) -> Check:
    ratios = {
        v: timings["mhf"][v]["ms_per_token"] / timings["standard"][v]["ms_per_token"]
        for v in ("eager", "compiled")
    }
    return Check(
        "generate-ratio",
        MEASURED,
        f"MHF/Standard time per token: {ratios['eager']:.2f}x eager, {ratios['compiled']:.2f}x compiled",
        {f"{v}_ratio": r for v, r in ratios.items()},
    )


def eval_check(ctx: Context, model: Path) -> Check:
    out = ctx.work / "eval.json"
    mhf_dist(
        ctx,
        "eval",
        [
            "eval",
            "--model",
            str(model),
            "--data",
            str(ctx.run("standard") / "data"),
            "--device",
            ctx.mode.device,
            "--out",
            str(out),
        ],
    )
    ppl = json.loads(out.read_text())["perplexity"]
    trained = metrics(ctx.run("mhf-fp32"))[ctx.mode.steps]
    nll, reference = ppl["p_inf_nll"], trained["val_p_inf_nll"]
    rel = abs(nll - reference) / reference
    ok = math.isfinite(nll) and rel <= ctx.mode.eval_tolerance
    return Check(
        "eval-perplexity",
        PASS if ok else FAIL,
        f"perplexity {ppl['perplexity']:.2f} over {ppl['sequences']} val sequences; training loop "
        f"{trained['val_ppl']:.2f} (-log P_inf rel diff {rel:.2g}; tolerance {ctx.mode.eval_tolerance:g})",
        {
            "perplexity": ppl["perplexity"],
            "training_val_ppl": trained["val_ppl"],
            "rel_diff_nll": rel,
            "sequences": ppl["sequences"],
        },
    )
