"""The DeepSpeed engine: every tp × pp × dp layout trains the same model to the same losses (docs/spec.md §7).

Each run is `mhf-dist train --nproc-per-node N` (torchrun, gloo, fp32) on the same shards, the same
global batch and seed; the first three optimizer steps' losses must agree to 1e-4, and the first step's health
metrics (gradient, parameter and update norms per family and block; bucket, gate and head statistics) to 1e-5.
With document masking, one step of a fixed global batch through each layout's trainer (``helpers.global_batch``) must
also give the numbers of its counted tokens as one batch, to 1e-6.
"""

from __future__ import annotations

import pytest

from helpers.global_batch import (
    hand_numbers,
    masked_step,
    read_rows,
    relative_errors,
    step_numbers,
    uneven_batch,
)
from helpers.ranks import run_ranks
from helpers.runs import run_cli, train_run
from mhf_dist.cli import main
from mhf_dist.vocab.tokenizers import load_tokenizer

STEPS = 3


def health(record: dict) -> dict[str, float]:
    """A record's health metrics (docs/usage.md, "Health metrics"): per family and block, per head."""
    return {
        k: v
        for k, v in record.items()
        if "/" in k and k.split("/")[0] not in ("head_losses", "val_loss")
    }


def assert_same_losses(a, b, what):
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, STEPS + 1))
    for ra, rb in zip(a, b):
        assert abs(ra["loss"] - rb["loss"]) <= 1e-4 * abs(rb["loss"]), (
            what,
            ra["step"],
            ra["loss"],
            rb["loss"],
        )
        for ha, hb in zip(ra["head_losses"], rb["head_losses"]):
            assert abs(ha - hb) <= 1e-4 * abs(hb), (
                what,
                ra["step"],
                ra["head_losses"],
                rb["head_losses"],
            )
    # the health metrics of the first step (the same model and batch), each counted once over the layout's ranks
    first, want = health(a[0]), health(b[0])
    assert set(first) == set(want) and any(k.startswith("grad_norm/") for k in want), (
        what,
        set(first) ^ set(want),
    )
    for key, value in want.items():
        assert abs(first[key] - value) <= 1e-5 * abs(value) + 1e-7, (what, key, first[key], value)
    va, vb = a[-1], b[-1]
    for key in (
        "val_loss",
        "val_ppl",
        "val_ppl_calibrated",
        "val_top1",
        "val_top5",
        "val_temperature",
    ):
        assert abs(va[key] - vb[key]) <= 1e-4 * abs(vb[key]), (what, key, va[key], vb[key])
    for ha, hb in zip(va["val_head_losses"], vb["val_head_losses"], strict=True):
        assert abs(ha - hb) <= 1e-4 * abs(hb), (what, va["val_head_losses"], vb["val_head_losses"])


LAYOUTS = {  # name: (ranks, overrides); dp = ranks / (tp·pp)
    "tp2": (2, ["parallel.tp=2"]),
    "pp2": (2, ["parallel.pp=2"]),
    "dp2-zero1": (2, ["parallel.zero_stage=1"]),
    "dp2-zero3": (2, []),
    "tp2-pp2": (4, ["parallel.tp=2", "parallel.pp=2"]),
    "pp2-dp2": (4, ["parallel.pp=2"]),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data):
    return train_run(tmp_path_factory.mktemp("ref"), data, "single", 1)


@pytest.mark.multirank
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(tmp_path, data, reference, layout):
    nproc, overrides = LAYOUTS[layout]
    records = train_run(tmp_path, data, layout, nproc, *overrides)
    assert_same_losses(records, reference, layout)
    assert records[0]["loss"] > records[-1]["loss"]  # the steps trained


Z_LOSS = "train.z_loss_weight=0.001"


@pytest.fixture(scope="module")
def z_loss_reference(tmp_path_factory, data):
    return train_run(tmp_path_factory.mktemp("ref-z-loss"), data, "single", 1, Z_LOSS)


@pytest.mark.multirank
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_z_loss_layout_matches_single_process(tmp_path, data, z_loss_reference, layout):
    """``train.z_loss_weight``: the layout trains and logs as one process does; ``z_loss`` is the term, ``loss`` the
    cross-entropy, which leaves it out (the sum of the head losses)."""
    nproc, overrides = LAYOUTS[layout]
    records = train_run(tmp_path, data, layout, nproc, *overrides, Z_LOSS)
    assert_same_losses(records, z_loss_reference, f"{layout} z-loss")
    for a, b in zip(records, z_loss_reference):
        assert abs(a["z_loss"] - b["z_loss"]) <= 1e-4 * b["z_loss"], (layout, a["step"], a, b)
        for r in (a, b):
            assert abs(r["loss"] - sum(r["head_losses"])) <= 1e-5 * r["loss"], (layout, r)
    assert records[0]["loss"] > records[-1]["loss"]


@pytest.mark.multirank
def test_standard_pipeline_ties_embedding_and_head(tmp_path, data):
    single = train_run(tmp_path, data, "std", 1, preset="tiny-standard")
    piped = train_run(tmp_path, data, "std-pp2", 2, "parallel.pp=2", preset="tiny-standard")
    assert_same_losses(piped, single, "standard pp=2")


@pytest.mark.multirank
def test_p_inf_loss_term_trains_and_logs_the_same_under_the_pipeline(tmp_path, data):
    """``model.hash.p_inf_loss_weight``: the logged loss is the total, ``p_inf_loss`` its term's mean -log P_inf,
    from either engine."""
    weight = 0.5
    single = train_run(tmp_path, data, "single", 1, f"model.hash.p_inf_loss_weight={weight}")
    piped = train_run(
        tmp_path, data, "pp2", 2, "parallel.pp=2", f"model.hash.p_inf_loss_weight={weight}"
    )
    assert_same_losses(piped, single, "p_inf_loss_weight pp=2")
    for a, b in zip(piped, single):
        assert abs(a["p_inf_loss"] - b["p_inf_loss"]) <= 1e-4 * b["p_inf_loss"], (a["step"], a, b)
        for r in (a, b):
            assert (
                abs(r["loss"] - sum(r["head_losses"]) - weight * r["p_inf_loss"])
                <= 1e-5 * r["loss"]
            ), r
    assert single[0]["p_inf_loss"] > single[-1]["p_inf_loss"]


DOCUMENT_MASKING = "data.document_masking=true"


@pytest.fixture(scope="module")
def masking_references(tmp_path_factory, short_documents):
    """One process on the short documents, with and without masking."""
    root = tmp_path_factory.mktemp("ref-masking")
    return (
        train_run(root, short_documents, "masked", 1, DOCUMENT_MASKING),
        train_run(root, short_documents, "unmasked", 1),
    )


@pytest.mark.multirank
@pytest.mark.parametrize(
    "layout, extra",
    [
        *((name, []) for name in ("tp2", "pp2", "dp2-zero1", "dp2-zero3", "tp2-pp2")),
        ("pp2", ["parallel.activation_checkpoint_interval=1"]),
    ],
    ids=["tp2", "pp2", "dp2-zero1", "dp2-zero3", "tp2-pp2", "pp2-checkpointed"],
)
def test_document_masking_layout_matches_single_process(
    tmp_path, short_documents, masking_references, layout, extra
):
    """``data.document_masking``: the layout (its stages each deriving the documents' mask, again when a block is
    recomputed in backward) trains as one process does, otherwise than without masking."""
    masked, unmasked = masking_references
    nproc, overrides = LAYOUTS[layout]
    records = train_run(
        tmp_path, short_documents, layout, nproc, *overrides, DOCUMENT_MASKING, *extra
    )
    assert_same_losses(records, masked, f"{layout} document masking")
    # masking changes the first step's gradients by far more than assert_same_losses allows (1e-5): near the init
    # the losses move little, the backbone's gradient norm by some 20 %
    a, b = masked[0]["grad_norm/backbone"], unmasked[0]["grad_norm/backbone"]
    assert abs(a - b) > 0.02 * b, (a, b)
    assert records[0]["loss"] > records[-1]["loss"]


# the global batch of 8 rows: name: (ranks, rows per micro-batch, overrides)
GLOBAL_BATCH_LAYOUTS = {
    "one-micro-batch": (1, 8, []),
    "accum4": (1, 2, []),
    "dp2-accum2": (2, 2, []),
    "pp2-accum4": (2, 2, ["parallel.pp=2"]),
}
# fp32 sums of a few hundred terms in another order (measured: 2e-7 at most)
GLOBAL_BATCH_TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def uneven_batch_of_documents(short_documents):
    """8 rows of the short documents, those with the most EOS first (``uneven_batch``)."""
    eos = load_tokenizer(short_documents["tokenizer"]).eos_token_id
    rows = read_rows(sorted(short_documents["shards"].glob("train-*.tar"))[0])
    return uneven_batch(rows, eos)


@pytest.fixture(scope="module")
def one_micro_batch(tmp_path_factory, short_documents, uneven_batch_of_documents):
    """The global batch as one micro-batch of one process: ``(val metrics, StepStats, by_hand)``."""
    _, micro, overrides = GLOBAL_BATCH_LAYOUTS["one-micro-batch"]
    run = tmp_path_factory.mktemp("one-micro-batch") / "run"
    args = (short_documents, uneven_batch_of_documents, micro, overrides)
    return run_ranks(masked_step, 1, run, *args)[0]


@pytest.mark.multirank
@pytest.mark.parametrize("layout", list(GLOBAL_BATCH_LAYOUTS))
def test_document_masking_loss_is_the_mean_over_the_global_batch(
    tmp_path, short_documents, uneven_batch_of_documents, one_micro_batch, layout
):
    """``data.document_masking``: a target whose input is EOS is not counted, and the loss, its gradients, the heads'
    entropies, the bucket counts and the validation loss are those of the global batch's counted tokens as one batch
    (``by_hand``), however the micro-batches and the dp ranks share them: the first micro-batches and rank count
    fewer targets than the others, which a mean of the micro-batches' means would weigh the same."""
    ranks, micro, overrides = GLOBAL_BATCH_LAYOUTS[layout]
    if layout == "one-micro-batch":
        val, stats, want = one_micro_batch
    else:
        args = (short_documents, uneven_batch_of_documents, micro, overrides)
        val, stats, want = run_ranks(masked_step, ranks, tmp_path / "run", *args)[0]
    got, want_numbers = step_numbers(val, stats), hand_numbers(want)
    if "parallel.pp=2" in overrides:
        # DeepSpeed's pipeline engine reports a global norm of its own (0.1 % off one process's, with masking off
        # too); the families' norms, counted once over the stages, measure the gradients
        del got["grad_norm"], want_numbers["grad_norm"]
    errors = relative_errors(got, want_numbers)
    assert max(errors.values()) <= GLOBAL_BATCH_TOLERANCE, (layout, errors)
    whole = step_numbers(*one_micro_batch[:2])
    errors = relative_errors(got, {k: whole[k] for k in got})
    assert max(errors.values()) <= GLOBAL_BATCH_TOLERANCE, (layout, errors)
    # the batch tells the two means apart by far more than the tolerance
    assert abs(want["mean_of_means"] - want["loss"]) > 50 * GLOBAL_BATCH_TOLERANCE * want["loss"]


@pytest.mark.multirank
@pytest.mark.parametrize("nproc, overrides", [(1, []), (2, ["parallel.pp=2"])])
def test_activation_checkpointing_gives_identical_losses(
    tmp_path, data, reference, nproc, overrides
):
    off = (
        reference
        if nproc == 1
        else train_run(
            tmp_path, data, "off", nproc, *overrides, "parallel.activation_checkpoint_interval=0"
        )
    )
    on = train_run(
        tmp_path, data, "on", nproc, *overrides, "parallel.activation_checkpoint_interval=1"
    )
    assert [r["loss"] for r in on] == [r["loss"] for r in off]


@pytest.mark.parametrize(
    "nproc, overrides, message",
    [
        (3, ["parallel.tp=2"], r"world size 3 does not fit parallel.tp=2 × parallel.pp=1"),
        (2, ["parallel.pp=2", "parallel.zero_stage=3"], r"pipeline engine refuses ZeRO-2/3"),
        (
            2,
            ["parallel.pp=2", "parallel.deepspeed_config=zero3_bf16_actckpt", "train.dtype=fp32"],
            r"ZeRO stage 3 with parallel.pp=2.*pipeline engine refuses",
        ),
        (
            2,
            ["parallel.tp=2", "model.hash.num_buckets=255"],
            r"num_buckets=255 is not divisible by parallel.tp=2",
        ),
        (4, ["parallel.pp=4"], r"parallel.pp=4 is more stages than model.n_layers=2"),
    ],
)
def test_invalid_layouts_fail_before_training(tmp_path, nproc, overrides, message):
    args = [
        "train",
        "--preset",
        "tiny-h4b16k",
        "--nproc-per-node",
        str(nproc),
        "--run-dir",
        str(tmp_path / "r"),
    ]
    for o in overrides:
        args += ["--set", o]
    out = run_cli(args, expect_rc=2, timeout=120)
    assert __import__("re").search(message, out), out
    assert not (tmp_path / "r").exists()  # nothing started


def test_real_presets_need_their_data_named(tmp_path, capsys):
    from mhf_dist.config import load_config
    from mhf_dist.train.preflight import preflight

    run = tmp_path / "run"
    assert main(["train", "--preset", "100m-h4b16k", "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert (
        "data.path is not set for preset 100m-h4b16k" in err and "--set data.path=embedded" in err
    )
    assert not run.exists()  # stopped before anything started
    assert (
        main(
            [
                "submit",
                "--preset",
                "3b-h4b16k",
                "--cluster",
                "a100-80g",
                "--nodes",
                "4",
                "--run-dir",
                str(run),
                "--dry-run",
            ]
        )
        == 2
    )
    assert "data.path is not set" in capsys.readouterr().err
    # the demo text, on purpose
    preflight(load_config("100m-h4b16k", overrides=["data.path=embedded"]), 1, "cpu")
    preflight(load_config("tiny-h4b16k"), 1, "cpu")  # tiny presets default to it
