"""``mhf-dist plot``: runs side by side in one picture, one panel per metric of ``metrics.jsonl`` (the training loss,
validation, learning rate, gradient norm, tokens/s, every ``eval/<task>/<metric>``; with ``health``, the health
metrics), each run one line, against steps or tokens. It reads a run's ``metrics.jsonl`` and ``config.yaml`` only,
so it needs no torch and works on a run still training or one copied from a cluster; matplotlib is the ``plots``
extra. What each panel shows: docs/plots.md."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from mhf_dist.config.loader import read_config_file
from mhf_dist.errors import ConfigError, MhfError
from mhf_dist.storage.run_dir import RunDir
from mhf_dist.train.metrics import read_metrics

if TYPE_CHECKING:
    from matplotlib.figure import Figure

X_AXES = ("steps", "tokens")
COLUMNS = 3  # panels per row
MARKED_POINTS = 40  # a line of at most this many points shows them (sparse validations, short runs)
MATPLOTLIB_MISSING = "mhf-dist plot needs matplotlib: pip install 'mhf-dist[plots]'"
RUN_HINT = "give the --run-dir of `mhf-dist train` or `mhf-dist submit`"


@dataclass(frozen=True)
class Panel:
    """One picture: its title, the ``metrics.jsonl`` keys it draws (the first solid, a second dashed), its y axis."""

    title: str
    keys: tuple[str, ...]
    ylabel: str
    log_y: bool = False


CALIBRATED = "val_p_inf_nll: raw (solid), calibrated (dashed)"
MAIN_PANELS = (
    Panel("loss", ("loss",), "training loss"),
    Panel("val_loss", ("val_loss",), "validation loss"),
    Panel(
        CALIBRATED,
        ("val_p_inf_nll", "val_p_inf_nll_calibrated"),
        "validation NLL per token (nats)",
    ),
    Panel("lr", ("lr",), "learning rate"),
    Panel("grad_norm", ("grad_norm",), "gradient norm", log_y=True),
    Panel("tokens_per_s", ("tokens_per_s",), "tokens/s"),
)
EVAL_KEY = re.compile(r"eval/[^/]+/.+")  # a downstream task's score: eval/<task>/<metric>
FAMILY_GRAD_NORM = re.compile(
    r"grad_norm/(?!block\d+$)[^/]+"
)  # a parameter family's, not a block's
PER_HEAD = (("buckets_used", "share of the buckets used"), ("head_entropy", "entropy (nats)"))


@dataclass
class Run:
    """A run directory's logged records, its name in the legends and its tokens per step."""

    path: Path
    label: str
    records: list[dict] = field(default_factory=list)
    tokens_per_step: int | None = None  # train.global_batch_size × data.seq_len

    def keys(self) -> list[str]:
        """The keys that hold a number in some record, in the order they first appear."""
        return list(dict.fromkeys(k for r in self.records for k, v in r.items() if _number(v)))

    def series(self, key: str, x: str) -> tuple[list[float], list[float]]:
        """``key``'s values and their x (the step, or the tokens trained by it) over the records that hold it."""
        xs, ys = [], []
        for r in self.records:
            if _number(value := r.get(key)) and _number(step := r.get("step")):
                xs.append(step if x == "steps" else step * self.tokens_per_step)
                ys.append(float(value))
        return xs, ys


@dataclass
class Plotted:
    """What ``plot`` drew: the figure (written to the file), its panels' titles in order, and notes for the user."""

    figure: Figure
    titles: list[str]
    notes: list[str]


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _section(cfg: dict, name: str) -> dict:
    value = cfg.get(name)
    return value if isinstance(value, dict) else {}


def load_run(path: str | Path, name: str | None = None) -> Run:
    """The run at ``path``, named ``name`` (default: its directory's name) and its config's preset (else its model
    variant). A run without ``config.yaml`` is an error naming what is missing; one without ``metrics.jsonl`` has
    logged no step yet (no records)."""
    path = Path(path)
    run = RunDir(path)
    if not path.is_dir():
        raise ConfigError(
            f"{path} {'is not a directory' if path.exists() else 'does not exist'}: {RUN_HINT}"
        )
    if not run.config_path.exists():
        missing = [run.config_path.name]
        missing += [] if run.metrics_path.exists() else [run.metrics_path.name]
        raise ConfigError(f"{path} is not a run directory (no {' or '.join(missing)}): {RUN_HINT}")
    cfg = read_config_file(run.config_path)
    kind = cfg.get("preset") or _section(cfg, "model").get("variant") or "custom"
    batch = _section(cfg, "train").get("global_batch_size")
    seq_len = _section(cfg, "data").get("seq_len")
    tokens = batch * seq_len if isinstance(batch, int) and isinstance(seq_len, int) else None
    records = [r for r in read_metrics(path) if isinstance(r, dict)]
    return Run(path, f"{name or path.resolve().name} ({kind})", records, tokens)


def panels(runs: list[Run], health: bool = False) -> list[Panel]:
    """The panels of ``runs``: those of ``MAIN_PANELS`` and one per ``eval/<task>/<metric>`` key that some run
    logged; with ``health``, also one per parameter family's gradient norm, then per head its bucket usage and
    its head entropy."""
    keys = list(dict.fromkeys(k for run in runs for k in run.keys()))
    found = [p for p in MAIN_PANELS if p.keys[0] in keys]
    found += [
        Panel(k, (k,), k.rsplit("/", 1)[1])
        for k in sorted(k for k in keys if EVAL_KEY.fullmatch(k))
    ]
    if health:
        found += [
            Panel(k, (k,), "gradient norm", log_y=True)
            for k in keys
            if FAMILY_GRAD_NORM.fullmatch(k)
        ]
        for kind, ylabel in PER_HEAD:
            heads = {int(m[1]) for k in keys if (m := re.fullmatch(rf"{kind}/head(\d+)", k))}
            found += [Panel(f"{kind}/head{h}", (f"{kind}/head{h}",), ylabel) for h in sorted(heads)]
    return found


def plot(
    paths: list[str | Path],
    out: str | Path,
    *,
    x: str = "steps",
    health: bool = False,
    labels: list[str] | None = None,
) -> Plotted:
    """Draw the runs at ``paths`` side by side (``panels``) against ``x`` (``steps`` or ``tokens``) and write the
    picture to ``out`` (its extension names the format). ``labels`` name the runs in the legends, one per run. A run
    that has logged no step yet is left out with a note; when none has, nothing is written (an error)."""
    figure_class = _figure_class()
    out = Path(out)
    formats = figure_class().canvas.get_supported_filetypes()
    if out.suffix[1:].lower() not in formats:
        raise ConfigError(
            f"--out {out}: name the picture with one of the extensions {', '.join(sorted(formats))} "
            "(e.g. runs.png)"
        )
    if x not in X_AXES:
        raise ConfigError(f"--x {x}: use one of {', '.join(X_AXES)}")
    if labels is not None and len(labels) != len(paths):
        raise ConfigError(
            f"--label given {len(labels)} times for {len(paths)} runs: give one per run, in the runs' order"
        )
    runs = [load_run(p, n) for p, n in zip(paths, labels or [None] * len(paths), strict=True)]
    notes = [
        f"{r.path}: no logged step yet (no records in metrics.jsonl); left out"
        for r in runs
        if not r.records
    ]
    runs = [r for r in runs if r.records]
    if not runs:
        raise MhfError(
            f"nothing to plot: no run has logged a step yet ({'; '.join(notes)}); plot again once a run has"
        )
    if x == "tokens":
        for r in runs:
            if r.tokens_per_step is None:
                raise ConfigError(
                    f"--x tokens: {RunDir(r.path).config_path} has no train.global_batch_size or data.seq_len "
                    "to count the tokens of a step; plot against steps (--x steps)"
                )
    chosen = panels(runs, health)
    if not chosen:
        raise MhfError(
            f"nothing to plot: the records of {', '.join(str(r.path) for r in runs)} hold none of the metrics "
            f"plot draws ({', '.join(p.keys[0] for p in MAIN_PANELS)}, eval/<task>/<metric>)"
        )
    if health and not any(
        p.keys[0].startswith(("grad_norm/", "buckets_used/", "head_entropy/")) for p in chosen
    ):
        notes.append("--health: these runs logged no health metrics (train.health_metrics=false)")
    figure = _draw(figure_class, runs, chosen, x, notes)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100)
    return Plotted(figure, [p.title for p in chosen], notes)


def _figure_class():
    try:
        from matplotlib.figure import Figure  # a figure of its own: no pyplot, no global backend
    except ImportError:
        raise MhfError(MATPLOTLIB_MISSING) from None
    return Figure


def _draw(figure_class, runs: list[Run], chosen: list[Panel], x: str, notes: list[str]) -> Figure:
    """The figure: ``chosen`` in rows of ``COLUMNS``, each run in its own colour on every panel."""
    columns = min(COLUMNS, len(chosen))
    rows = math.ceil(len(chosen) / columns)
    figure = figure_class(
        figsize=(5.2 * columns, 3.6 * rows + 0.4 * len(notes)), layout="constrained"
    )
    # one x range for all: a run's sparse validations line up with its training steps
    axes = figure.subplots(rows, columns, sharex=True, squeeze=False).ravel()
    for ax, panel in zip(axes, chosen):
        lowest = math.inf
        for i, run in enumerate(runs):
            for key, style in zip(panel.keys, ("-", "--")):
                xs, ys = run.series(key, x)
                if not xs:
                    continue
                part = "" if len(panel.keys) == 1 else (" raw" if style == "-" else " calibrated")
                ax.plot(
                    xs,
                    ys,
                    linestyle=style,
                    color=f"C{i % 10}",
                    marker="o" if len(xs) <= MARKED_POINTS else None,
                    markersize=3,
                    label=run.label + part,
                )
                lowest = min([lowest, *(y for y in ys if math.isfinite(y))])
        if panel.log_y and 0 < lowest < math.inf:
            ax.set_yscale("log")
        ax.set_title(panel.title)
        ax.set_xlabel("step" if x == "steps" else "tokens trained")
        ax.xaxis.set_tick_params(labelbottom=True)  # shared, yet each panel says where it is
        ax.set_ylabel(panel.ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    for ax in axes[len(chosen) :]:
        ax.remove()
    if notes:
        figure.suptitle("\n".join(notes), fontsize="small")
    return figure
