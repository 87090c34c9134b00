"""Offline tokenizers: train a byte-level BPE, load any local one, write Mistral v0.3.

Nothing is downloaded: a tokenizer is a local directory that
``transformers.AutoTokenizer.from_pretrained`` loads (``tokenizer.json`` or a
SentencePiece ``tokenizer.model``), or the name ``mistral-v0.3``, the paper's
32,768-piece vocabulary shipped inside the ``mistral-common`` package (docs/spec.md §6).
A token's string for hashing is ``convert_ids_to_tokens(id)`` (docs/spec.md §1).
"""

from __future__ import annotations

import gzip
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from importlib import resources
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from mhf_dist.errors import MhfError

MISTRAL_V03 = "mistral-v0.3"
_MISTRAL_FILE = "mistral_instruct_tokenizer_240323.model.v3"
EOS, PAD = "<|endoftext|>", "<|pad|>"


class TokenizerError(MhfError, ValueError):
    """A tokenizer cannot be found, written or loaded."""


def embedded_corpus() -> Iterator[str]:
    """Documents of the text shipped with the package (public-domain KJV chapters, one per document)."""
    with resources.files("mhf_dist.data").joinpath("corpus/kjv.txt.gz").open("rb") as raw:
        text = gzip.decompress(raw.read()).decode("utf-8")
    yield from (doc for doc in text.split("\n\n") if doc.strip())


def train_bpe(texts: Iterable[str], vocab_size: int, out_dir: str | os.PathLike) -> Path:
    """Train a byte-level BPE on ``texts`` and save it where ``AutoTokenizer`` loads it."""
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        texts,
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[PAD, EOS],
        show_progress=False,
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token=EOS, pad_token=PAD)
    out = Path(out_dir)
    tok.save_pretrained(str(out))
    return out


def read_text_files(paths: Iterable[str | os.PathLike]) -> Iterator[str]:
    """Lines of plain or gzipped text files, for tokenizer training."""
    for p in paths:
        opener = gzip.open if str(p).endswith(".gz") else open
        with opener(p, "rt", encoding="utf-8") as f:
            yield from f


def write_mistral_v03(out_dir: str | os.PathLike) -> Path:
    """Copy Mistral v0.3's SentencePiece model from ``mistral-common`` into a loadable directory, with the fast
    tokenizer converted from it (``tokenizer.json``): loading that takes a fraction of converting the model again,
    which ``AutoTokenizer`` would do at every load. Files are moved in whole, ``tokenizer.json`` last, so a directory
    that has it is complete (ranks sharing one cache may write it at once)."""
    try:
        source = resources.files("mistral_common").joinpath("data", _MISTRAL_FILE)
    except ModuleNotFoundError as e:
        raise TokenizerError(
            "the Mistral v0.3 tokenizer ships in the optional package mistral-common: "
            "pip install 'mhf-dist[mistral]'"
        ) from e
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out, prefix=".writing-") as tmp:
        with resources.as_file(source) as path:
            shutil.copyfile(path, Path(tmp, "tokenizer.model"))
        AutoTokenizer.from_pretrained(tmp, local_files_only=True).save_pretrained(tmp)
        for name in sorted(os.listdir(tmp), key=lambda name: name == "tokenizer.json"):
            os.replace(Path(tmp, name), out / name)
    return out


def load_tokenizer(
    path: str | os.PathLike, cache_dir: str | os.PathLike | None = None
) -> PreTrainedTokenizerBase:
    """A local tokenizer directory, or ``mistral-v0.3`` (written into ``cache_dir`` first)."""
    if str(path) == MISTRAL_V03:
        cache = Path(cache_dir or Path.home() / ".cache" / "mhf_dist") / "tokenizers" / MISTRAL_V03
        if not (cache / "tokenizer.json").is_file():
            write_mistral_v03(cache)
        path = cache
    if not Path(path).is_dir():
        raise TokenizerError(
            f"tokenizer directory {path} does not exist: train one (mhf-dist tokenizer train), "
            f"write the paper's (mhf-dist tokenizer {MISTRAL_V03} --out DIR) or set tokenizer.path"
        )
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:
        raise TokenizerError(f"cannot load a tokenizer from {path}: {e}") from e
