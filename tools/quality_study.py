"""A MultiHashFormer vs Standard quality study: the same shards, schedule and tokens for every model.

Usage:
  python tools/quality_study.py --out study/ [--steps 500 --eval-interval 100]
      [--run tiny-standard --run tiny-standard+6l --run tiny-h4b2k --run tiny-h4b16k
       --run "tiny-h4b2k:model.hash.p_inf_loss_weight=0.5"]

Each ``--run`` is a preset, optionally followed by ``:KEY=VALUE,KEY=VALUE`` overrides. The
embedded corpus is tokenised once (a 4,096-piece byte-level BPE, 5% of the documents held out
as the validation split) and every run trains on it with ``mhf-dist train`` (same seed, batch,
sequence length and steps, so the same tokens), evaluating the same validation sequences every
``--eval-interval`` steps. A finished run is reused when the study is run again.

Writes ``OUT/study.md`` (one row per run at its last evaluation: parameters, tokens/s, loss,
raw and calibrated perplexity under P_inf, the fitted temperature, top-1/top-5 accuracy),
``OUT/study.png`` (the validation metrics over steps) and ``OUT/study.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
from importlib import resources
from pathlib import Path

from tqdm.auto import tqdm

from mhf_dist.commands.plan import meta_model
from mhf_dist.config import load_config
from mhf_dist.data.prepare import prepare
from mhf_dist.train.metrics import read_metrics
from mhf_dist.vocab.tokenizers import embedded_corpus, train_bpe

DEFAULT_RUNS = [
    "tiny-standard",
    "tiny-standard+6l",
    "tiny-h4b2k",
    "tiny-h4b16k",
    "tiny-h4b2k:model.hash.p_inf_loss_weight=0.5",
]
COLUMNS = [  # (metrics.jsonl field, table header, format)
    ("val_p_inf_nll", "val NLL (P_inf)", "{:.3f}"),
    ("val_ppl", "ppl (P_inf)", "{:,.0f}"),
    ("val_ppl_calibrated", "ppl (calibrated)", "{:,.1f}"),
    ("val_temperature", "τ", "{:.3f}"),
    ("val_top1", "top-1", "{:.1%}"),
    ("val_top5", "top-5", "{:.1%}"),
]
PLOTS = [
    ("val_ppl", "perplexity under P_inf", True),
    ("val_ppl_calibrated", "calibrated perplexity", True),
    ("val_top1", "top-1 next-token accuracy", False),
    ("val_p_inf_nll", "validation NLL under P_inf", False),
]


def parse_run(spec: str) -> tuple[str, list[str]]:
    preset, _, overrides = spec.partition(":")
    return preset, [o for o in overrides.split(",") if o]


def slug(spec: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", spec)


def prepare_data(out: Path, seq_len: int, vocab_size: int) -> Path:
    """The embedded corpus as shards with a held-out split, tokenised once for every run."""
    data = out / "data"
    if not (data / "manifest.json").is_file():
        tokenizer = train_bpe(embedded_corpus(), vocab_size, out / "tokenizer")
        with resources.as_file(
            resources.files("mhf_dist.data").joinpath("corpus/kjv.txt.gz")
        ) as corpus:
            prepare(
                [corpus],
                tokenizer,
                data,
                seq_len=seq_len,
                samples_per_shard=128,
                val_fraction=0.05,
                progress=False,
            )
    return data


def train(spec: str, run_dir: Path, data: Path, args: argparse.Namespace) -> None:
    preset, overrides = parse_run(spec)
    records = read_metrics(run_dir)
    if records and records[-1]["step"] == args.steps and "val_ppl" in records[-1]:
        return  # finished earlier
    settings = [
        f"data.path={data}",
        f"data.seq_len={args.seq_len}",
        f"train.max_steps={args.steps}",
        f"train.eval_interval={args.eval_interval}",
        f"train.eval_sequences={args.eval_sequences}",
        f"train.global_batch_size={args.global_batch}",
        f"train.micro_batch_size={args.micro_batch}",
        f"train.log_interval={args.eval_interval}",
        *overrides,
    ]
    command = [
        sys.executable,
        "-m",
        "mhf_dist",
        "train",
        "--preset",
        preset,
        "--run-dir",
        str(run_dir),
        "--nproc-per-node",
        str(args.nproc_per_node),
        *[a for s in settings for a in ("--set", s)],
    ]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with (run_dir.parent / f"{run_dir.name}.log").open("w") as log:
        env = os.environ | {"PYTHONUNBUFFERED": "1"}
        if subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env).returncode:
            raise SystemExit(f"{spec}: training failed; see {log.name}")


def summarise(spec: str, run_dir: Path, vocab_size: int) -> dict:
    preset, overrides = parse_run(spec)
    records = read_metrics(run_dir)
    evals = [r for r in records if "val_ppl" in r]
    model = meta_model(load_config(preset, overrides=overrides).model, vocab_size)
    # the first step includes warm-up
    speeds = [r["tokens_per_s"] for r in records if "tokens_per_s" in r][1:]
    return {
        "run": spec,
        "parameters": sum(p.numel() for p in model.parameters()),
        "tokens_per_s": sum(speeds) / len(speeds) if speeds else None,
        "evaluations": [
            {k: v for k, v in r.items() if k == "step" or k.startswith("val_")} for r in evals
        ],
    }


def cell(value, fmt: str) -> str:
    return fmt.format(value) if isinstance(value, (int, float)) and math.isfinite(value) else "—"


def table(rows: list[dict], command: str) -> str:
    head = ["run", "parameters", "tokens/s", *[h for _, h, _ in COLUMNS]]
    lines = [f"`{command}`", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        last = row["evaluations"][-1] if row["evaluations"] else {}
        lines.append(
            "| "
            + " | ".join(
                [
                    f"`{row['run']}`",
                    f"{row['parameters'] / 1e6:.2f}M",
                    cell(row["tokens_per_s"], "{:,.0f}"),
                    *[cell(last.get(k), f) for k, _, f in COLUMNS],
                ]
            )
            + " |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (key, title, log_scale) in zip(axes.flat, PLOTS):
        for row in rows:
            points = [
                (e["step"], e[key])
                for e in row["evaluations"]
                if isinstance(e.get(key), (int, float))
            ]
            if points:
                ax.plot(*zip(*points), marker="o", label=row["run"])
        ax.set_title(title)
        ax.set_xlabel("step")
        if log_scale:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument(
        "--run", action="append", dest="runs", help="PRESET[:KEY=VALUE,...] (repeatable)"
    )
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--eval-interval", type=int, default=100)
    parser.add_argument("--eval-sequences", type=int, default=48)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--nproc-per-node", type=int, default=1)
    args = parser.parse_args(argv)
    runs = args.runs or DEFAULT_RUNS
    args.out.mkdir(parents=True, exist_ok=True)
    data = prepare_data(args.out, args.seq_len, args.vocab_size)
    rows = []
    for spec in tqdm(runs, desc="quality study", unit="run"):
        run_dir = args.out / "runs" / slug(spec)
        train(spec, run_dir, data, args)
        rows.append(summarise(spec, run_dir, args.vocab_size))
    command = "python tools/quality_study.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    (args.out / "study.md").write_text(table(rows, command))
    (args.out / "study.json").write_text(json.dumps({"command": command, "runs": rows}, indent=1))
    plot(rows, args.out / "study.png")
    print(table(rows, command))
    print(f"wrote {args.out}/study.md, study.png, study.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
