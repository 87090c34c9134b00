"""Object storage through fsspec (``s3://``, ``gs://``, any scheme it knows), for whatever a run keeps there: the
filesystem of a URL, and what its errors mean (``storage_error``): a missing package, missing credentials, an
unreachable endpoint, a refused access, a bucket that does not exist. No numpy, torch or WebDataset here: the
command line and ``status`` import it."""

from __future__ import annotations

from mhf_dist.errors import MhfError


class StorageError(MhfError, OSError):
    """Object storage cannot be used as configured: the message names the URL, the cause and the fix."""


def is_url(source) -> bool:
    """Whether ``source`` names a location by URL (``scheme://...``) rather than a local path."""
    return isinstance(source, str) and "://" in source


def scheme(url: str) -> str:
    return url.split("://", 1)[0]


def storage_error(
    url: str,
    e: Exception,
    error: type[Exception] = StorageError,
    instead: str = "or use a local or shared directory",
    access: str = "read and write access to it",
) -> Exception:
    """What an fsspec error ``e`` on ``url`` means, as an ``error`` naming the URL and the fix (``instead``: the
    alternative to installing a missing package; ``access``: what the credentials need); ``e`` itself when it is
    none of those (a missing object in an existing bucket: FileNotFoundError)."""
    kind = scheme(url)
    if isinstance(e, ImportError):
        extra = "pip install 'mhf-dist[s3]'" if kind in ("s3", "s3a") else "install it"
        return error(
            f"{url}: reading {kind}:// needs a package that is not installed ({e}); {extra} on "
            f"every node, {instead}"
        )
    names = {c.__name__ for c in type(e).__mro__}
    if names & {"NoCredentialsError", "PartialCredentialsError"}:
        return error(
            f"{url}: no credentials for {kind}:// ({e}); set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
            "AWS_PROFILE naming a profile of ~/.aws/credentials (or ~/.aws/config), on every node"
        )
    if names & {"EndpointConnectionError", "ConnectTimeoutError", "ConnectionError"}:
        return error(
            f"{url}: the storage endpoint cannot be reached ({e}); check AWS_ENDPOINT_URL (or "
            "FSSPEC_S3_ENDPOINT_URL) and that the storage service is up and reachable from every node"
        )
    if isinstance(e, PermissionError):
        return error(
            f"{url}: access denied ({e}); the credentials in use (AWS_ACCESS_KEY_ID, AWS_PROFILE or "
            f"~/.aws/credentials) need {access}"
        )
    if isinstance(e, FileNotFoundError) and (bucket := missing_bucket(url)):
        return error(
            f"{url}: bucket {bucket} does not exist at the storage endpoint; check the URL, or "
            "AWS_ENDPOINT_URL if the bucket lies on another service"
        )
    return e


def missing_bucket(url: str) -> str | None:
    """The bucket (first component) of ``url`` when it does not exist; None when it does or cannot be told."""
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(url)
        bucket = path.split("/", 1)[0]
        return None if not bucket or fs.exists(bucket) else bucket
    except Exception:
        return None


def filesystem(url: str, error: type[Exception] = StorageError, **named):
    """fsspec's filesystem for ``url`` and the path in it (no trailing slash), with its errors named."""
    try:
        import fsspec

        fs, path = fsspec.core.url_to_fs(url)
    except Exception as e:
        raise storage_error(url, e, error, **named) from None
    return fs, path.rstrip("/")


def check_bucket(url: str, error: type[Exception] = StorageError, **named) -> None:
    """``url``'s bucket exists and can be reached with the credentials in use; else ``error`` naming why."""
    fs, path = filesystem(url, error, **named)
    try:
        fs.ls(
            path.split("/", 1)[0], refresh=True
        )  # the bucket's top level: it exists, and the credentials
    except Exception as e:
        raise storage_error(url, e, error, **named) from None
