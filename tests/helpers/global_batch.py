"""One global batch of packed documents through a run's trainer with ``data.document_masking``, and the same numbers
by their definitions on the whole batch at once (``by_hand``): the loss leaves out every target whose input is EOS,
and it and its gradients are the mean over the global batch's counted tokens, whatever the micro-batches and ranks
that share them (tests/test_engine.py, tests/test_bf16.py)."""

from __future__ import annotations

import io
import math
import os
import re
import tarfile
from pathlib import Path

import numpy as np
import torch

from helpers.equivalence import INIT_STD
from mhf_dist.config import load_config
from mhf_dist.model import build_model
from mhf_dist.model.decoder import head_entropies
from mhf_dist.model.families import families
from mhf_dist.model.modes import ModelModes

SEQ, ROWS = 64, 8  # the global batch: 8 rows of the test shards' 64-token samples
RICH = 3  # the rows richest in EOS come first: micro-batches and dp ranks count different numbers of targets


def read_rows(shard: Path) -> list[np.ndarray]:
    """The samples of a shard, in order."""
    with tarfile.open(shard) as tar:
        return [np.load(io.BytesIO(tar.extractfile(m).read())) for m in tar.getmembers()]


class FixedBatches:
    """A rank's share of the global batch, in micro-batches of ``micro`` rows."""

    def __init__(self, rows: torch.Tensor, micro: int):
        self.parts = list(rows.split(micro))

    def next_batch(self, micro_batch: int, pin: bool = False) -> torch.Tensor:
        part = self.parts.pop(0)
        assert len(part) == micro_batch
        return part


def uneven_batch(rows: list, eos: int) -> torch.Tensor:
    """``ROWS`` of ``rows`` (``[SEQ + 1]`` token arrays): the ``RICH`` with the most EOS among their inputs, then the
    ones with the fewest, so that the first micro-batches and the first data-parallel rank leave out more targets."""
    ranked = sorted(rows, key=lambda r: -int((r[:-1] == eos).sum()))
    chosen = ranked[:RICH] + ranked[-(ROWS - RICH) :]
    return torch.stack([torch.as_tensor(r, dtype=torch.long) for r in chosen])


def run_config(data: dict, micro: int, *overrides: str):
    return load_config(
        "tiny-h4b16k",
        overrides=[
            f"tokenizer.path={data['tokenizer']}",
            f"data.path={data['shards']}",
            f"data.seq_len={SEQ}",
            "model.hash.num_buckets=64",
            # weights large enough that tokens' losses differ: a mean weighted otherwise shows
            f"model.init_std={INIT_STD}",
            "train.max_steps=4",
            f"train.global_batch_size={ROWS}",
            f"train.micro_batch_size={micro}",
            "data.document_masking=true",
            *overrides,
        ],
    )


def masked_step(rank, world, run_dir, data, batch, micro, overrides):
    """On each of ``world`` ranks (``helpers.ranks.run_ranks``): the run's trainer evaluates its data-parallel share of
    ``batch`` in micro-batches of ``micro`` rows, then trains one step on it with the health metrics. Returns
    ``(val metrics, StepStats)``, and on rank 0 the numbers ``by_hand`` too."""
    from mhf_dist.train.loop import TrainingLoop
    from mhf_dist.train.preemption import StopSignal

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    cfg = run_config(data, micro, *overrides)
    loop = TrainingLoop(cfg, StopSignal())
    assert loop.setup(run_dir, "none")
    groups = loop.job.groups
    share = batch.chunk(groups.dp)[groups.dp_rank]
    val = loop.trainer.evaluate(FixedBatches(share, micro), len(share) // micro)
    stats = loop.trainer.train_step(FixedBatches(share, micro), health=True)
    return val, stats, by_hand(loop, batch) if rank == 0 else None


def by_hand(loop, batch: torch.Tensor) -> dict[str, float]:
    """The step's numbers on ``batch`` as one micro-batch, in fp32 from the initial weights, by their definitions:
    each head's NLL at every position whose input is not EOS, summed and divided by their count (``head_losses``;
    ``loss`` their sum), the gradients of that loss, the heads' entropies, ``P_inf``'s NLL and the buckets of those
    positions' targets; ``mean_of_means``: the loss as a mean of the micro-batches' means of 2 rows would be."""
    cfg, tokenizer = loop.cfg, loop.assets.tokenizer
    eos = tokenizer.eos_token_id
    model = build_model(
        cfg.model,
        len(tokenizer),
        loop.assets.table.codes,
        seed=cfg.train.seed,
        modes=ModelModes(document_eos=eos),
    )
    vocab = model.vocab
    inputs, targets = batch[:, :-1], batch[:, 1:]
    keep = inputs != eos
    h = model.hidden(inputs)
    nll, log_probs, _ = vocab.decoder.nll_and_log_probs(
        h.flatten(0, 1), vocab.tables, vocab.codes[targets.flatten()]
    )
    nll = nll.view(*keep.shape, -1)
    heads = nll[keep].mean(0)
    heads.sum().backward()
    per_part = [n[k].mean(0).sum() for n, k in zip(nll.split(2), keep.split(2))]
    want = {
        "loss": heads.sum().item(),
        "mean_of_means": torch.stack(per_part).mean().item(),
        "head_losses": heads.tolist(),
    }
    with torch.no_grad():
        entropy = head_entropies(log_probs).view(*keep.shape, -1)[keep].mean(0)
        logp = model.log_p_inf(inputs)
        p_inf = -logp.gather(-1, targets[..., None])[..., 0][keep].double().mean()
    want["p_inf_nll"] = p_inf.item()
    groups: dict[str, list[torch.Tensor]] = {}
    for name, p in model.named_parameters():
        block = re.match(r"backbone\.layers\.(\d+)\.", name)
        for slot in [*families(name), *([f"block{block[1]}"] if block else [])]:
            groups.setdefault(slot, []).append(p.grad)
    for slot, grads in groups.items():
        want[f"grad_norm/{slot}"] = math.sqrt(sum(g.double().square().sum().item() for g in grads))
    want["grad_norm"] = math.sqrt(
        sum(p.grad.double().square().sum().item() for p in model.parameters())
    )
    rows = vocab.codes[targets[keep]]
    for i in range(vocab.decoder.num_heads):
        counts = torch.bincount(rows[:, i], minlength=vocab.tables.num_rows).double()
        want[f"head_entropy/head{i}"] = entropy[i].item()
        want[f"buckets_used/head{i}"] = (counts > 0).double().mean().item()
        want[f"bucket_entropy/head{i}"] = torch.special.entr(counts / counts.sum()).sum().item()
    return want


def step_numbers(val: dict, stats) -> dict[str, float | list[float]]:
    """What ``masked_step`` measured: the step's numbers, the health metrics ``by_hand`` computes and the
    evaluation's."""
    got = {"loss": stats.loss, "head_losses": stats.head_losses, "grad_norm": stats.grad_norm}
    got |= {
        k: v for k, v in stats.health.items() if k.startswith(("grad_norm/", "head_", "bucket"))
    }
    return got | {k: val[k] for k in ("val_loss", "val_head_losses", "val_p_inf_nll")}


def hand_numbers(want: dict) -> dict[str, float | list[float]]:
    """``by_hand``'s numbers under ``step_numbers``' names: the evaluation of the initial weights measures the step's
    loss."""
    numbers = {k: v for k, v in want.items() if k not in ("mean_of_means", "p_inf_nll")}
    return numbers | {
        "val_loss": want["loss"],
        "val_head_losses": want["head_losses"],
        "val_p_inf_nll": want["p_inf_nll"],
    }


def relative_errors(got: dict, want: dict) -> dict[str, float]:
    """``|got - want| / |want|`` for each of ``want``'s numbers, the largest over a list's entries (a gradient norm
    that is 0 in exact arithmetic holds rounding noise: measured from 1e-6)."""
    assert set(got) == set(want), set(got) ^ set(want)
    errors = {}
    for key, b in want.items():
        a, b = (got[key], b) if isinstance(b, list) else ([got[key]], [b])
        assert len(a) == len(b), key
        errors[key] = max(abs(x - y) / max(abs(y), 1e-6) for x, y in zip(a, b))
    return errors
