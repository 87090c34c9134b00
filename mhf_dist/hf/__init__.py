"""Hugging Face interchange: the authors' published layout (docs/spec.md §9).

Needs transformers 5: exported configs carry its ``rope_parameters`` key, which
older versions ignore (they load the default RoPE base without a word), and
the config class declares its fields as annotations. So an older transformers
stops the import here.
"""

from __future__ import annotations

import re

import transformers

TRANSFORMERS_MAJOR = 5  # the oldest major version that reads our configs


def check_transformers(version: str) -> None:
    """Raise ImportError unless ``version`` is transformers ``TRANSFORMERS_MAJOR``.0 or newer."""
    major = re.match(r"\d+", version)
    if major is None or int(major.group()) < TRANSFORMERS_MAJOR:
        need = f"transformers>={TRANSFORMERS_MAJOR}.0"
        raise ImportError(
            f"mhf_dist.hf needs {need}, but transformers {version} is installed (older versions "
            "ignore the rope_parameters of exported models and use the default RoPE base); "
            f"upgrade: pip install '{need}'"
        )


check_transformers(transformers.__version__)
