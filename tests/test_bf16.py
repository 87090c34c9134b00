"""bf16 on CPU: the precision a bf16 run keeps where bf16's own would not do (fp32 gradient sums, fp32 softmax
statistics), and tensor- and pipeline-parallel bf16 against one process in bf16 and in fp32.

Tolerances are in units of ``U = 2^-8``, bf16's unit roundoff (half of ``torch.finfo(torch.bfloat16).eps``): rounding a
value to bf16 moves it by at most ``U`` times its size. Each test derives its bound next to it.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from helpers.equivalence import step
from helpers.global_batch import (
    hand_numbers,
    masked_step,
    read_rows,
    relative_errors,
    step_numbers,
    uneven_batch,
)
from helpers.ranks import run_ranks
from helpers.runs import checkpoint_size_estimate, train_run
from mhf_dist.backend import engine_config, grad_accum_dtype
from mhf_dist.config import ConfigError, load_config
from mhf_dist.model.fused_head import KernelPolicy
from mhf_dist.model.tables import BucketTables
from mhf_dist.parallel.groups import ParallelGroups
from mhf_dist.parallel.layout import resolve_layout
from mhf_dist.parallel.state_dict import merge_state_dicts
from mhf_dist.parallel.tensor_parallel import apply_tensor_parallel, tp_split_dims
from mhf_dist.vocab.tokenizers import load_tokenizer
from test_tensor_parallel import CHUNKS, make_case

U = 2.0**-8
BF16 = torch.bfloat16


# ---------------------------------------------------------------- DeepSpeed config: fp32 gradient sums

BF16_LAYOUTS = {  # name: (device, world, overrides): every way a bf16 run gets its DeepSpeed config
    "zero3_bf16_actckpt": ("cuda", 8, []),
    "zero1_pp_bf16": ("cuda", 8, ["parallel.pp=2"]),
    "tp2": ("cuda", 8, ["parallel.tp=2"]),
    "zero1": ("cuda", 8, ["parallel.zero_stage=1"]),
    "zero2": ("cuda", 8, ["parallel.zero_stage=2"]),
    "cpu": ("cpu", 2, []),
    "cpu-pp2": ("cpu", 2, ["parallel.pp=2"]),
}


@pytest.mark.parametrize("name", list(BF16_LAYOUTS))
def test_every_bf16_layout_sums_gradients_in_fp32(name):
    """The resolved config of every bf16 layout accumulates gradients over micro-batches and reduces them over dp in
    fp32, and DeepSpeed reads it so (a misspelt key would be ignored silently)."""
    from deepspeed.runtime.config import DeepSpeedConfig, DtypeEnum

    device, world, overrides = BF16_LAYOUTS[name]
    cfg = load_config(
        "tiny-h4b16k",
        overrides=[
            "train.dtype=bf16",
            "train.global_batch_size=16",
            "train.micro_batch_size=1",
            *overrides,
        ],
    )
    ds = engine_config(cfg, resolve_layout(cfg, world), device)
    assert ds["bf16"] == {"enabled": True, "immediate_grad_update": True}
    assert grad_accum_dtype(ds) == "fp32" and ds["communication_data_type"] == "fp32"
    # (parsed as one rank's: DeepSpeed checks the batch sizes against the world size)
    parsed = DeepSpeedConfig(
        {
            k: v
            for k, v in ds.items()
            if k not in ("train_batch_size", "gradient_accumulation_steps")
        }
    )
    assert DtypeEnum(parsed.grad_accum_dtype).value == torch.float32
    assert (
        parsed.communication_data_type == torch.float32
        and parsed.bfloat16_config.immediate_grad_update
    )


def test_bf16_gradient_settings_give_way_to_the_file_and_overrides(tmp_path):
    def resolved(*overrides: str) -> dict:
        cfg = load_config("tiny-h4b16k", overrides=list(overrides))
        return engine_config(cfg, resolve_layout(cfg, 1), "cuda")

    mine = tmp_path / "mine.json"
    mine.write_text(
        json.dumps({"zero_optimization": {"stage": 3}, "data_types": {"grad_accum_dtype": "bf16"}})
    )
    assert (
        grad_accum_dtype(resolved("train.dtype=bf16", f"parallel.deepspeed_config={mine}"))
        == "bf16"
    )
    assert (
        grad_accum_dtype(
            resolved("train.dtype=bf16", "parallel.deepspeed.data_types.grad_accum_dtype=bf16")
        )
        == "bf16"
    )
    fp32 = resolved()  # an fp32 run on the bf16 file: bf16 off, every sum in fp32
    assert not fp32["bf16"]["enabled"] and grad_accum_dtype(fp32) == "fp32"
    # without ZeRO, DeepSpeed 0.19.8 takes bf16 weights with bf16 accumulation only
    with pytest.raises(ConfigError, match="bf16 with ZeRO stage 0.*parallel.zero_stage 1, 2 or 3"):
        resolved("train.dtype=bf16", "parallel.zero_stage=0")
    assert (
        grad_accum_dtype(
            resolved(
                "train.dtype=bf16",
                "parallel.zero_stage=0",
                "parallel.deepspeed.data_types.grad_accum_dtype=bf16",
            )
        )
        == "bf16"
    )


# ---------------------------------------------------------------- the fused head's table gradient, summed in fp32

ROWS, DIM, TOKENS = 16, 8, 512  # 512 chunks of one token each


def head_inputs():
    """bf16 values (so the exact gradient is of the same inputs): hidden states ``c_n = m + small noise``, table rows,
    every token's target row 0, and the retrieval's upstream gradient, the same for every token."""
    gen = torch.Generator().manual_seed(0)
    m = torch.randn(DIM, generator=gen)
    c = (m + 0.1 * torch.randn(TOKENS, DIM, generator=gen)).to(BF16)
    table = (0.3 * torch.randn(ROWS, DIM, generator=gen)).to(BF16)
    # exact in bf16
    g_e = torch.randn(DIM, generator=gen).to(BF16).double().expand(TOKENS, DIM) / TOKENS
    return c, table, torch.zeros(TOKENS, dtype=torch.long), g_e


def fused_table_gradient(retrieve: bool) -> torch.Tensor:
    """The table's gradient from the fused head in bf16, one token per chunk, for the loss ``mean(log Z − target
    logit) (+ Σ ē·g_ē)``."""
    c, table, targets, g_e = head_inputs()
    tables = BucketTables(1, ROWS, DIM).to(BF16)
    with torch.no_grad():
        tables.weight[0] = table
    log_z, target, e_bar, _ = tables.fused_head(
        c,
        tables.per_table(),
        0,
        targets=targets,
        retrieve=retrieve,
        chunk=1,
        kernels=KernelPolicy(),
    )
    loss = (log_z.double() - target.double()).mean()
    if retrieve:
        loss = loss + (e_bar.double() * g_e).sum()
    loss.backward()
    assert tables.weight.grad.dtype == BF16
    return tables.weight.grad[0].double()


def exact_table_gradient(retrieve: bool) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The same gradient in float64 from the plain formulas, the sum ``S`` over tokens of its terms' absolute values
    (module docstring of fused_head: ``(∂L/∂o_nb) c_n + p_nb g_ē,n``) and the largest ``|logit|``."""
    c, table, targets, g_e = head_inputs()
    weight = table.double().requires_grad_()
    o = c.double() @ weight.t()
    loss = (o.logsumexp(-1) - o.gather(1, targets[:, None]).squeeze(1)).mean()
    if retrieve:
        loss = loss + ((o.softmax(-1) @ weight) * g_e).sum()
    (grad,) = torch.autograd.grad(loss, weight)
    with torch.no_grad():
        p, e = o.softmax(-1), weight.abs()
        # |g_Z| p + |g_t| [b = target]
        coeff = p / TOKENS + torch.nn.functional.one_hot(targets, ROWS) / TOKENS
        if (
            retrieve
        ):  # p (|E_b|·|g_ē| + Σ_b' p_b' |E_b'|·|g_ē|): the retrieval's part of ∂L/∂o, term by term
            coeff = coeff + p * (g_e.abs() @ e.t() + (p @ e * g_e.abs()).sum(-1, keepdim=True))
        size = coeff.t() @ c.double().abs() + (p.t() @ g_e.abs() if retrieve else 0)
    return grad, size, o.abs().max().item()


@pytest.mark.parametrize("retrieve", [False, True])
def test_fused_table_gradient_rounds_once_not_once_per_chunk(retrieve):
    """A bf16 head's table gradient summed over 512 chunks equals the exact one within bf16's rounding of the result.

    Error budget, to first order in U (the fp32 statistics' own 2^-24 is negligible): each term of the sum over tokens
    reaches the bf16 gradient through
      - p = exp(o − log Z) of the bf16 logits: o_b rounded (≤ U|o_b|), log Z of rounded logits (≤ U max|o|): 2U max|o|;
      - with retrieval, ē·g_ē and E_b·g_ē: ē is p rounded to bf16 times E, rounded again (2U and p's 2U max|o|),
        E_b·g_ē rounded (U);
      - ∂L/∂o stored in bf16 (U), the target's g_t added to it in bf16 (U);
      - its chunk's ∂L/∂E rounded to bf16 before the fp32 sum (U);
    at most κ = 4·max|o| + 5 times U relative to the term's size. So |Ĝ − G| ≤ U·|G| (the sum rounded into the bf16
    gradient) + κ·U·S, S the sum of the terms' absolute values. With every token targeting row 0 and c_n = m + small
    noise no row's terms cancel without retrieval (S ≤ 1.2 |G|): the bound is a few roundings of the result. (Retrieval
    cancels by design, Σ_b p_b (E_b − ē) = 0, hence S.) Measured: within 0.06 U·S beyond U·|G|, against κ ≈ 11. The
    old sum in bf16 rounded the running sum at every chunk, and a chunk under half its spacing added nothing: off by
    108 U·S without retrieval and 72 U·S with it.
    """
    got = fused_table_gradient(retrieve)
    exact, size, largest_logit = exact_table_gradient(retrieve)
    if not retrieve:
        assert (size <= 1.2 * exact.abs()).all()
    kappa = 4 * largest_logit + 5
    err = (got - exact).abs()
    excess = ((err - U * exact.abs()) / (U * size)).max().item()
    assert excess <= kappa, (
        f"table gradient off by up to {excess:.1f} U·S (+ U·|G|), bound κ = {kappa:.1f}"
    )


# ---------------------------------------------------------------- tensor parallel in bf16

# Error budget of a whole bf16 step against another computation of it: a value reaches the loss or a gradient through
# about R = 140 bf16 roundings (forward ≈ 70: the lookup and gate ≈ 7, each of the 2 blocks ≈ 17 with its two tp
# all-reduces, the final norm, each of the 4 heads ≈ 7 with its mixer; backward as many), each at most U relative and
# independent of the others, so a tensor's error relative to its largest entry grows like √R·U ≈ 12 U (measured: at
# most 12 U against fp32, 8 U between tp = 2 and one process). We allow three times that.
STEP_BUDGET = 3 * 140**0.5 * U  # ≈ 0.14
# The gate's last bias: softmax over heads ignores a shared shift, so its exact gradient is 0 and a computed one holds
# only rounding noise, at most U times the gradients that cancel in it (checked against the largest gradient entry).
ZERO_GRADIENT = "vocab.encoder.scorer.2.bias"


def bf16_step(model, batch) -> dict:
    """``step`` of ``model`` cast to bf16, with the dtypes of its parameters and gradients, and the first head's
    logits on the rows held here with their log-softmax and softmax (the normaliser over every rank's rows)."""
    model.to(BF16)
    out = step(model, batch)
    out["dtypes"] = {p.dtype for p in model.parameters()} | {g.dtype for g in out["grads"].values()}
    with torch.no_grad():
        tables = model.vocab.tables
        logits = tables.logits(model.hidden(batch[:, :-1]).flatten(0, 1), 0)
        out["head"] = (logits, tables.log_softmax(logits), tables.softmax(logits))
    return out


def bf16_tp_worker(rank, world):
    groups = ParallelGroups.create(tp=world)
    results = {}
    for chunk in CHUNKS:
        _, model, batch = make_case("h4", world, chunk)
        apply_tensor_parallel(model, groups.tp_group, groups.tp_rank, groups.tp)
        results[chunk] = bf16_step(model, batch)
    return results


def assert_within_budget(got: torch.Tensor, ref: torch.Tensor, what: str):
    err, scale = (got.double() - ref.double()).abs().max().item(), ref.double().abs().max().item()
    assert err <= STEP_BUDGET * scale, (
        f"{what}: max error {err:.3e} = {err / scale / U:.1f} U x scale {scale:.3e}"
    )


def assert_normalised_in_fp32(
    logits: torch.Tensor, log_p: torch.Tensor, p: torch.Tensor, what: str
):
    """``log p`` and ``p`` of bf16 ``logits`` are the exact values rounded once to bf16: within ``U`` of their size
    (plus the fp32 statistics' own error, under 2^-16 here). A normaliser rounded to bf16 itself adds up to half its
    spacing to every value, ``U·|log Z|``, and the difference is rounded again."""
    exact = logits.double().log_softmax(-1)
    slack = 2.0**-16
    lp_err = ((log_p.double() - exact).abs() - U * exact.abs()).max().item()
    p_err = ((p.double() - exact.exp()).abs() - U * exact.exp()).max().item()
    assert log_p.dtype == p.dtype == BF16
    assert lp_err <= slack, (
        f"{what}: log-softmax off by {lp_err:.2e} beyond U·|log p| (|log Z| ≈ "
        f"{logits.double().logsumexp(-1).abs().max().item():.1f})"
    )
    assert p_err <= slack, f"{what}: softmax off by {p_err:.2e} beyond U·p"


@pytest.mark.multirank
def test_tensor_parallel_bf16_matches_one_process_in_bf16_and_in_fp32():
    """tp = 2 in bf16 (gloo ranks) against one process in bf16 and in fp32, plain and fused decoder: every parameter
    and gradient is bf16, losses, log P_inf and gradients are within the step's error budget of both, and the
    sharded log-softmax and softmax of the model's first head are the exact values rounded once."""
    ranks = run_ranks(bf16_tp_worker, 2)
    for chunk in CHUNKS:
        cfg, model, batch = make_case("h4", 2, chunk)
        fp32 = step(model, batch)
        bf16 = bf16_step(*make_case("h4", 2, chunk)[1:])
        assert bf16["dtypes"] == {BF16} and all(r[chunk]["dtypes"] == {BF16} for r in ranks)
        got = ranks[0][chunk]
        grads = merge_state_dicts([r[chunk]["grads"] for r in ranks], tp_split_dims(cfg, 2))
        largest = max(g.abs().max().item() for g in fp32["grads"].values())
        for name, ref in (("one process in bf16", bf16), ("fp32", fp32)):
            what = f"chunk {chunk}, tp=2 against {name}"
            assert_within_budget(got["loss"], ref["loss"], f"{what}: loss")
            assert_within_budget(got["heads"], ref["heads"], f"{what}: head losses")
            finite = ref["logp"].isfinite()  # (the pad token's log P_inf is -inf)
            assert torch.equal(got["logp"].isfinite(), finite)
            assert_within_budget(got["logp"][finite], ref["logp"][finite], f"{what}: log P_inf")
            assert grads.keys() == ref["grads"].keys()
            for key, g in ref["grads"].items():
                if key == ZERO_GRADIENT:
                    assert (grads[key].double() - g.double()).abs().max() <= U * largest, (
                        f"{what}: {key}"
                    )
                else:
                    assert_within_budget(grads[key], g, f"{what}: grad {key}")
        logits, log_p, p = (
            torch.cat([r[chunk]["head"][i] for r in ranks], dim=-1) for i in range(3)
        )
        assert_normalised_in_fp32(logits, log_p, p, f"chunk {chunk}, tp=2")
        assert_normalised_in_fp32(*bf16["head"], f"chunk {chunk}, one process")


# ---------------------------------------------------------------- the pipeline in bf16

# The mean of fp32 values taken in another order: 2^-24 per addition, far under this for a few dozen values.
FP32_SUM = 2.0**-20


def close(got: float, ref: float, rel: float) -> bool:
    return abs(got - ref) <= rel * abs(ref)


@pytest.mark.multirank
def test_pipeline_bf16_matches_one_process_in_bf16_and_in_fp32(tmp_path, data):
    """pp = 2 in bf16 (ZeRO-1: DeepSpeed's bf16 optimizer, gradients summed in fp32) against one process in bf16
    (ZeRO-3, fp32 gradient partitions) and in fp32: two optimizer steps of four micro-batches, then evaluation.

    Step 1 runs the initial weights. The stages do the same bf16 operations on the same values as one process, so
    their losses agree to the fp32 means' order (FP32_SUM), while fp32's differ (a stage left in fp32 would match
    fp32 instead: 1e-5 off); the gradient norms agree within U (one process rounds the tied tables' summed gradient
    to bf16 once, the pipeline adds the two stages' parts in fp32). The update moves the fp32 master weights by
    lr·g/|g|, and where the runs' masters differ a weight's bf16 copy can round one spacing (2U) apart, so after it
    the runs agree within 2U (measured: 0.6U at most; a gradient summed twice, as when DeepSpeed's bf16 optimizer
    kept its bf16 gradients across micro-batches, was 6U off). Against fp32 the step's error budget applies."""
    bf16 = train_run(tmp_path, data, "bf16", 1, "train.dtype=bf16", steps=2)
    piped = train_run(tmp_path, data, "bf16-pp2", 2, "train.dtype=bf16", "parallel.pp=2", steps=2)
    fp32 = train_run(tmp_path, data, "fp32", 1, steps=2)
    assert (
        [r["step"] for r in piped]
        == [r["step"] for r in bf16]
        == [r["step"] for r in fp32]
        == [1, 2]
    )
    (pp, one, full), (pp2, one2, full2) = zip(piped, bf16, fp32)
    assert close(pp["loss"], one["loss"], FP32_SUM), (pp["loss"], one["loss"])
    assert all(
        close(a, b, FP32_SUM) for a, b in zip(pp["head_losses"], one["head_losses"], strict=True)
    )
    assert not all(
        close(a, b, FP32_SUM) for a, b in zip(one["head_losses"], full["head_losses"])
    ), "not bf16"
    assert close(pp["grad_norm"], one["grad_norm"], U), (pp["grad_norm"], one["grad_norm"])
    for key in ("loss", "grad_norm", "val_loss"):
        assert close(pp2[key], one2[key], 2 * U), (key, pp2[key], one2[key])
    for got, ref in [(pp, full), (one, full), (pp2, full2), (one2, full2)]:
        for key in ("loss", "grad_norm", "val_loss") if ref["step"] == 2 else ("loss", "grad_norm"):
            assert close(got[key], ref[key], STEP_BUDGET), (key, got["step"], got[key], ref[key])
    # the checkpoints these runs saved have the size plan estimates: a pipeline's in bf16 (its layer files' bf16
    # weights, the tied tables on both end stages), ZeRO-3's in bf16 and in fp32 (master weights and moments only),
    # less the small files (RNG states, DeepSpeed's bookkeeping) of at most 128 KiB per rank
    for name, ranks in (("bf16-pp2", 2), ("bf16", 1), ("fp32", 1)):
        estimated, saved = checkpoint_size_estimate(tmp_path / name)
        assert 0 <= saved - estimated < ranks * 128 * 1024, (name, estimated, saved)


# ---------------------------------------------------------------- document masking in bf16


@pytest.mark.multirank
def test_document_masking_in_bf16_counts_the_global_batch_s_tokens(tmp_path, short_documents):
    """``data.document_masking`` in bf16, one process (four micro-batches) and pp = 2: one step of a global batch
    whose micro-batches count different numbers of targets (``helpers.global_batch``). Each micro-batch's sums are
    divided by the global count in fp32 and rounded once, so the step's numbers and the evaluation's stay within the
    step's error budget of the fp32 numbers of the counted tokens as one batch; the bucket counts, integers, are
    those of the targets whose input is not EOS exactly; and the pipeline's losses are one process's, to the fp32
    means' order (the same bf16 operations on the same values)."""
    eos = load_tokenizer(short_documents["tokenizer"]).eos_token_id
    batch = uneven_batch(read_rows(sorted(short_documents["shards"].glob("train-*.tar"))[0]), eos)
    runs = {
        name: run_ranks(
            masked_step, world, tmp_path / name, short_documents, batch, 2, ["train.dtype=bf16", *o]
        )[0]
        for name, world, o in (("one", 1, []), ("pp2", 2, ["parallel.pp=2"]))
    }
    for name, (val, stats, want) in runs.items():
        got, want = step_numbers(val, stats), hand_numbers(want)
        if name == "pp2":  # DeepSpeed's pipeline norm: tests/test_engine.py
            del got["grad_norm"], want["grad_norm"]
        exact = {k for k in want if k.startswith("bucket")}
        errors = relative_errors(got, want)
        assert all(math.isfinite(v) for v in errors.values()), (name, errors)
        assert max(errors[k] for k in exact) <= 1e-12, (name, errors)
        assert max(errors.values()) <= STEP_BUDGET, (name, errors)
        assert stats.loss != runs["one"][2]["loss"], "not bf16"
    one, pp = (step_numbers(*runs[n][:2]) for n in ("one", "pp2"))
    for key in ("loss", "val_loss"):
        assert close(pp[key], one[key], FP32_SUM), (key, pp[key], one[key])
