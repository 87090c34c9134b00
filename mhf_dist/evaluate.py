"""``mhf-dist eval``: perplexity on shards and last-word accuracy, both under ``P_inf`` (SPEC §5).

- Perplexity: ``exp`` of the mean ``-log P_inf`` of every next token over the
  sequences of a shard set's split (the shards must be made with the model's
  tokenizer; the manifest's fingerprint is checked).
- Last-word accuracy (LAMBADA style) over a JSONL file of ``{"text": ...}``:
  the target is the text's last word (with its leading space), and a document
  counts as correct when the greedy continuation of the rest reproduces the
  target's tokens exactly (teacher-forced argmax at every target position,
  which is the same thing). The target's mean ``-log P_inf`` per document is
  reported as well, as lm-evaluation-harness does.

The exported model's logits are ``log P_inf``, so the numbers compare with the
Standard baseline's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from mhf_dist.data.reader import ShardReader
from mhf_dist.token_list import tokens_fingerprint, vocabulary


@torch.no_grad()
def perplexity(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, shards: str | Path, split: str = "val",
               max_sequences: int | None = None, batch_size: int = 8) -> dict:
    with ShardReader(shards, split=split, tokenizer_fingerprint=tokens_fingerprint(vocabulary(tokenizer))) as reader:
        total = min(max_sequences or reader.samples_per_epoch, reader.samples_per_epoch)
        nll, tokens = 0.0, 0
        for start in tqdm(range(0, total, batch_size), desc=f"perplexity ({split})", unit="batch", disable=None):
            batch = reader.next_batch(min(batch_size, total - start)).to(model.device)
            logp = model(batch[:, :-1]).logits
            nll -= logp.gather(-1, batch[:, 1:, None]).sum().item()
            tokens += batch[:, 1:].numel()
    return {"split": split, "sequences": total, "tokens": tokens, "p_inf_nll": nll / tokens,
            "perplexity": math.exp(nll / tokens)}


def split_last_word(text: str) -> tuple[str, str]:
    """``(context, target)``: the target is the last whitespace-separated word with its leading space."""
    context, _, word = text.rstrip().rpartition(" ")
    if not context or not word:
        raise ValueError(f"cannot split {text[:60]!r} into a context and a last word")
    return context, " " + word


@torch.no_grad()
def last_word_accuracy(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, jsonl: str | Path) -> dict:
    lines = [line for line in Path(jsonl).read_text().splitlines() if line.strip()]
    correct, target_nll = 0, 0.0
    for line in tqdm(lines, desc="last word", unit="doc", disable=None):
        context, target = split_last_word(json.loads(line)["text"])
        ctx = tokenizer(context, add_special_tokens=False).input_ids
        tgt = tokenizer(target, add_special_tokens=False).input_ids
        ids = torch.tensor([ctx + tgt], device=model.device)
        logp = model(ids[:, :-1]).logits[0, len(ctx) - 1:]
        wanted = ids[0, len(ctx):]
        correct += bool((logp.argmax(-1) == wanted).all())
        target_nll -= logp.gather(-1, wanted[:, None]).sum().item()
    return {"documents": len(lines), "accuracy": correct / len(lines), "target_p_inf_nll": target_nll / len(lines)}
