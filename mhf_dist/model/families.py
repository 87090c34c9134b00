"""Parameter families: the parts of a model that ``optimizer.groups`` addresses (docs/spec.md §6), by a parameter's
name in ``LanguageModel``'s naming.

Each parameter belongs to exactly one of ``tables`` (the H bucket tables, or the Standard embedding), ``engram``
(an Engram memory: its tables and gate), ``gate`` (the hash encoder's gate that fuses the H bucket vectors),
``decoder`` (the cascaded decoder) and ``backbone`` (the blocks and the final norm, Engram left out); a norm gain
(RMSNorm, wherever it is) is in ``norms`` as well.
"""

from __future__ import annotations

from typing import get_args

from mhf_dist.config import Family

FAMILIES: tuple[str, ...] = get_args(Family)

_PREFIXES = {
    "vocab.tables.": "tables",
    "vocab.encoder.": "gate",
    "vocab.decoder.": "decoder",
    "backbone.": "backbone",
}


def families(name: str) -> frozenset[str]:
    """The families of the parameter called ``name``."""
    parts = name.split(".")
    primary = (
        "engram"
        if "engram" in parts
        else next((f for p, f in _PREFIXES.items() if name.startswith(p)), None)
    )
    if primary is None:
        raise ValueError(f"parameter {name} belongs to no family of {', '.join(FAMILIES)}")
    return frozenset({primary, *(["norms"] if any(p.endswith("norm") for p in parts[:-1]) else [])})
