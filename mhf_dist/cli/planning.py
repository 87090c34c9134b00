"""``plan``, ``profile``, ``gpu-check``, ``config``, ``presets`` and ``plot``: the commands that look at a run
before or beside it."""

from __future__ import annotations

import sys
from pathlib import Path

from mhf_dist.cli.options import (
    add_dtype,
    add_overrides,
    add_run_options,
    load_run_config,
    non_negative_int,
    positive_int,
)
from mhf_dist.config import SIZES, load_config, preset_names


def cmd_plan(args) -> int:
    from mhf_dist.cluster.profile import load_profile
    from mhf_dist.commands.plan import format_plan, memory_plan

    cfg, profile = load_run_config(args), load_profile(args.cluster)
    plans = memory_plan(cfg, profile, args.nodes, args.vocab_size)
    print(format_plan(cfg, profile, args.nodes, plans, mfu=args.mfu, vocab_size=args.vocab_size))
    return 0


def plan_parser(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="the resolved model; ZeRO model states, activations and "
        "host memory at construction per rank; does it fit? time per step at an assumed MFU",
    )
    add_run_options(p)
    p.add_argument(
        "--cluster",
        required=True,
        help="cluster profile: a100-80g, mi300x, cpu-local or a .yaml path",
    )
    p.add_argument(
        "--nodes", type=positive_int, default=1, help="nodes of the cluster profile's kind"
    )
    p.add_argument(
        "--vocab-size",
        type=positive_int,
        default=32768,
        help="registered tokens (default: Mistral v0.3's)",
    )
    p.add_argument(
        "--mfu",
        type=float,
        default=0.40,
        help="assumed model FLOPs utilisation for the time per step, a fraction in (0, 1] (default 0.40)",
    )
    p.set_defaults(func=cmd_plan)


def cmd_profile(args) -> int:
    from mhf_dist.cluster.profile import load_profile
    from mhf_dist.profiling.layouts import check_layouts, parse_layouts

    tps, hashes = parse_layouts(args.layout), args.hash.split(",")
    nominal = load_profile(args.cluster).peak_bf16_tflops if args.cluster else None
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else None
    # before any rank starts or any output is made
    check_layouts(args.size, hashes, tps, args.overrides, gpus)
    from mhf_dist.profiling.report import table, write_outputs
    from mhf_dist.profiling.scoring import profile_scoring
    from mhf_dist.profiling.sweep import run_sweep
    from mhf_dist.profiling.timing import hardware_name

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = run_sweep(
        args.size,
        hashes,
        tps,
        steps=args.steps,
        warmup=args.warmup,
        seq_len=args.seq_len,
        micro=args.micro_batch,
        dtype=args.dtype,
        out=out,
        peak_nominal=nominal,
        overrides=args.overrides,
        trace=args.trace,
    )
    cfg = load_config(f"{args.size}-h4b16k").model
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    scoring = profile_scoring(
        [int(v) for v in args.vocab_sizes.split(",")], cfg, device, dtype=args.dtype
    )
    no_plots = write_outputs(rows, scoring, out, hardware_name(device))
    print(table(rows, scoring))
    pngs = "" if no_plots else "throughput.png, memory.png, scoring.png, "
    note = f"; {no_plots}" if no_plots else ""
    print(f"wrote {out}/profile.csv, profile.json, scoring.csv, {pngs}tensorboard/{note}")
    return 0


def profile_parser(sub) -> None:
    p = sub.add_parser(
        "profile", help="tokens/s, MFU, memory and communication per hash configuration and layout"
    )
    p.add_argument("--size", default="100m", help=", ".join(SIZES))
    p.add_argument(
        "--hash",
        default="standard,h1b16k,h3b10k,h4b16k",
        help="comma-separated preset variants; +engram adds the Engram memory, e.g. h4b16k,h4b16k+engram",
    )
    p.add_argument(
        "--layout",
        default="tp=1",
        help="comma-separated tensor-parallel layouts, e.g. tp=1,tp=2 (each "
        "checked against every configuration before any rank starts)",
    )
    p.add_argument(
        "--steps", type=positive_int, default=3, help="measured training steps per configuration"
    )
    p.add_argument(
        "--warmup",
        type=non_negative_int,
        default=1,
        help="unmeasured steps before the measured ones",
    )
    p.add_argument("--seq-len", type=positive_int, default=2048, help="tokens per sequence")
    p.add_argument(
        "--micro-batch", type=positive_int, default=1, help="sequences per step per rank"
    )
    add_dtype(p)
    p.add_argument(
        "--cluster", help="profile whose nominal peak is reported next to the measured one"
    )
    p.add_argument(
        "--vocab-sizes",
        default="32768,131072,1048576",
        help="registered tokens for the scoring benchmark",
    )
    p.add_argument("--out", default="profile", help="output directory")
    p.add_argument(
        "--trace",
        action="store_true",
        help="write a PyTorch profiler trace of the first configuration",
    )
    add_overrides(p, "config overrides applied to every configuration")
    p.set_defaults(func=cmd_profile)


def cmd_profile_worker(args) -> int:
    from mhf_dist.profiling.sweep import worker_main

    return worker_main(args.rows, args.spec)


def profile_worker_parser(sub) -> None:
    # the ranks of one tensor-parallel layout, started by `profile`
    p = sub.add_parser("profile-worker")
    p.add_argument("--rows", required=True, help="where rank 0 writes its measurements (JSON)")
    p.add_argument("--spec", required=True, help="JSON of profile_training's arguments")
    p.set_defaults(func=cmd_profile_worker)


def gpu_check_parser(sub) -> None:
    from mhf_dist.commands import gpu_check  # the standard library only, until it runs

    p = sub.add_parser(
        "gpu-check",
        help="the main job end to end on one GPU (or tiny, on CPU: --cpu), as one dated table",
        description=gpu_check.__doc__,
    )
    gpu_check.add_arguments(p)
    p.set_defaults(func=gpu_check.run)


def cmd_config(args) -> int:
    """The resolved config as a file that ``train --config`` reads back as it, at any dp (a preset's micro-batch, a
    ceiling, is a comment: see ``mhf_dist.config.loader.config_yaml``)."""
    from mhf_dist.config.loader import config_yaml

    cfg = load_run_config(args)
    print(config_yaml(cfg), end="")
    if cfg.train.wandb is None:  # off; its fields would otherwise stay hidden behind `wandb: null`
        from mhf_dist.config import WandbConfig

        print(
            "# train.wandb is off (null); --set train.wandb.project=NAME turns it on, with these fields:"
        )
        for name, field in WandbConfig.model_fields.items():
            print(f"#   train.wandb.{name}: {field.default}  ({field.description})")
    return 0


def config_parser(sub) -> None:
    p = sub.add_parser("config", help="print the resolved run config")
    add_run_options(p)
    p.set_defaults(func=cmd_config)


def cmd_presets(args) -> int:
    print("\n".join(preset_names()))
    return 0


def presets_parser(sub) -> None:
    p = sub.add_parser("presets", help="list the canonical presets")
    p.set_defaults(func=cmd_presets)


def cmd_plot(args) -> int:
    from mhf_dist.commands.plot import plot

    plotted = plot(args.runs, args.out, x=args.x, health=args.health, labels=args.label)
    for note in plotted.notes:
        print(f"note: {note}", file=sys.stderr)
    print(f"wrote {args.out}: {len(plotted.titles)} panels against {args.x}")
    return 0


def plot_parser(sub) -> None:
    p = sub.add_parser(
        "plot",
        help="runs side by side as one picture: loss, validation, learning rate, gradient norm, tokens/s, "
        "downstream scores",
        description="Read run directories (running or finished, local or copied from a cluster; no process "
        "needs to run there, and torch is not loaded) and draw one panel per metric of their metrics.jsonl, each "
        "run a line: loss, val_loss, val_p_inf_nll raw and calibrated, lr, grad_norm, tokens_per_s and every "
        "eval/<task>/<metric>; --health adds the family gradient norms, bucket usage and head entropies. A last "
        "line still being written is skipped; a run with no logged step yet is left out with a note. Exits 2 if "
        "a RUN is not a run directory (no config.yaml) or no RUN has logged a step. Needs matplotlib "
        "(pip install 'mhf-dist[plots]').",
    )
    p.add_argument(
        "runs",
        nargs="+",
        metavar="RUN",
        help="run directories: the --run-dir of `train` or `submit`",
    )
    p.add_argument(
        "--out",
        required=True,
        metavar="FILE.png",
        help="the picture to write; its extension names the format (.png, .pdf, .svg)",
    )
    p.add_argument(
        "--x",
        choices=("steps", "tokens"),
        default="steps",
        help="the x axis: steps, or tokens trained (step × train.global_batch_size × data.seq_len of the "
        "run's config.yaml), which lines up runs of different batch sizes",
    )
    p.add_argument(
        "--health",
        action="store_true",
        help="add the health panels: each parameter family's gradient norm (grad_norm/FAMILY), each head's "
        "bucket usage (buckets_used/headI) and entropy (head_entropy/headI)",
    )
    p.add_argument(
        "--label",
        action="append",
        metavar="NAME",
        help="a run's name in the legends instead of its directory's name; once per run, in the runs' order",
    )
    p.set_defaults(func=cmd_plot)
