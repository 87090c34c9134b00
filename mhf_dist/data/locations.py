"""Where shards and manifests are read from: local paths, ``pipe:`` commands and ``http(s)`` through WebDataset's
``gopen``, object storage (``s3://``, ``gs://``, any scheme fsspec knows) through fsspec."""

from __future__ import annotations

import importlib.util
import json

import webdataset as wds

from mhf_dist.data.formats import DataError


def open_url(url: str):
    """A binary stream of ``url``: object storage (a scheme fsspec knows other than http) through fsspec when it is
    installed, everything else (local paths, ``pipe:``, ``http(s)``) through WebDataset's ``gopen``. A scheme whose
    package is missing (s3fs for ``s3://``, gcsfs for ``gs://``) is an error naming it."""
    scheme = url.split("://", 1)[0] if "://" in url else None
    if scheme is None or scheme in ("http", "https") or importlib.util.find_spec("fsspec") is None:
        return wds.gopen(url)
    import fsspec

    if scheme not in fsspec.available_protocols():
        return wds.gopen(url)
    try:
        return fsspec.open(url, "rb").open()
    except ImportError as e:
        raise DataError(
            f"{url}: reading {scheme}:// needs a package that is not installed ({e}); install it on "
            "every node, or copy the shards to a local or shared directory"
        ) from None


def is_url(source) -> bool:
    """Whether ``source`` names a location by URL (``scheme://...``) rather than a local path."""
    return isinstance(source, str) and "://" in source


def read_json(location: str) -> dict:
    """The manifest at ``location`` (a path or URL); a missing or unreadable one is a DataError naming the fix."""
    try:
        with open_url(location) as f:
            return json.load(f)
    except DataError:
        raise
    except FileNotFoundError:
        raise DataError(
            f"manifest {location} does not exist: prepare shards with mhf-dist prepare-data "
            "(it writes manifest.json next to them) or point data.path at their directory"
        ) from None
    except Exception as e:
        raise DataError(
            f"manifest {location} cannot be read ({e!r}); re-copy it or prepare the shards again"
        ) from None


def refuse_pipe(url: str, allow_pipe: bool) -> None:
    """A ``pipe:`` URL runs a shell command: refused unless ``data.allow_pipe`` (``allow_pipe``)."""
    if url.startswith("pipe:") and not allow_pipe:
        raise DataError(
            f"{url!r} is a pipe: URL, which runs a shell command; set data.allow_pipe=true if you wrote "
            "it, or give a directory of shards"
        )
