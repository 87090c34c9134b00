"""The cluster files that ship in the package (``mhf_dist/cluster/profiles/``, which the repository's ``cluster/``
links to: the named profiles and the job templates), and the check every value written into a job script passes."""

from __future__ import annotations

import re
from importlib import resources

from mhf_dist.errors import ConfigError

PROFILE_DIR = resources.files("mhf_dist.cluster") / "profiles"  # named profiles and job templates
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def no_control_characters(what: str, value: str) -> str:
    """``value``, refused when it holds a newline or another control character (it would break a job script)."""
    if _CONTROL.search(value):
        raise ConfigError(
            f"{what}={value!r} contains a control character (newline, tab, ...); remove it"
        )
    return value
