"""Where shards and manifests are read from: local paths, ``pipe:`` commands and ``http(s)`` through WebDataset's
``gopen``, object storage (``s3://``, ``gs://``, any scheme fsspec knows) through fsspec; and prepared directories
uploaded to object storage (``prepare-data --out s3://...``). fsspec's errors are named here, in one place
(``storage_error``)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import webdataset as wds

from mhf_dist import remote
from mhf_dist.data.formats import MANIFEST, DataError
from mhf_dist.remote import is_url

__all__ = [
    "is_url",
    "storage_error",
    "open_url",
    "read_json",
    "check_upload",
    "upload",
    "refuse_pipe",
]


def open_url(url: str):
    """A binary stream of ``url``: object storage (a scheme fsspec knows other than http) through fsspec when it is
    installed, everything else (local paths, ``pipe:``, ``http(s)``) through WebDataset's ``gopen``. A scheme whose
    package is missing (s3fs for ``s3://``, gcsfs for ``gs://``) is an error naming it; so are missing credentials,
    a bucket that does not exist, a refused access and an unreachable endpoint (``storage_error``). A missing object
    in an existing bucket stays a FileNotFoundError, for the caller to name."""
    scheme = url.split("://", 1)[0] if "://" in url else None
    if scheme is None or scheme in ("http", "https") or importlib.util.find_spec("fsspec") is None:
        return wds.gopen(url)
    import fsspec

    if scheme not in fsspec.available_protocols():
        return wds.gopen(url)
    try:
        return fsspec.open(url, "rb").open()
    except Exception as e:
        raise storage_error(url, e) from None


# what remote's messages say of shards: the alternative to installing a package, the access the credentials need
_NAMED = {
    "instead": "or copy the shards to a local or shared directory",
    "access": "read access to it, and write access to prepare data into it",
}


def storage_error(url: str, e: Exception) -> Exception:
    """What an fsspec error ``e`` on ``url`` means, as a DataError naming the URL and the fix; ``e`` itself when it is
    none of those (a missing object in an existing bucket: FileNotFoundError)."""
    return remote.storage_error(url, e, DataError, **_NAMED)


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
        if isinstance(named := storage_error(location, e), DataError):  # read after it was opened
            raise named from None
        raise DataError(
            f"manifest {location} cannot be read ({e!r}); re-copy it or prepare the shards again"
        ) from None


def storage(url: str):
    """fsspec's filesystem for ``url`` and the path in it (no trailing slash), with its errors named."""
    return remote.filesystem(url, DataError, **_NAMED)


def check_upload(url: str, overwrite: bool) -> None:
    """Before preparing into ``url`` (object storage): its bucket exists and can be reached, and it holds no
    manifest unless ``overwrite``."""
    remote.check_bucket(url, DataError, **_NAMED)
    fs, path = storage(url)
    try:
        exists = fs.exists(f"{path}/{MANIFEST}")
    except Exception as e:
        raise storage_error(url, e) from None
    if exists and not overwrite:
        raise DataError(
            f"{url} already holds prepared data ({MANIFEST}); pass --overwrite to replace it, or choose "
            "another --out"
        )


def upload(local: Path, url: str, overwrite: bool) -> None:
    """Copy the prepared directory ``local`` to ``url``: with ``overwrite`` what lies under ``url`` is removed first;
    the manifest goes last, so that a reader never finds one whose shards are not all there."""
    check_upload(url, overwrite)
    fs, path = storage(url)
    files = sorted(f for f in local.rglob("*") if f.is_file())
    try:
        if overwrite and fs.exists(path):
            fs.rm(path, recursive=True)
        for f in sorted(files, key=lambda f: f.name == MANIFEST and f.parent == local):
            fs.put_file(str(f), f"{path}/{f.relative_to(local).as_posix()}")
    except Exception as e:
        raise storage_error(url, e) from None


def refuse_pipe(url: str, allow_pipe: bool) -> None:
    """A ``pipe:`` URL runs a shell command: refused unless ``data.allow_pipe`` (``allow_pipe``)."""
    if url.startswith("pipe:") and not allow_pipe:
        raise DataError(
            f"{url!r} is a pipe: URL, which runs a shell command; set data.allow_pipe=true if you wrote "
            "it, or give a directory of shards"
        )
