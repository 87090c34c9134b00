"""An exported model's passes over a split of prepared shards: the sums that its perplexity, accuracy and fitted
temperature come from, under ``log P_inf`` (docs/spec.md §5). ``mhf-dist eval`` and ``export-hf
--inference-temperature auto`` read them. A model trained with ``data.document_masking`` is scored as it trained:
each document of a row read apart, from position 0 (``document_rows``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from mhf_dist.config import ConfigError
from mhf_dist.data.reader import ShardReader
from mhf_dist.model.documents import document_positions, targets_of
from mhf_dist.model.scoring import calibration_sums
from mhf_dist.vocab.token_list import tokens_fingerprint, vocabulary

ROWS = 2048  # positions per block of the evaluation sums
CHUNK_VALUES = 2**22  # logits per vocabulary chunk of a block


def model_temperature(model: PreTrainedModel) -> float:
    """The ``τ`` the model's logits apply (``config.inference_temperature``; 1 without one)."""
    return float(getattr(model.config, "inference_temperature", 1.0))


def model_document_masking(model: PreTrainedModel) -> bool:
    """Whether the model was trained with ``data.document_masking`` (``config.document_masking``, which
    ``export-hf`` writes for such a run; False without one)."""
    return bool(getattr(model.config, "document_masking", False))


def document_rows(
    rows: torch.Tensor, eos_id: int, positions: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The documents of ``rows [B, S + 1]`` each on a row of its own, from position 0, as ``(inputs [D, L],
    targets [D, L])`` batches of about ``positions`` positions: what each token of a block-diagonal causal row sees,
    for a model that reads whole rows causally. Targets are -1 (not counted) where the input is EOS (its next token
    starts another document, as ``targets_of`` says) and past a document's end, where the inputs are EOS padding,
    which no earlier position sees. Documents go longest first, so a batch pads little."""
    inputs, targets = rows[:, :-1].flatten(), targets_of(rows, eos_id).flatten()
    starts = (document_positions(rows[:, :-1], eos_id).flatten() == 0).nonzero().squeeze(1)
    lengths = torch.diff(starts, append=torch.tensor([inputs.numel()], device=starts.device))
    order = sorted(range(len(starts)), key=lambda d: -int(lengths[d]))
    while order:
        longest = int(lengths[order[0]])
        batch, order = order[: max(1, positions // longest)], order[max(1, positions // longest) :]
        ids = inputs.new_full((len(batch), longest), eos_id)
        wanted = targets.new_full((len(batch), longest), -1)
        for row, d in enumerate(batch):
            start, length = int(starts[d]), int(lengths[d])
            ids[row, :length] = inputs[start : start + length]
            wanted[row, :length] = targets[start : start + length]
        yield ids, wanted


class SplitPasses:
    """Passes over ``max_sequences`` sequences of a split (each pass reads them again, in the same order), giving
    ``scoring.calibration_sums`` of the model's ``log P_inf``. ``document_masking`` (None: the model's
    ``config.document_masking``): each document read apart and an EOS's next token not counted, as a run with
    ``data.document_masking`` measures its ``val_*`` metrics; without it a row is one sequence and every position
    counts (docs/data.md)."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        shards: str | Path,
        *,
        split: str,
        max_sequences: int | None,
        batch_size: int,
        document_masking: bool | None = None,
    ):
        self.model, self.shards, self.split, self.batch_size = model, shards, split, batch_size
        self.fingerprint = tokens_fingerprint(vocabulary(tokenizer))
        if document_masking is None:
            document_masking = model_document_masking(model)
        if document_masking and tokenizer.eos_token_id is None:
            raise ConfigError(
                "document masking reads each document apart, ending at the tokenizer's EOS, and this tokenizer "
                "has none: evaluate whole rows (--document-masking off)"
            )
        self.eos = tokenizer.eos_token_id if document_masking else None
        with self._reader() as reader:
            self.sequences = min(
                max_sequences or reader.samples_per_epoch, reader.samples_per_epoch
            )
            self.seq_len = reader.seq_len
        positions = model.config.max_position_embeddings
        if self.seq_len > positions:
            raise ConfigError(
                f"{shards} holds sequences of {self.seq_len} tokens, more than the model's {positions} "
                f"positions (max_position_embeddings): evaluate on shards prepared with --seq-len "
                f"{positions} or less"
            )

    def _reader(self) -> ShardReader:
        return ShardReader(self.shards, split=self.split, tokenizer_fingerprint=self.fingerprint)

    def __call__(self, temperatures: torch.Tensor) -> torch.Tensor:
        tau = model_temperature(self.model)
        sums = 0
        with self._reader() as reader:
            for start in tqdm(
                range(0, self.sequences, self.batch_size),
                desc=f"evaluate ({self.split})",
                unit="batch",
                disable=None,
            ):
                batch = reader.next_batch(min(self.batch_size, self.sequences - start)).to(
                    self.model.device
                )
                for inputs, targets in self._pieces(batch):
                    scores = self.model(inputs).logits.float()
                    # log P_inf + const
                    scores = scores.flatten(0, 1) / tau if tau != 1 else scores.flatten(0, 1)
                    targets = targets.flatten()
                    if self.eos is not None:
                        kept = targets >= 0
                        scores, targets = scores[kept], targets[kept]
                        if not targets.numel():  # documents of an EOS alone: nothing counted
                            continue
                    for rows, wanted in zip(scores.split(ROWS), targets.split(ROWS)):
                        chunks = rows.split(max(1, CHUNK_VALUES // rows.shape[0]), dim=1)
                        sums = sums + calibration_sums(chunks, wanted, temperatures).cpu()
        return sums

    def _pieces(self, batch: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The model's inputs and their targets for the rows ``batch``: the rows themselves, or with document
        masking their documents apart, in batches of as many positions as the rows hold."""
        if self.eos is None:
            yield batch[:, :-1], batch[:, 1:]
        else:
            yield from document_rows(batch, self.eos, batch[:, :-1].numel())
