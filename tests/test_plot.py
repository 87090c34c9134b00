"""``mhf-dist plot``: runs side by side, one panel per metric, against steps or tokens, from run directories that are
finished, still written or not runs at all; without torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mhf_dist.cli import main
from mhf_dist.commands.plot import CALIBRATED, MATPLOTLIB_MISSING, plot

MAIN = ["loss", "val_loss", CALIBRATED, "lr", "grad_norm", "tokens_per_s"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _record(step: int, variant: str, health: bool = True, **extra) -> dict:
    """A logged step shaped as training logs it (``mhf_dist.train.loop``, ``mhf_dist.model.health``)."""
    record = {
        "step": step,
        "time": "2026-12-05T00:11:18+00:00",
        "loss": 40.0 / step,
        "head_losses": [10.0 / step] * 4,
        "lr": 1e-3 * step,
        "step_s": 0.5,
        "grad_norm": 100.0 / step,
        "tokens_per_s": 1000.0 + step,
        "mfu": 0.2,
    }
    if health:
        families = ["tables", "backbone", "norms"]
        families += ["gate", "decoder"] if variant == "mhf" else []
        record |= {f"grad_norm/{f}": 1.0 / step for f in families}
        record |= {f"grad_norm/block{b}": 0.5 for b in range(2)}
        record |= {f"param_norm/{f}": 10.0 for f in families}
        heads = range(4) if variant == "mhf" else range(1)
        record |= {f"head_entropy/head{h}": 9.0 - step / 10 for h in heads}
        if variant == "mhf":
            record |= {f"buckets_used/head{h}": 0.06 for h in heads}
            record |= {f"bucket_entropy/head{h}": 5.6 for h in heads}
    return record | extra


def _validation() -> dict:
    return {
        "val_loss": 25.6,
        "val_p_inf_nll": 11.9,
        "val_ppl": 146003.2,
        "val_ppl_calibrated": 511.6,
        "val_temperature": 0.27,
        "val_p_inf_nll_calibrated": 6.2,
        "val_top1": 0.08,
        "val_top5": 0.24,
        "val_head_losses": [6.4] * 4,
    }


def make_run(
    path: Path,
    variant: str = "mhf",
    *,
    preset: str | None = "tiny-h4b16k",
    batch: int = 8,
    steps: tuple[int, ...] = (1, 5, 10),
    health: bool = True,
    extra: dict | None = None,
) -> Path:
    """A run directory as training leaves it: ``config.yaml`` (the fields plot reads, and some it does not) and
    ``metrics.jsonl`` with a validation at the last step."""
    path.mkdir(parents=True)
    config = {
        "preset": preset,
        "model": {"variant": variant, "d_model": 64},
        "data": {"path": "/shared/shards", "seq_len": 64},
        "train": {"global_batch_size": batch, "max_steps": 10},
    }
    (path / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    records = [_record(s, variant, health, **(extra or {})) for s in steps]
    records[-1] |= _validation()
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _labels(figure) -> list[list[str]]:
    return [[line.get_label() for line in ax.lines] for ax in figure.axes]


def test_an_mhf_and_a_standard_run_side_by_side(tmp_path):
    mhf = make_run(tmp_path / "mhf")
    std = make_run(tmp_path / "std", "standard", preset=None)
    out = tmp_path / "out" / "runs.png"
    plotted = plot([mhf, std], out)
    assert out.read_bytes().startswith(PNG_MAGIC)
    assert plotted.titles == MAIN and not plotted.notes
    assert [ax.get_title() for ax in plotted.figure.axes] == MAIN
    # each run one line on each panel, named by its directory and its preset (a custom config: its variant)
    assert _labels(plotted.figure)[0] == ["mhf (tiny-h4b16k)", "std (standard)"]
    assert _labels(plotted.figure)[2] == [
        f"{name} {part}"
        for name in ("mhf (tiny-h4b16k)", "std (standard)")
        for part in ("raw", "calibrated")
    ]
    loss = plotted.figure.axes[0].lines[0]
    assert list(loss.get_xdata()) == [1, 5, 10] and list(loss.get_ydata()) == [40.0, 8.0, 4.0]


def test_downstream_scores_get_a_panel_each_and_none_without_them(tmp_path):
    scores = {"eval/lambada/acc": 0.3, "eval/hellaswag/acc_norm": 0.25}
    with_scores = make_run(tmp_path / "scored", extra=scores)
    plain = make_run(tmp_path / "plain")
    titles = plot([with_scores, plain], tmp_path / "a.png").titles
    assert titles == MAIN + ["eval/hellaswag/acc_norm", "eval/lambada/acc"]
    assert plot([plain], tmp_path / "b.png").titles == MAIN


def test_against_tokens_runs_of_different_batches_line_up(tmp_path, capsys):
    big = make_run(tmp_path / "big", batch=16)
    small = make_run(tmp_path / "small", "standard", preset="tiny-standard", batch=8)
    out = tmp_path / "tokens.png"
    args = ["plot", str(big), str(small), "--out", str(out), "--x", "tokens"]
    assert main([*args, "--label", "wide", "--label", "narrow"]) == 0
    assert "6 panels against tokens" in capsys.readouterr().out
    figure = plot([big, small], out, x="tokens", labels=["wide", "narrow"]).figure
    loss = figure.axes[0]
    assert [list(line.get_xdata()) for line in loss.lines] == [
        [s * 16 * 64 for s in (1, 5, 10)],
        [s * 8 * 64 for s in (1, 5, 10)],
    ]
    assert [line.get_label() for line in loss.lines] == [
        "wide (tiny-h4b16k)",
        "narrow (tiny-standard)",
    ]
    assert loss.get_xlabel() == "tokens trained"


def test_health_adds_family_gradient_norms_and_per_head_panels(tmp_path):
    mhf, std = make_run(tmp_path / "mhf"), make_run(tmp_path / "std", "standard")
    titles = plot([mhf, std], tmp_path / "h.png", health=True).titles
    families = ["tables", "backbone", "norms", "gate", "decoder"]  # as the records list them
    assert titles == [
        *MAIN,
        *(f"grad_norm/{f}" for f in families),  # blocks and param norms are not drawn
        *(f"buckets_used/head{h}" for h in range(4)),
        *(f"head_entropy/head{h}" for h in range(4)),
    ]
    unhealthy = make_run(tmp_path / "off", health=False)
    plotted = plot([unhealthy], tmp_path / "off.png", health=True)
    assert plotted.titles == MAIN and "train.health_metrics=false" in plotted.notes[0]


def test_a_half_written_last_line_is_left_out(tmp_path):
    run = make_run(tmp_path / "running")
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps(_record(15, "mhf"))[:40])  # the trainer is still writing it
    plotted = plot([run], tmp_path / "running.png")
    assert list(plotted.figure.axes[0].lines[0].get_xdata()) == [1, 5, 10]


def test_a_run_without_logged_steps_is_left_out_or_an_error_alone(tmp_path, capsys):
    done = make_run(tmp_path / "done")
    started = tmp_path / "started"
    started.mkdir()
    (started / "config.yaml").write_text(
        "preset: tiny-h4b16k\n"
    )  # its first step is not logged yet
    out = tmp_path / "p.png"
    assert main(["plot", str(done), str(started), "--out", str(out)]) == 0
    assert f"note: {started}: no logged step yet" in capsys.readouterr().err
    assert main(["plot", str(started), "--out", str(tmp_path / "q.png")]) == 2
    err = capsys.readouterr().err
    assert "nothing to plot: no run has logged a step yet" in err and str(started) in err
    assert not (tmp_path / "q.png").exists()


@pytest.mark.parametrize(
    "files, missing",
    [
        ((), "no config.yaml or metrics.jsonl"),
        (("metrics.jsonl",), "no config.yaml)"),
    ],
)
def test_a_directory_that_is_not_a_run_is_named_with_what_it_lacks(
    tmp_path, capsys, files, missing
):
    run = make_run(tmp_path / "run")
    other = tmp_path / "other"
    other.mkdir()
    for name in files:
        (other / name).write_text((run / name).read_text())
    assert main(["plot", str(run), str(other), "--out", str(tmp_path / "x.png")]) == 2
    assert f"{other} is not a run directory ({missing}" in capsys.readouterr().err
    assert main(["plot", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x.png")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_labels_one_per_run_and_a_known_picture_format(tmp_path, capsys):
    run = make_run(tmp_path / "run")
    assert (
        main(["plot", str(run), "--out", str(tmp_path / "x.png"), "--label", "a", "--label", "b"])
        == 2
    )
    assert "--label given 2 times for 1 runs" in capsys.readouterr().err
    assert main(["plot", str(run), "--out", str(tmp_path / "x.nope")]) == 2
    assert "--out" in capsys.readouterr().err and not (tmp_path / "x.nope").exists()
    assert main(["plot", str(run), "--out", str(tmp_path / "x.svg")]) == 0


def test_without_matplotlib_the_error_names_the_extra(tmp_path, capsys, monkeypatch):
    run = make_run(tmp_path / "run")
    for module in ("matplotlib", "matplotlib.figure"):
        monkeypatch.setitem(sys.modules, module, None)  # import fails as when it is not installed
    assert main(["plot", str(run), "--out", str(tmp_path / "x.png")]) == 2
    assert MATPLOTLIB_MISSING in capsys.readouterr().err


def test_plot_loads_no_torch(tmp_path):
    run = make_run(tmp_path / "run")
    probe = (
        "import sys\nfrom mhf_dist.cli import main\n"
        f"assert main(['plot', {str(run)!r}, '--health', '--out', {str(tmp_path / 'x.png')!r}]) == 0\n"
        "print(sorted(m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.multirank
def test_trained_runs_plot_with_their_real_metrics(trained, tmp_path, capsys):
    """The keys plot looks for are those training logs: every main panel and the health panels of a real MHF and
    Standard run."""
    out = tmp_path / "trained.png"
    runs = [str(trained["mhf"]), str(trained["standard"])]
    assert main(["plot", *runs, "--out", str(out), "--health", "--x", "tokens"]) == 0, (
        capsys.readouterr().err
    )
    assert out.read_bytes().startswith(PNG_MAGIC)
    plotted = plot(runs, tmp_path / "again.png", health=True)
    assert plotted.titles[: len(MAIN)] == MAIN
    health = plotted.titles[len(MAIN) :]
    assert {
        "grad_norm/tables",
        "grad_norm/backbone",
        "buckets_used/head0",
        "head_entropy/head0",
    } <= set(health)
    assert all(t.startswith(("grad_norm/", "buckets_used/", "head_entropy/")) for t in health)
    drawn = {title: _labels(plotted.figure)[i] for i, title in enumerate(plotted.titles)}
    assert len(drawn["loss"]) == 2 and len(drawn["val_loss"]) == 2  # both runs on each
    assert drawn["buckets_used/head0"] == ["mhf (tiny-h4b16k)"]  # a Standard run has no buckets
