"""``mhf-dist eval``: perplexity on shards and last-word accuracy, both under ``P_inf`` (docs/spec.md §5).

``perplexity``: the mean ``-log P_inf`` of every next token over a split of shards made with the model's tokenizer,
with top-1/top-5 accuracy and the calibrated perplexity of ``P_τ`` (``mhf_dist.model.calibration``) at the model's
own ``inference_temperature`` or at a ``τ`` fitted on another split. ``last_word_accuracy``: LAMBADA style, over a
JSONL file of ``{"text": ...}``. ``P_inf`` is recovered from the exported logits whatever ``τ`` they apply. What is
measured, and how: docs/models.md, "Generation and evaluation".
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from mhf_dist.hf.evaluation import SplitPasses, model_temperature
from mhf_dist.model.calibration import Calibration, evaluate_at, fit_temperature


def _summary(passes: SplitPasses, fit: Calibration) -> dict:
    return {
        "split": passes.split,
        "sequences": passes.sequences,
        "seq_len": passes.seq_len,
        "document_masking": passes.eos is not None,
        "tokens": fit.tokens,
        "p_inf_nll": fit.p_inf_nll,
        "perplexity": fit.perplexity,
    }


@torch.no_grad()
def perplexity(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    shards: str | Path,
    *,
    split: str = "val",
    max_sequences: int | None = None,
    batch_size: int = 8,
    calibrate: bool = False,
    calibration_split: str | None = None,
    document_masking: bool | None = None,
) -> dict:
    """Perplexity, top-1/top-5 and calibrated perplexity of ``split`` (module docstring); ``calibrate``: ``τ``
    fitted on ``calibration_split`` (default: ``split`` itself, which is optimistic); ``document_masking``: each
    document of a row read apart (``SplitPasses``; None: as the model was trained)."""
    read = dict(
        max_sequences=max_sequences, batch_size=batch_size, document_masking=document_masking
    )
    passes = SplitPasses(model, tokenizer, shards, split=split, **read)
    print(
        f"note: evaluating {split} at {passes.seq_len} tokens a sequence (the shards' seq_len; the model has "
        f"{model.config.max_position_embeddings} positions): perplexity depends on the length, so compare models "
        "at one length",
        file=sys.stderr,
    )
    calibration = None
    if not calibrate:
        fit, source = (
            evaluate_at(passes, model_temperature(model)),
            "the model's inference_temperature",
        )
    elif (calibration_split or split) == split:
        fit, source = (
            fit_temperature(passes),
            f"fitted on {split}, the evaluated split itself (optimistic)",
        )
    else:
        fitting = SplitPasses(model, tokenizer, shards, split=calibration_split, **read)
        fitted = fit_temperature(fitting)
        calibration = _summary(fitting, fitted) | {
            "temperature": fitted.temperature,
            "p_inf_nll_calibrated": fitted.p_inf_nll_calibrated,
            "perplexity_calibrated": fitted.perplexity_calibrated,
        }
        fit, source = evaluate_at(passes, fitted.temperature), f"fitted on {calibration_split}"
    results = _summary(passes, fit) | {
        "top1": fit.top1,
        "top5": fit.top5,
        "temperature": fit.temperature,
        "temperature_source": source,
        "p_inf_nll_calibrated": fit.p_inf_nll_calibrated,
        "perplexity_calibrated": fit.perplexity_calibrated,
    }
    return results | ({"calibration": calibration} if calibration else {})


def split_last_word(text: str) -> tuple[str, str]:
    """``(context, target)``: the target is the last whitespace-separated word with its leading space."""
    context, _, word = text.rstrip().rpartition(" ")
    if not context or not word:
        raise ValueError(f"cannot split {text[:60]!r} into a context and a last word")
    return context, " " + word


@torch.no_grad()
def last_word_accuracy(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, jsonl: str | Path
) -> dict:
    lines = [line for line in Path(jsonl).read_text().splitlines() if line.strip()]
    correct, target_nll, tau = 0, 0.0, model_temperature(model)
    for line in tqdm(lines, desc="last word", unit="doc", disable=None):
        context, target = split_last_word(json.loads(line)["text"])
        ctx = tokenizer(context, add_special_tokens=False).input_ids
        tgt = tokenizer(target, add_special_tokens=False).input_ids
        ids = torch.tensor([ctx + tgt], device=model.device)
        # log P_inf
        logp = (model(ids[:, :-1]).logits[0, len(ctx) - 1 :].float() / tau).log_softmax(-1)
        wanted = ids[0, len(ctx) :]
        correct += bool((logp.argmax(-1) == wanted).all())
        target_nll -= logp.gather(-1, wanted[:, None]).sum().item()
    return {
        "documents": len(lines),
        "accuracy": correct / len(lines),
        "target_p_inf_nll": target_nll / len(lines),
    }
