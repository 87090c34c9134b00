"""A real S3 endpoint on loopback: moto's server in a thread of the test process, on 127.0.0.1 at a free port.
Every process the tests start (``mhf-dist`` commands, training ranks) reaches it through the environment, as users'
runs reach theirs: ``AWS_ENDPOINT_URL``, dummy credentials, and proxies bypassed for loopback. Nothing leaves
127.0.0.1."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

import pytest

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}


def s3_environment(endpoint: str, credentials: bool = True) -> dict[str, str]:
    """``os.environ`` for a process that reads S3 at ``endpoint``: no profile, credentials file or instance metadata
    of the machine's user, proxies bypassed; without ``credentials`` none at all."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("AWS_") and k.lower() not in ("http_proxy", "https_proxy", "all_proxy")
    }
    env |= {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_EC2_METADATA_DISABLED": "true",  # no credentials: botocore would ask 169.254.169.254
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
    }
    return env | (CREDENTIALS if credentials else {})


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def s3_server(bucket: str) -> Iterator[str]:
    """moto's S3 server on 127.0.0.1, with ``bucket`` created and this process's environment pointed at it (see
    ``s3_environment``); yields the endpoint URL. Skipped, saying so, without moto[server] and s3fs (the dev extra)."""
    server_module = pytest.importorskip("moto.server", reason="needs moto[server] (the dev extra)")
    pytest.importorskip("s3fs", reason="needs s3fs (the s3 extra)")
    import fsspec

    server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    with pytest.MonkeyPatch.context() as mp:
        for k in [k for k in os.environ if k.startswith("AWS_")]:
            mp.delenv(k)
        for k, v in s3_environment(endpoint).items():
            mp.setenv(k, v)
        for k in (
            "http_proxy",
            "https_proxy",
            "all_proxy",
            "HTTP_PROXY",
            "HTTPS_PROXY",
            "ALL_PROXY",
        ):
            mp.delenv(k, raising=False)
        fsspec.filesystem("s3", skip_instance_cache=True).mkdir(bucket)
        try:
            yield endpoint
        finally:
            fsspec.filesystem("s3").clear_instance_cache()
            server.stop()


def module_endpoint(bucket: str):
    """A module-scoped fixture (assign it to a name in the test module): the endpoint URL of an S3 server holding
    the empty ``bucket`` (``s3_server``)."""

    @pytest.fixture(scope="module")
    def endpoint() -> Iterator[str]:
        with s3_server(bucket) as url:
            yield url

    return endpoint
