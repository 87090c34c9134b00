"""Tokenizer compression for the Engram memory (docs/spec.md §8): an ``old → new`` token-id table.

Token ids whose text, decoded on its own, is equal after DeepSeek's normalisation (``normalize``: NFKC, accents
stripped, lower-cased, whitespace collapsed and stripped) share one compressed id (``compression_key``), so
``" The"``, ``"the"`` and ``"THE"`` share one; a token decoding to partial UTF-8 keeps its own. Positions before a
sequence's start hash as the pad token's compressed id (``CompressionTable.pad_id``; EOS without one). Like the
signature table (``mhf_dist.vocab.signatures``) the ``CompressionTable`` is stored, never recomputed:
``compression.safetensors`` (the ``int32 [V]`` table) and ``compression.json`` (the metadata, every compressed id's
key and a content hash that ``CompressionTable.load`` verifies). The choices: docs/design-engram.md.
"""

from __future__ import annotations

import os
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from mhf_dist.errors import MhfError
from mhf_dist.vocab.stored_table import ContentHashed, StoredTable, content_hash
from mhf_dist.vocab.token_list import tokens_fingerprint, vocabulary

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

NORMALIZATION_VERSION = "nfkc-stripaccents-lower-collapse-v1"
_WHITESPACE = re.compile(r"[ \t\r\n]+")


class CompressionError(MhfError, ValueError):
    """A compression table cannot be built, loaded or matched to its tokenizer."""


STORAGE = StoredTable(
    what="compression table",
    array_file="compression.safetensors",
    meta_file="compression.json",
    key="old_to_new",
    error=CompressionError,
    fix="delete the directory to rebuild it from the run's tokenizer",
)


def normalize(text: str) -> str:
    """docs/spec.md §8's normalisation of one decoded token (see the module docstring)."""
    text = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    text = "".join(c for c in text if unicodedata.category(c) != "Mn").lower()
    text = _WHITESPACE.sub(" ", text)
    return " " if text == " " else text.strip()


def compression_key(decoded: str, token: str) -> str:
    """The text a token is merged on: its normalised decoding, or its vocabulary string when the decoding is a
    partial UTF-8 sequence or normalises to nothing."""
    if "\ufffd" in decoded:
        return token
    return normalize(decoded) or decoded


@dataclass(frozen=True)
class CompressionTable(ContentHashed):
    """``old_to_new[v]`` is the compressed id of token ``v``; ``keys[n]`` the normalised text of compressed id ``n``."""

    old_to_new: torch.Tensor
    keys: tuple[str, ...]
    pad_id: int  # compressed id used before the start of a sequence
    tokenizer_fingerprint: str
    normalization: str = NORMALIZATION_VERSION
    content_hash: str = field(default="", compare=False)

    @classmethod
    def build(cls, tokenizer: PreTrainedTokenizerBase) -> "CompressionTable":
        tokens = vocabulary(tokenizer)
        decoded = tokenizer.batch_decode(
            [[v] for v in range(len(tokens))], skip_special_tokens=False
        )
        new_id: dict[str, int] = {}
        old_to_new = [
            new_id.setdefault(compression_key(text, tok), len(new_id))
            for text, tok in zip(decoded, tokens)
        ]
        pad = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )
        if pad is None:
            raise CompressionError(
                "the tokenizer has neither a pad nor an EOS token: the Engram memory needs one "
                "to hash positions before a sequence's start; add a pad token to the tokenizer"
            )
        return cls(
            old_to_new=torch.tensor(old_to_new, dtype=torch.int32),
            keys=tuple(new_id),
            pad_id=old_to_new[pad],
            tokenizer_fingerprint=tokens_fingerprint(tokens),
        )

    @classmethod
    def identity(cls, vocab_size: int, pad_id: int = 0) -> "CompressionTable":
        """No merging (``old_to_new[v] = v``): for synthetic vocabularies (profiling, memory planning)."""
        return cls(
            old_to_new=torch.arange(vocab_size, dtype=torch.int32),
            keys=tuple(map(str, range(vocab_size))),
            pad_id=pad_id,
            tokenizer_fingerprint="identity",
        )

    @property
    def vocab_size(self) -> int:
        return self.old_to_new.shape[0]

    @property
    def num_ids(self) -> int:
        """V', the compressed vocabulary size."""
        return len(self.keys)

    @property
    def ratio(self) -> float:
        """Compressed over original vocabulary size."""
        return self.num_ids / self.vocab_size

    def summary(self) -> str:
        return (
            f"Engram tokenizer compression: {self.vocab_size:,} -> {self.num_ids:,} ids "
            f"(ratio {self.ratio:.3f}, {1 - self.ratio:.1%} fewer)"
        )

    # ------------------------------------------------------------ save/load
    def metadata(self) -> dict:
        return {
            "vocab_size": self.vocab_size,
            "num_ids": self.num_ids,
            "pad_id": self.pad_id,
            "normalization": self.normalization,
            "tokenizer_fingerprint": self.tokenizer_fingerprint,
            "keys": list(self.keys),
        }

    def _compute_hash(self) -> str:
        return content_hash(self.metadata(), self.old_to_new)

    def save(self, directory: str | os.PathLike) -> Path:
        """Write table + metadata into ``directory`` (each file replaced atomically)."""
        return STORAGE.save(directory, self.old_to_new, self.metadata(), self.content_hash)

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "CompressionTable":
        def build(old_to_new: torch.Tensor, meta: dict) -> CompressionTable:
            return cls(
                old_to_new=old_to_new,
                keys=tuple(meta["keys"]),
                pad_id=meta["pad_id"],
                tokenizer_fingerprint=meta["tokenizer_fingerprint"],
                normalization=meta["normalization"],
            )

        return STORAGE.load(directory, build)
