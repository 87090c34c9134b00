"""The sweep's PNG plots: throughput and MFU per hash configuration, memory per configuration, inference
scoring time per vocabulary size."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mhf_dist.profiling.training import TrainRow


PLOTS_MISSING = (
    "no plots: they need matplotlib (pip install 'mhf-dist[plots]'); profile.json, profile.csv and "
    "scoring.csv hold every number"
)


def plots(rows: list[TrainRow], scoring: list[dict], out: Path, hardware: str) -> str | None:
    """``throughput.png``, ``memory.png`` and ``scoring.png`` in ``out``, each titled with the model size, dtype and
    ``hardware``; without matplotlib (an extra: cluster installs rarely want its 80 MB), none, and the message
    that says so."""
    try:
        import matplotlib
    except ImportError:
        return PLOTS_MISSING

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    where = f"{rows[0].size}, {rows[0].dtype}, {hardware}"
    layouts = sorted({r.layout for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in ((axes[0], "tokens_per_s", "tokens/s"), (axes[1], "mfu", "MFU")):
        for j, layout in enumerate(layouts):
            sel = [r for r in rows if r.layout == layout]
            xs = [i + j * 0.8 / len(layouts) for i in range(len(sel))]
            ax.bar(xs, [getattr(r, key) for r in sel], width=0.8 / len(layouts), label=layout)
            for r in sel:
                if r.hash == "standard":
                    ax.axhline(getattr(r, key), linestyle="--", linewidth=1, color="gray")
            ax.set_xticks(range(len(sel)), [r.hash for r in sel], rotation=20)
        ax.set_ylabel(label)
        ax.set_title(f"{label} per hash configuration (dashed: Standard)\n{where}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for layout in layouts:
        sel = [r for r in rows if r.layout == layout]
        ax.bar([f"{r.hash}\n{layout}" for r in sel], [r.memory_gb for r in sel])
    ax.set_ylabel("peak memory per rank (GB)")
    ax.set_title(f"memory per configuration\n{where}")
    fig.tight_layout()
    fig.savefig(out / "memory.png", dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    vs = [s["vocab_size"] for s in scoring]
    ax.loglog(vs, [s["mhf_s_per_token"] for s in scoring], "o-", label="MultiHashFormer log P_inf")
    ax.loglog(vs, [s["standard_s_per_token"] for s in scoring], "s-", label="Standard LM head")
    ax.set_xlabel("registered vocabulary")
    ax.set_ylabel("seconds per token")
    ax.set_title(f"inference scoring time\n{where}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "scoring.png", dpi=100)
    plt.close(fig)
    return None
