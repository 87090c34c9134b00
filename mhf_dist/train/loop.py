"""The training loop: steps, gradient accumulation, logging, progress.

One optimizer step consumes ``train.global_batch_size`` sequences in
micro-batches of ``train.micro_batch_size``; the loss is the SPEC §5 training
loss (sum over heads of the mean per-head NLL), each head's term logged too.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from mhf_dist.config import RunConfig
from mhf_dist.model import build_model
from mhf_dist.run_dir import RunDir
from mhf_dist.tokenizers import embedded_corpus
from mhf_dist.train.metrics import MetricsLogger
from mhf_dist.train.optim import build_optimizer

BatchSource = Callable[[int], torch.Tensor]  # micro_batch -> LongTensor [micro_batch, seq_len + 1]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def corpus_batches(token_ids: list[int], seq_len: int, seed: int) -> BatchSource:
    """Random ``seq_len + 1`` windows of one packed token stream, from a seeded generator."""
    stream = torch.tensor(token_ids, dtype=torch.long)
    windows = stream[: (len(stream) // (seq_len + 1)) * (seq_len + 1)].view(-1, seq_len + 1)
    gen = torch.Generator().manual_seed(seed)
    return lambda n: windows[torch.randint(len(windows), (n,), generator=gen)]


def train(cfg: RunConfig, run_dir: str | Path) -> list[dict]:
    """Train ``cfg`` in ``run_dir`` on one process; returns the logged records."""
    run = RunDir(run_dir)
    run.save_config(cfg)
    seed_everything(cfg.train.seed)
    device = resolve_device(cfg.train.device)

    tokenizer = run.tokenizer(cfg)
    table = run.signatures(cfg.model.hash, tokenizer) if cfg.model.variant == "mhf" else None
    model = build_model(cfg.model, len(tokenizer), table.codes if table else None).to(device)
    optimizer, scheduler = build_optimizer(model, cfg.optimizer, cfg.train.max_steps)

    docs = tokenizer(list(embedded_corpus()), add_special_tokens=False)["input_ids"]
    batches = corpus_batches([t for d in docs for t in d + [tokenizer.eos_token_id]], cfg.data.seq_len, cfg.train.seed)

    t = cfg.train
    accum = t.global_batch_size // t.micro_batch_size
    tokens_per_step = t.global_batch_size * cfg.data.seq_len
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=t.dtype == "bf16")
    logger, records = MetricsLogger(run.path), []
    # The bar is for terminals; every log interval also prints a plain line (CI logs, batch jobs).
    progress = tqdm(range(t.max_steps), desc="train", unit="step", dynamic_ncols=True, disable=None)
    for step in progress:
        start = time.perf_counter()
        loss_sum, head_sum = 0.0, 0.0
        for _ in range(accum):
            batch = batches(t.micro_batch_size).to(device)
            with autocast:
                out = model(batch[:, :-1], batch[:, 1:])
            (out.loss / accum).backward()
            loss_sum += out.loss.item() / accum
            head_sum = head_sum + out.head_losses.detach() / accum
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optimizer.grad_clip or float("inf"))
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - start
        if step == 0 or (step + 1) % t.log_interval == 0 or step + 1 == t.max_steps:
            record = {
                "loss": loss_sum,
                "head_losses": head_sum.tolist(),
                "lr": lr,
                "grad_norm": grad_norm.item(),
                "tokens_per_s": tokens_per_step / elapsed,
            }
            logger.log(step + 1, record)
            records.append({"step": step + 1, **record})
            tqdm.write(f"step {step + 1:>6} | loss {loss_sum:.4f} | lr {lr:.2e} | {record['tokens_per_s']:.0f} tokens/s")
    logger.close()
    return records

