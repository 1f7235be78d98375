"""A real S3-protocol server for the tests: moto on 127.0.0.1, started once per session."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from elastic.cluster.links.ports import free_port
from tests.support.polling import poll_until


def _wait_until_serving(endpoint: str, proc: subprocess.Popen, deadline_s: float) -> bool:
    """True once the moto server answers; False when it exits or the deadline passes."""
    def answers() -> bool:
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()
            return True
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    ended = poll_until(lambda: proc.poll() is not None or answers(), deadline_s)
    return ended and proc.poll() is None


def _start_moto() -> tuple[subprocess.Popen, str]:
    for _ in range(3):  # a free port can be taken between choosing and binding it
        port = free_port()
        endpoint = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if _wait_until_serving(endpoint, proc, 30):
            return proc, endpoint
        proc.kill()
        proc.wait(timeout=10)
    raise RuntimeError("moto server did not start on 127.0.0.1")


@pytest.fixture(scope="session")
def s3_server() -> Iterator[dict[str, Any]]:
    """A moto S3 server on 127.0.0.1 with a bucket; yields fsspec storage_options for it."""
    pytest.importorskip("s3fs", reason="s3fs is in the test extra")
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")  # no credential probing
    proc, endpoint = _start_moto()
    try:
        options = {"key": "testing", "secret": "testing", "endpoint_url": endpoint,
                   "client_kwargs": {"region_name": "us-east-1"}}
        boto3 = pytest.importorskip("boto3")
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                     aws_access_key_id="testing",
                     aws_secret_access_key="testing").create_bucket(Bucket="ckpt-test")
        yield options
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture
def s3_url() -> str:
    """A fresh prefix in the test bucket."""
    return f"s3://ckpt-test/{uuid.uuid4().hex}"
