"""A real S3 API server for tests: moto's ``ThreadedMotoServer`` on 127.0.0.1, on a free port.

Clients talk to it over HTTP exactly as to S3 (signing, multipart, conditional writes), including
subprocesses. Use :func:`s3_server` as a context manager (a session-scoped fixture wraps it)::

    with s3_server() as endpoint:          # "http://127.0.0.1:PORT"
        ...

Credentials are not checked by moto; set dummy ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``.
moto accepts a wrong ``ChecksumSHA256`` silently, so integrity tests must rely on our manifest.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

REGISTRY_BUCKET = "nxd-test-adapters"
"""The bucket of the ``s3_endpoint`` / ``reg_uri`` fixtures (``tests/conftest.py``)."""

DUMMY_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


@contextmanager
def s3_server() -> Iterator[str]:
    """Start moto's S3 server on 127.0.0.1 (port chosen by the OS); yield its endpoint URL; stop it."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def make_bucket(endpoint: str, bucket: str) -> None:
    """Create ``bucket`` on the server (tests may import boto3; product code imports it only in storage/s3.py)."""
    import boto3

    boto3.session.Session().client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
