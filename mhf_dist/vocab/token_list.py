"""A tokenizer's vocabulary as an ordered list of token strings, and the fingerprint that identifies it
(docs/spec.md §1).

Signature tables, data shards, Engram compression tables and exports record
the fingerprint of the vocabulary they were made with, so a mismatch is found
before training or scoring. Nothing here needs a tokenizer library.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence


def vocabulary(tokenizer) -> list[str]:
    """Token strings in id order, exactly as the vocabulary stores them (any Hugging Face tokenizer)."""
    return tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))


def tokens_fingerprint(tokens: Sequence[str]) -> str:
    """SHA-256 of the ordered token strings: identifies a tokenizer's vocabulary."""
    return hashlib.sha256(json.dumps(list(tokens), ensure_ascii=False).encode()).hexdigest()
