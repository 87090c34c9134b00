"""``mhf-dist status RUN_DIR``: a run's progress from its logs (no process needs to be running)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import yaml

from mhf_dist.train.checkpoint import MARKER, complete_checkpoints
from mhf_dist.train.metrics import read_metrics


def status(run_dir: str | Path) -> str:
    run = Path(run_dir)
    records = read_metrics(run)
    if not records:
        return f"{run}: no steps logged yet"
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    t = cfg["train"]
    last = records[-1]
    recent = records[-10:]
    tokens_per_step = t["global_batch_size"] * cfg["data"]["seq_len"]
    lines = [
        f"run        {run.resolve()} ({cfg.get('preset') or 'custom config'})",
        f"step       {last['step']} / {t['max_steps']} ({last['step'] / t['max_steps']:.1%}), "
        f"{last['step'] * tokens_per_step:,} tokens",
        f"loss       {last['loss']:.4f} (heads {', '.join(f'{h:.3f}' for h in last['head_losses'])})",
        f"throughput {sum(r['tokens_per_s'] for r in recent) / len(recent):,.0f} tokens/s, "
        f"MFU {sum(r['mfu'] for r in recent) / len(recent):.1%} (mean of the last {len(recent)} logged steps)",
    ]
    if evals := [r for r in records if "val_ppl" in r]:
        lines.append(f"validation step {evals[-1]['step']}: loss {evals[-1]['val_loss']:.4f}, "
                     f"perplexity (P_inf) {evals[-1]['val_ppl']:.2f}")
    ckpts = complete_checkpoints(run / "checkpoints")
    if ckpts:
        marker = json.loads((ckpts[-1] / MARKER).read_text())
        age = time.time() - (ckpts[-1] / MARKER).stat().st_mtime
        lines.append(f"checkpoint {ckpts[-1].name} ({marker['reason']}, {age / 60:.0f} min ago)")
    else:
        lines.append("checkpoint none yet")
    return "\n".join(lines)
