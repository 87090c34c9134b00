"""Hash signatures: the MultiHashFormer vocabulary (docs/spec.md §1).

A token is a unique signature of ``H`` hash coordinates, each in ``1..B-1`` (bucket 0 is padding), coordinate ``i``
of token ``w`` being ``mmh3.hash128(w, seed=i) % (B - 1) + 1`` (``bucket_of``); a signature already taken
re-hashes its last coordinate, compared against every registered signature (the authors' code remembers only the
newest token per prefix, a bug not copied). The ``SignatureTable`` is stored, never recomputed:
``signatures.safetensors`` holds the ``int32 [V, H]`` codes, ``signatures.json`` the metadata, the token strings and
a content hash that ``SignatureTable.load`` verifies.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import mmh3
import numpy as np
import torch

from mhf_dist.errors import MhfError
from mhf_dist.vocab.stored_table import ContentHashed, StoredTable, content_hash
from mhf_dist.vocab.token_list import tokens_fingerprint

HASH_VERSION = "mmh3.hash128-unsigned-v1"


class SignatureError(MhfError, ValueError):
    """A signature table cannot be built, loaded or matched."""


STORAGE = StoredTable(
    what="signature table",
    array_file="signatures.safetensors",
    meta_file="signatures.json",
    key="codes",
    error=SignatureError,
    fix="rebuild the table (SignatureTable.build) and save it",
)


def bucket_of(token: str, seed: int, num_buckets: int) -> int:
    """One hash coordinate of ``token``: a bucket in ``1..num_buckets-1`` (docs/spec.md §1)."""
    return mmh3.hash128(token, seed=seed) % (num_buckets - 1) + 1


@dataclass(frozen=True)
class SignatureTable(ContentHashed):
    """``codes[v]`` is the ``H`` bucket coordinates of token id ``v`` (docs/spec.md §1).

    ``seeds[i]`` is the mmh3 seed of coordinate ``i`` (``range(H)`` normally;
    all zeros for the single-ID ablation, whose one hash value is copied into
    every coordinate). ``unique=False`` allows shared signatures (docs/spec.md §6, H1).
    """

    codes: torch.Tensor
    num_buckets: int
    seeds: tuple[int, ...]
    tokens: tuple[str, ...]
    unique: bool = True
    pad_id: int | None = None
    hash_version: str = HASH_VERSION
    content_hash: str = field(default="", compare=False)

    # ------------------------------------------------------------------ build
    @classmethod
    def build(
        cls,
        tokens: Sequence[str],
        num_hashes: int,
        num_buckets: int,
        pad_id: int | None = None,
        unique: bool = True,
        single_id: bool = False,
    ) -> "SignatureTable":
        """Register ``tokens`` (index = token id) in ascending id order.

        ``single_id`` builds the H1 ablation: one hash (seed 0) copied into all
        ``num_hashes`` coordinates; it implies ``unique=False``.
        """
        if num_hashes < 1 or num_buckets < 2:
            raise SignatureError(
                f"need num_hashes >= 1 and num_buckets >= 2, got H={num_hashes}, B={num_buckets}"
            )
        seeds = (0,) * num_hashes if single_id else tuple(range(num_hashes))
        empty = cls(
            codes=torch.zeros(0, num_hashes, dtype=torch.int32),
            num_buckets=num_buckets,
            seeds=seeds,
            tokens=(),
            unique=unique and not single_id,
            pad_id=pad_id,
        )
        return empty.extend(tokens)

    def extend(self, new_tokens: Sequence[str]) -> "SignatureTable":
        """Append ``new_tokens`` (ids ``V, V+1, ...``); existing rows never change (docs/spec.md §1)."""
        new_tokens = list(new_tokens)
        seen = set(self.tokens)
        for tok in new_tokens:
            if tok in seen:
                raise SignatureError(
                    f"token {tok!r} is already registered; extend() takes only new tokens"
                )
            seen.add(tok)
        H, B = self.num_hashes, self.num_buckets
        base = len(self.tokens)
        n_real = (
            sum(1 for v in range(base, base + len(new_tokens)) if v != self.pad_id)
            + self.num_registered
        )
        if self.unique and n_real > (B - 1) ** H:
            raise SignatureError(
                f"{n_real} tokens cannot have unique signatures: capacity is (B-1)^H = {(B - 1) ** H} "
                f"for H={H}, B={B}; use a larger num_buckets or num_hashes"
            )
        # Taken last coordinates per prefix, over every registered signature.
        taken: dict[tuple[int, ...], set[int]] = defaultdict(set)
        if self.unique:
            for row in self.codes.tolist():
                if any(row):
                    taken[tuple(row[:-1])].add(row[-1])
        rows = np.zeros((len(new_tokens), H), dtype=np.int32)
        for j, tok in enumerate(new_tokens):
            if base + j == self.pad_id:
                continue  # the pad token's signature is all zeros
            sig = [bucket_of(tok, s, B) for s in self.seeds]
            if self.unique:
                prefix, used = tuple(sig[:-1]), taken[tuple(sig[:-1])]
                if len(used) >= B - 1:
                    raise SignatureError(
                        f"token {tok!r} (id {base + j}): every last coordinate for its prefix {prefix} is taken; "
                        f"use a larger num_buckets (B={B}) or num_hashes (H={H})"
                    )
                k = 0
                while sig[-1] in used:
                    k += 1
                    sig[-1] = bucket_of(tok, self.seeds[-1] + k, B)
                used.add(sig[-1])
            rows[j] = sig
        return SignatureTable(
            codes=torch.cat([self.codes, torch.from_numpy(rows)]),
            num_buckets=B,
            seeds=self.seeds,
            tokens=self.tokens + tuple(new_tokens),
            unique=self.unique,
            pad_id=self.pad_id,
            hash_version=self.hash_version,
        )

    # ----------------------------------------------------------- properties
    @property
    def num_hashes(self) -> int:
        return self.codes.shape[1]

    @property
    def vocab_size(self) -> int:
        return self.codes.shape[0]

    @property
    def num_registered(self) -> int:
        """Tokens with a real (non-pad) signature."""
        return int((self.codes != 0).any(dim=1).sum())

    @property
    def tokenizer_fingerprint(self) -> str:
        return tokens_fingerprint(self.tokens)

    def registered_mask(self) -> torch.Tensor:
        """``bool [V]``: rows that are scored at inference (the pad row is not)."""
        return (self.codes != 0).any(dim=1)

    def lookup(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` int64 bucket coordinates of ``token_ids``."""
        return self.codes.to(device=token_ids.device, dtype=torch.long)[token_ids]

    def is_extension_of(self, other: "SignatureTable") -> bool:
        """True when this table equals ``other`` on all of ``other``'s rows."""
        return (
            self.hashing_rule() == other.hashing_rule()
            and self.tokens[: other.vocab_size] == other.tokens
            and torch.equal(self.codes[: other.vocab_size], other.codes)
        )

    def hashing_rule(self) -> dict:
        """Everything that decides a token's signature apart from the tokens themselves."""
        return {
            "num_hashes": self.num_hashes,
            "num_buckets": self.num_buckets,
            "seeds": list(self.seeds),
            "unique": self.unique,
            "pad_id": self.pad_id,
            "hash_version": self.hash_version,
        }

    # ------------------------------------------------------------ save/load
    def metadata(self, with_tokens: bool = True) -> dict:
        meta = self.hashing_rule() | {
            "vocab_size": self.vocab_size,
            "tokenizer_fingerprint": self.tokenizer_fingerprint,
        }
        if with_tokens:
            meta["tokens"] = list(self.tokens)
        return meta

    def _compute_hash(self) -> str:
        return content_hash(self.metadata(with_tokens=False), self.codes)

    def save(self, directory: str | os.PathLike) -> Path:
        """Write codes + metadata into ``directory`` (each file replaced atomically)."""
        return STORAGE.save(directory, self.codes, self.metadata(), self.content_hash)

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "SignatureTable":
        def build(codes: torch.Tensor, meta: dict) -> SignatureTable:
            return cls(
                codes=codes,
                num_buckets=meta["num_buckets"],
                seeds=tuple(meta["seeds"]),
                tokens=tuple(meta["tokens"]),
                unique=meta["unique"],
                pad_id=meta["pad_id"],
                hash_version=meta["hash_version"],
            )

        return STORAGE.load(directory, build)
