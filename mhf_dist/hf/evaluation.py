"""An exported model's passes over a split of prepared shards: the sums that its perplexity, accuracy and fitted
temperature come from, under ``log P_inf`` (docs/spec.md §5). ``mhf-dist eval`` and ``export-hf
--inference-temperature auto`` read them."""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from mhf_dist.config import ConfigError
from mhf_dist.data.reader import ShardReader
from mhf_dist.model.scoring import calibration_sums
from mhf_dist.vocab.token_list import tokens_fingerprint, vocabulary

ROWS = 2048  # positions per block of the evaluation sums
CHUNK_VALUES = 2**22  # logits per vocabulary chunk of a block


def model_temperature(model: PreTrainedModel) -> float:
    """The ``τ`` the model's logits apply (``config.inference_temperature``; 1 without one)."""
    return float(getattr(model.config, "inference_temperature", 1.0))


class SplitPasses:
    """Passes over ``max_sequences`` sequences of a split (each pass reads them again, in the same order), giving
    ``scoring.calibration_sums`` of the model's ``log P_inf``. Every position counts, an EOS's next token too: the
    exported model reads whole rows unmasked, whatever the run's ``data.document_masking`` (docs/data.md)."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        shards: str | Path,
        split: str,
        max_sequences: int | None,
        batch_size: int,
    ):
        self.model, self.shards, self.split, self.batch_size = model, shards, split, batch_size
        self.fingerprint = tokens_fingerprint(vocabulary(tokenizer))
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
                scores = self.model(batch[:, :-1]).logits.float()
                # log P_inf + const
                scores = scores.flatten(0, 1) / tau if tau != 1 else scores.flatten(0, 1)
                targets = batch[:, 1:].flatten()
                for rows, wanted in zip(scores.split(ROWS), targets.split(ROWS)):
                    chunks = rows.split(max(1, CHUNK_VALUES // rows.shape[0]), dim=1)
                    sums = sums + calibration_sums(chunks, wanted, temperatures).cpu()
        return sums
