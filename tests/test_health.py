"""The health metrics (docs/usage.md, "Health metrics"): one DeepSpeed step measures what plain torch computes from
the same model and batch; the decoder heads' entropies on the fused path and on a bucket shard. Every layout's
metrics against the single process: tests/test_engine.py."""

from __future__ import annotations

import math
import re

import pytest
import torch

from helpers.ranks import run_ranks
from mhf_dist.config import load_config
from mhf_dist.model import build_model
from mhf_dist.model.families import families
from mhf_dist.model.health import HealthLayout
from mhf_dist.train.optim import build_optimizer
from mhf_dist.vocab.signatures import SignatureTable

SEQ, MICRO, ACCUM = 64, 2, 2  # the shared shards hold 64-token samples
BUCKETS = 64
CLIP = 0.5


class FixedBatches:
    """The micro-batches of one global batch, in order."""

    def __init__(self, batch: torch.Tensor):
        self.parts = list(batch.split(MICRO))

    def next_batch(self, micro_batch: int, pin: bool = False) -> torch.Tensor:
        return self.parts.pop(0)


def _measured_step(rank, world, run_dir, data, preset, overrides):
    """One training step with the health metrics on a fixed batch, and the same step in plain torch."""
    from mhf_dist.train.loop import TrainingLoop
    from mhf_dist.train.preemption import StopSignal

    cfg = load_config(
        preset,
        overrides=[
            f"tokenizer.path={data['tokenizer']}",
            f"data.path={data['shards']}",
            f"data.seq_len={SEQ}",
            f"model.hash.num_buckets={BUCKETS}",
            "train.max_steps=4",
            f"train.global_batch_size={MICRO * ACCUM}",
            f"train.micro_batch_size={MICRO}",
            f"optimizer.grad_clip={CLIP}",
            *overrides,
        ],
    )
    loop = TrainingLoop(cfg, StopSignal())
    assert loop.setup(run_dir, "none")
    torch.manual_seed(1)
    batch = torch.randint(1, len(loop.assets.tokenizer), (MICRO * ACCUM, SEQ + 1))
    batch[0, -3:] = -100  # ignored targets count in no statistic
    stats = loop.trainer.train_step(FixedBatches(batch), health=True)
    codes = loop.assets.table.codes if loop.assets.table is not None else None
    model = build_model(
        cfg.model, len(loop.assets.tokenizer), codes, loop.assets.compression, seed=cfg.train.seed
    )
    return stats, plain_step(model, cfg, batch)


def plain_step(model, cfg, batch: torch.Tensor) -> dict[str, float]:
    """The health metrics of one AdamW step of ``model`` on ``batch`` (mean loss over its micro-batches, the
    gradients clipped to ``optimizer.grad_clip``), by their definitions."""
    named = dict(model.named_parameters())
    optimizer, _ = build_optimizer(named.items(), cfg.optimizer, cfg.train.max_steps)
    before = {n: p.detach().clone() for n, p in named.items()}
    vocab, hashed = model.vocab, model.vocab.encoder is not None
    alphas = []
    if hashed:
        vocab.encoder.scorer.register_forward_hook(
            lambda m, a, out: alphas.append(out.detach().softmax(-2))
        )
    entropy = 0
    for part in batch.split(MICRO):
        out = model(part[:, :-1], part[:, 1:], entropy=True)
        (out.loss / ACCUM).backward()
        entropy = entropy + out.head_entropy / ACCUM
    grads = {n: p.grad.clone() for n, p in named.items()}
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optimizer.grad_clip)
    optimizer.step()

    groups: dict[str, list[str]] = {}
    for name in named:
        block = re.match(r"backbone\.layers\.(\d+)\.", name)
        for slot in [*families(name), *([f"block{block[1]}"] if block else [])]:
            groups.setdefault(slot, []).append(name)

    def norm(values: dict[str, torch.Tensor], names: list[str]) -> float:
        return math.sqrt(sum(values[n].double().square().sum().item() for n in names))

    update = {n: p.detach() - before[n] for n, p in named.items()}
    metrics = {}
    for slot, names in groups.items():
        metrics[f"grad_norm/{slot}"] = norm(grads, names)
        metrics[f"param_norm/{slot}"] = norm(before, names)
        metrics[f"update_ratio/{slot}"] = norm(update, names) / norm(before, names)
    heads = range(vocab.decoder.num_heads)
    metrics |= {f"head_entropy/head{i}": entropy[i].item() for i in heads}
    engram = [n for n in named if ".engram." in n and n.endswith("tables.weight")]
    if engram:
        metrics["engram_rows_touched"] = sum((grads[n] != 0).sum().item() for n in engram) / sum(
            grads[n].numel() for n in engram
        )
    if hashed:
        alpha = torch.cat([a.reshape(-1, len(heads)) for a in alphas]).mean(0)
        targets = batch[:, 1:].reshape(-1)
        rows = vocab.codes[targets[targets >= 0]]
        for i in heads:
            counts = torch.bincount(rows[:, i], minlength=vocab.tables.num_rows).double()
            metrics[f"gate_weight/head{i}"] = alpha[i].item()
            metrics[f"buckets_used/head{i}"] = (counts > 0).double().mean().item()
            metrics[f"bucket_entropy/head{i}"] = (
                torch.special.entr(counts / counts.sum()).sum().item()
            )
    return metrics


@pytest.mark.multirank
@pytest.mark.parametrize(
    "preset, overrides",
    [
        ("tiny-h4b16k", []),  # ZeRO-3: the fragments are DeepSpeed's local fp32 partitions
        (
            "tiny-h4b16k+engram",
            ["parallel.zero_stage=1", "model.decoder_chunk_tokens=7"],
        ),  # _hp_mapping; fused heads
        ("tiny-standard", ["parallel.zero_stage=0"]),  # no ZeRO: the parameters themselves
    ],
)
def test_a_measured_step_reports_what_plain_torch_computes(tmp_path, data, preset, overrides):
    stats, want = run_ranks(_measured_step, 1, tmp_path / "run", data, preset, overrides)[0]
    if stats.grad_norm is None:  # no ZeRO: DeepSpeed clips without a norm to undo the clipping with
        want = {k: v for k, v in want.items() if not k.startswith("grad_norm/")}
    else:
        assert stats.grad_norm > CLIP  # clipped: the norms reported are the unclipped ones
    assert set(stats.health) == set(want)
    for key, value in want.items():
        assert stats.health[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def _two_steps(rank, world, run_dir, data, health):
    """The numbers of two training steps on fixed batches, measured (``health``) or with the metrics off."""
    from mhf_dist.train.loop import TrainingLoop
    from mhf_dist.train.preemption import StopSignal

    cfg = load_config(
        "tiny-h4b16k",
        overrides=[
            f"tokenizer.path={data['tokenizer']}",
            f"data.path={data['shards']}",
            f"data.seq_len={SEQ}",
            f"model.hash.num_buckets={BUCKETS}",
            "train.max_steps=4",
            f"train.global_batch_size={MICRO * ACCUM}",
            f"train.micro_batch_size={MICRO}",
            f"train.health_metrics={health}",
        ],
    )
    loop = TrainingLoop(cfg, StopSignal())
    assert loop.setup(run_dir, "none")
    torch.manual_seed(1)
    batches = torch.randint(1, len(loop.assets.tokenizer), (2, MICRO * ACCUM, SEQ + 1))
    steps = [loop.trainer.train_step(FixedBatches(b), health=True) for b in batches]
    return [(s.loss, s.head_losses, s.grad_norm, s.health is not None) for s in steps]


@pytest.mark.multirank
def test_the_metrics_change_no_number_of_the_training(tmp_path, data):
    measured = run_ranks(_two_steps, 1, tmp_path / "on", data, True)[0]
    plain = run_ranks(_two_steps, 1, tmp_path / "off", data, False)[0]
    # bit for bit, the second step's loss included
    assert [m[:3] for m in measured] == [p[:3] for p in plain]
    assert [m[3] for m in measured] == [True, True] and [p[3] for p in plain] == [False, False]


def _entropies(model, x, y):
    return model(x, y, entropy=True).head_entropy


@pytest.mark.parametrize("preset", ["tiny-h4b16k", "tiny-standard"])
def test_the_fused_heads_measure_the_plain_heads_entropy(preset):
    cfg = load_config(
        preset, overrides=[f"model.hash.num_buckets={BUCKETS}", "model.init_std=0.1"]
    ).model
    v = 300
    codes = SignatureTable.build([f"t{i}" for i in range(v)], 4, BUCKETS, pad_id=0).codes
    codes = codes if cfg.variant == "mhf" else None
    plain = build_model(cfg, v, codes)
    fused = build_model(cfg.model_copy(update={"decoder_chunk_tokens": 5}), v, codes)
    x = torch.randint(1, v, (2, 9))
    y = x[:, 1:].clone()
    y[0, -2:] = -100
    want = _entropies(plain, x[:, :-1], y)
    assert torch.allclose(_entropies(fused, x[:, :-1], y), want, rtol=1e-5)
    # by the definition: the mean over kept tokens of -Σ p log p, from each head's log-probabilities
    with torch.no_grad():
        h = plain.hidden(x[:, :-1]).reshape(-1, cfg.d_model)
        log_probs = list(plain.vocab.decoder._heads(h, plain.vocab.tables, normalised=True))
    keep = y.reshape(-1) >= 0
    direct = torch.stack(
        [-(lp.exp() * lp.clamp_min(-1e30)).sum(-1)[keep].mean() for lp in log_probs]
    )
    assert torch.allclose(want, direct, rtol=1e-5)


def test_a_step_the_optimizer_skipped_reports_no_optimizer_metrics():
    """DeepSpeed leaves out a step with an overflow before the torch optimizer runs: nothing was measured there."""
    layout = HealthLayout(
        [
            "vocab.tables.weight",
            "backbone.layers.0.mlp.up_proj.weight",
            "backbone.layers.0.engram.tables.weight",
        ],
        num_heads=2,
        num_buckets=4,
    )
    total = layout.zeros(torch.device("cpu"))
    layout.part(total, "entropy").fill_(1.5)
    layout.part(total, "gate")[:] = torch.tensor([3.0, 1.0, 4.0])
    layout.part(total, "buckets")[:] = torch.tensor([1.0, 1.0, 0.0, 0.0, 4.0, 0.0, 0.0, 0.0])
    metrics = layout.metrics(layout.summary(total).tolist())
    assert metrics == pytest.approx(
        {
            "gate_weight/head0": 0.75,
            "gate_weight/head1": 0.25,
            "head_entropy/head0": 1.5,
            "head_entropy/head1": 1.5,
            "buckets_used/head0": 0.5,
            "buckets_used/head1": 0.25,
            "bucket_entropy/head0": math.log(2),
            "bucket_entropy/head1": 0.0,
        }
    )
