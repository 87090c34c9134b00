"""The names scripts import from ``mhf_dist`` (docs/models.md, "Python API"): each documented one imports, the
documented list is the package's, old homes still import, and ``import mhf_dist`` loads no torch."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import mhf_dist

USAGE = Path(__file__).resolve().parent.parent / "docs" / "models.md"


def documented_names() -> list[str]:
    text = USAGE.read_text()
    section = text[text.index("\n## Python API\n") :]
    section = section.split("\n## ")[1]  # up to the next section, or the end of the page
    return re.findall(r"^\| `(\w+)` \|", section, re.M)


def test_every_documented_name_imports_from_the_package():
    names = documented_names()
    assert names and sorted(names) == sorted(mhf_dist.PUBLIC)
    namespace: dict = {}
    exec("from mhf_dist import *", namespace)
    for name in names:
        assert getattr(mhf_dist, name) is namespace[name]
        assert getattr(mhf_dist, name).__name__ == name


def test_the_signature_tables_old_home_still_imports():
    from mhf_dist.signatures import SignatureTable

    assert SignatureTable is mhf_dist.SignatureTable
    table = SignatureTable.build(["a", "b", "c"], num_hashes=4, num_buckets=64)
    assert tuple(table.codes.shape) == (3, 4)


def test_the_documented_example_runs():
    example = re.search(
        r"```python\n(.*?)```", USAGE.read_text().split("\n## Python API\n")[1], re.S
    )[1]
    namespace: dict = {}
    exec(example, namespace)
    assert tuple(namespace["table"].codes.shape) == (3, 4)


def test_importing_the_package_loads_no_torch():
    probe = "import sys, mhf_dist; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout
    assert out.split() == ["False", "False"]
