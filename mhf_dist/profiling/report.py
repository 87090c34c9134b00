"""The sweep's results: ``profile.json``, ``profile.csv``, ``scoring.csv``, TensorBoard scalars and the plots
(``plot``) in the output directory, and the text table printed at the end."""

from __future__ import annotations

import csv
import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from mhf_dist.profiling.plot import plots

if TYPE_CHECKING:
    from mhf_dist.profiling.training import TrainRow


def write_outputs(
    rows: list[TrainRow], scoring: list[dict], out: Path, hardware: str
) -> str | None:
    """The training ``rows`` and ``scoring`` rows as JSON, CSV, TensorBoard scalars and plots in ``out``; returns
    why there are no plots, if there are none."""
    out.mkdir(parents=True, exist_ok=True)
    records = [asdict(r) for r in rows]
    (out / "profile.json").write_text(
        json.dumps({"training": records, "scoring": scoring}, indent=1)
    )
    for name, table in (("profile.csv", records), ("scoring.csv", scoring)):
        with (out / name).open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(table[0]))
            writer.writeheader()
            writer.writerows(table)
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(out / "tensorboard")) as tb:
        for r in rows:
            for key in (
                "tokens_per_s",
                "mfu",
                "tflops",
                "memory_gb",
                "step_s",
                "comm_bytes_per_step",
            ):
                tb.add_scalar(f"{r.layout}/{r.hash}/{key}", getattr(r, key), 0)
        for s in scoring:
            tb.add_scalar("scoring/mhf_s_per_token", s["mhf_s_per_token"], s["vocab_size"])
            tb.add_scalar(
                "scoring/standard_s_per_token", s["standard_s_per_token"], s["vocab_size"]
            )
    return plots(rows, scoring, out, hardware)


def table(rows: list[TrainRow], scoring: list[dict]) -> str:
    """The rows as a text table, with the measured peak and the scoring times. A row whose step was the document-
    masked one (``data.document_masking``) is named ``SIZE-HASH [masked]``, and a line under the table says what
    its documents were."""
    from mhf_dist.profiling.training import DOCUMENT_EOS, DOCUMENT_LEN

    names = [r.size + "-" + r.hash + (" [masked]" if r.document_masking else "") for r in rows]
    width = max([25, *map(len, names)])
    lines = [
        f"{'config':<{width}} {'layout':<6} {'tokens/s':>10} {'step s':>8} {'fwd':>6} {'bwd':>6} {'opt':>6} "
        f"{'comm':>6} {'TFLOP/s':>8} {'MFU':>6} {'mem GB':>7} {'comm MB':>8}"
    ]
    for name, r in zip(names, rows):
        lines.append(
            f"{name:<{width}} {r.layout:<6} {r.tokens_per_s:>10.1f} {r.step_s:>8.3f} "
            f"{r.forward_s:>6.2f} {r.backward_s:>6.2f} {r.optimizer_s:>6.2f} {r.comm_s:>6.2f} "
            f"{r.tflops:>8.3f} {r.mfu:>6.1%} {r.memory_gb:>7.2f} {r.comm_bytes_per_step / 2**20:>8.1f}"
        )
    lines.append(
        f"measured peak {rows[0].peak_tflops_measured:.3f} TFLOP/s ({rows[0].dtype} matmul)"
        + (f", nominal {rows[0].peak_tflops_nominal:g}" if rows[0].peak_tflops_nominal else "")
    )
    if any(r.document_masking for r in rows):
        lines.append(
            f"[masked]: data.document_masking, documents of {DOCUMENT_LEN} tokens each ending in EOS id "
            f"{DOCUMENT_EOS}, attention within each document, no loss on an EOS's next token"
        )
    for s in scoring:
        lines.append(
            f"scoring V={s['vocab_size']:>8,}: MHF {s['mhf_s_per_token'] * 1e3:8.3f} ms/token, Standard "
            f"{s['standard_s_per_token'] * 1e3:8.3f} ms/token, ratio {s['ratio']:.2f} (FLOP ratio "
            f"{s['flop_ratio']:.2f})"
        )
    return "\n".join(lines)
