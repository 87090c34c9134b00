"""`mhf-dist profile`: a 2-configuration, 2-step sweep writes consistent CSV/JSON, TensorBoard and PNG plots; with
data.document_masking the step profiled is the masked one, and its rows say so."""

from __future__ import annotations

import csv
import json
import math
import re
from dataclasses import asdict

import pytest
import torch
from PIL import Image

from helpers.runs import run_cli
from mhf_dist.cli import main
from mhf_dist.config import ConfigError
from mhf_dist.profiling.layouts import check_layouts, parse_layouts
from mhf_dist.profiling.report import table
from mhf_dist.profiling.scoring import RatioSpread
from mhf_dist.profiling.training import (
    DOCUMENT_EOS,
    DOCUMENT_LEN,
    VOCAB,
    TrainingProbe,
    TrainRow,
)

COLUMNS = {
    "size",
    "hash",
    "layout",
    "dtype",
    "seq_len",
    "micro_batch",
    "params",
    "tokens_per_s",
    "step_s",
    "forward_s",
    "backward_s",
    "optimizer_s",
    "comm_s",
    "tflops",
    "peak_tflops_measured",
    "peak_tflops_nominal",
    "mfu",
    "memory_gb",
    "comm_bytes_per_step",
    "document_masking",
}


@pytest.mark.multirank
def test_profile_sweep_outputs(tmp_path):
    out = tmp_path / "profile"
    printed = run_cli(
        [
            "profile",
            "--size",
            "tiny",
            "--hash",
            "standard,h4b16k",
            "--layout",
            "tp=2",
            "--steps",
            "2",
            "--seq-len",
            "64",
            "--cluster",
            "a100-80g",
            "--vocab-sizes",
            "4096,16384",
            "--out",
            str(out),
        ]
    )
    assert "tiny-h4b16k" in printed and "measured peak" in printed
    rows = list(csv.DictReader((out / "profile.csv").open()))
    assert [r["hash"] for r in rows] == ["standard", "h4b16k"] and set(rows[0]) == COLUMNS
    data = json.loads((out / "profile.json").read_text())
    assert len(data["training"]) == 2 and len(data["scoring"]) == 2
    for row in data["training"]:
        assert row["document_masking"] is False
        for key, value in row.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                assert math.isfinite(value) and value > 0, (key, value)
        # MFU is achieved over the peak measured in the same run (CPU ranks share that one machine)
        assert abs(row["mfu"] - row["tflops"] / row["peak_tflops_measured"]) < 1e-9
        assert abs(row["step_s"] - row["forward_s"] - row["backward_s"] - row["optimizer_s"]) < 1e-9
    for s in data["scoring"]:
        assert s["mhf_s_per_token"] > 0 and s["standard_s_per_token"] > 0
        # the median of the rounds' ratios, within their range
        assert (
            s["rounds"] == 5
            and s["ratio_min"] <= s["ratio"] <= s["ratio_max"]
            and s["ratio_se"] > 0
        )
        # tiny-h4b16k: 4 logit and 3 retrieval matmuls over 16,384 × 64 tables, 3 mixers (64 wide) against V × 64
        mixers = 3 * 2 * (2 * 64 * 64 + 64 * 64)
        assert s["flop_ratio"] == (2 * 7 * 16384 * 64 + mixers) / (2 * s["vocab_size"] * 64)
    for png in ("throughput.png", "memory.png", "scoring.png"):
        with Image.open(out / png) as image:
            assert image.format == "PNG" and image.size[0] > 100
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))


def test_ratio_spread():
    # rounds 1, 2, 3: sample standard deviation 1, so the median's standard error is sqrt(pi/2) / sqrt(3)
    spread = RatioSpread.of([3.0, 1.0, 2.0])
    assert (spread.median, spread.min, spread.max) == (2.0, 1.0, 3.0)
    assert math.isclose(spread.se, math.sqrt(math.pi / 2 / 3))
    assert RatioSpread.of([1.7]) == (1.7, 1.7, 1.7, None)


def test_profile_without_matplotlib_writes_its_tables_and_says_why_no_plots(tmp_path, monkeypatch):
    import sys

    from mhf_dist.profiling.plot import PLOTS_MISSING, plots

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not installed: the [plots] extra
    assert plots([], [], tmp_path, "cpu") == PLOTS_MISSING and "mhf-dist[plots]" in PLOTS_MISSING
    assert list(tmp_path.iterdir()) == []


def test_a_layout_that_does_not_fit_is_refused_before_any_rank_starts(
    tmp_path, monkeypatch, capsys
):
    """tp=3 cannot split tiny's tables: one error naming the layout, the configuration, the problem and the layouts
    that fit; no rank started, no output directory."""
    import mhf_dist.cluster.launch as launch

    def no_ranks(*args, **kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(launch, "launch_local", no_ranks)
    out = tmp_path / "profile"
    argv = [
        "profile",
        "--size",
        "tiny",
        "--hash",
        "standard,h4b16k",
        "--steps",
        "1",
        "--out",
        str(out),
    ]
    assert main([*argv, "--layout", "tp=1,tp=3"]) == 2
    err = capsys.readouterr().err
    assert err.count("mhf-dist: ") == 1 and "Traceback" not in err, err
    assert (
        "--layout tp=3 does not fit tiny-standard (no rank was started):\n  model.pad_vocab_to=128 is not a "
        "multiple of parallel.tp=3"
    ) in err, err  # the first configuration: its vocabulary rows
    assert (
        "leave tp=3 out of --layout and use layouts that fit every configuration (of tp=1..8: tp=1,tp=2,tp=4)"
        in err
    ), err
    assert main([*argv, "--layout", "pp=2"]) == 2
    assert (
        "--layout 'pp=2': profile measures tensor-parallel layouts only" in capsys.readouterr().err
    )
    assert not out.exists()


def test_layouts_are_checked_against_tables_heads_stages_and_gpus():
    check_layouts("tiny", ["h4b16k"], [1, 2, 4], [])
    for tps, overrides, gpus, problem in (
        ([3], [], None, "model.hash.num_buckets=16384 is not divisible by parallel.tp=3"),
        (
            [8],
            ["model.hash.num_buckets=256"],
            None,
            "model.n_heads=4 is not divisible by parallel.tp=8",
        ),
        ([1], ["parallel.pp=2"], None, "profile measures tensor parallelism only"),
        ([2], [], 1, "2 ranks on 1 visible GPU: NCCL needs a GPU per rank"),
    ):
        with pytest.raises(ConfigError, match=re.escape(problem)):
            check_layouts("tiny", ["h4b16k"], tps, overrides, gpus)
    check_layouts("tiny", ["h4b16k"], [2], ["train.dist_backend=gloo"], 1)  # gloo ranks share a GPU
    assert parse_layouts("tp=1, tp=2") == [1, 2]
    for text in ("tp=0", "2", "tp=x", "dp=2"):
        with pytest.raises(ConfigError, match="tensor-parallel layouts only"):
            parse_layouts(text)


def probe(*overrides: str) -> TrainingProbe:
    """tiny-h4b16k at tp=1 on the CPU: 2 rows of 161 tokens, 322 in all, so a document of DOCUMENT_LEN ends in the
    second row."""
    return TrainingProbe(
        "tiny",
        "h4b16k",
        1,
        seq_len=160,
        micro=2,
        dtype="fp32",
        device=torch.device("cpu"),
        overrides=list(overrides),
        max_steps=1,
    )


def step_with_targets(probe: TrainingProbe) -> tuple[TrainRow, torch.Tensor]:
    """One timed step of ``probe``; its row and the targets its loss was given."""
    forward, seen = probe.model.forward, []

    def spy(input_ids, targets, *args, **kwargs):
        seen.append(targets)
        return forward(input_ids, targets, *args, **kwargs)

    probe.model.forward = spy
    row = probe.row([probe.step()], peak_measured=1e12, peak_nominal=None)
    assert len(seen) == 1
    return row, seen[0]


def test_document_masking_profiles_the_masked_step():
    """--set data.document_masking=true: the backbone knows the EOS, the batch is documents packed back to back
    (an EOS ends each DOCUMENT_LEN tokens, running on from row to row, and is nowhere else), the loss leaves out each
    EOS's next token, and the row, its JSON and the table say the step was masked."""
    masked = probe("data.document_masking=true")
    assert masked.model.backbone.document_eos == DOCUMENT_EOS == 2 and DOCUMENT_LEN == 300
    batch = masked.batch
    assert batch.shape == (2, 161)
    assert (batch == DOCUMENT_EOS).nonzero().tolist() == [[1, 299 - 161]]
    row, targets = step_with_targets(masked)
    assert targets.shape == (2, 160) and targets[1, 299 - 161] == -1
    assert (targets == -1).sum() == 1 and torch.equal(targets[0], batch[0, 1:])
    assert math.isfinite(row.step_s) and row.step_s > 0
    assert row.document_masking is True and asdict(row)["document_masking"] is True
    text = table([row], [])
    assert "tiny-h4b16k [masked]" in text.splitlines()[1]
    assert (
        "[masked]: data.document_masking, documents of 300 tokens each ending in EOS id 2" in text
    )


def test_without_document_masking_the_profiled_step_is_unchanged():
    """Without the override: no EOS in the backbone, the batch of plain random ids the profile has always drawn, every
    next token a target, and a row and table that name no masking."""
    plain = probe()
    assert plain.model.backbone.document_eos is None
    expected = torch.randint(0, VOCAB, (2, 161), generator=torch.Generator().manual_seed(1))
    assert torch.equal(plain.batch, expected)
    row, targets = step_with_targets(plain)
    assert torch.equal(targets, expected[:, 1:])
    assert row.document_masking is False
    text = table([row], [])
    assert text.splitlines()[1].startswith(f"{'tiny-h4b16k':<25} tp=1 ")
    assert "masked" not in text
