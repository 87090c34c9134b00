"""Dependency floors the code cannot work below are refused loudly at import."""

from __future__ import annotations

import importlib
import sys

import pytest

from mhf_dist.hf import check_transformers


def test_transformers_4_stops_the_import_of_the_hf_package(monkeypatch):
    monkeypatch.setattr("transformers.__version__", "4.57.1")  # the module the import will see
    monkeypatch.delitem(sys.modules, "mhf_dist.hf")
    with pytest.raises(
        ImportError, match=r"needs transformers>=5\.0, but transformers 4\.57\.1 is installed"
    ) as e:
        importlib.import_module("mhf_dist.hf")
    assert "pip install 'transformers>=5.0'" in str(e.value)


@pytest.mark.parametrize("version", ["5.0.0", "5.24.0", "5.1.0.dev0", "10.0.0"])
def test_transformers_5_and_newer_pass(version):
    check_transformers(version)


@pytest.mark.parametrize("version", ["4.51.0", "4.57.6", "0.1", "unknown"])
def test_older_or_unreadable_versions_are_refused(version):
    with pytest.raises(ImportError, match=version):
        check_transformers(version)
