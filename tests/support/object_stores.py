"""Real object-store servers for the tests, each on 127.0.0.1 and started once per session: an
S3-protocol server (moto) and a Google Cloud Storage emulator (gcp-storage-emulator)."""

from __future__ import annotations

import contextlib
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

BUCKET = "ckpt-test"


def _wait_until_serving(probe_url: str, proc: subprocess.Popen, deadline_s: float) -> bool:
    """True once the server answers ``probe_url``; False when it exits or the deadline passes."""
    def answers() -> bool:
        try:
            urllib.request.urlopen(probe_url, timeout=1).close()
            return True
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    ended = poll_until(lambda: proc.poll() is not None or answers(), deadline_s)
    return ended and proc.poll() is None


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


@contextlib.contextmanager
def _serving(name: str, command: list[str], probe: str) -> Iterator[str]:
    """Runs ``command`` (``{port}`` in it: a free port) until the block ends; yields its
    endpoint once ``probe`` answers there."""
    for _ in range(3):  # a free port can be taken between choosing and binding it
        port = free_port()
        endpoint = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen([arg.format(port=port) for arg in command],
                                stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        if _wait_until_serving(f"{endpoint}{probe}", proc, 30):
            break
        _stop(proc)
    else:
        raise RuntimeError(f"{name} did not start on 127.0.0.1")
    try:
        yield endpoint
    finally:
        _stop(proc)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[dict[str, Any]]:
    """A moto S3 server on 127.0.0.1 with a bucket; yields fsspec storage_options for it."""
    pytest.importorskip("s3fs", reason="s3fs is in the test extra")
    boto3 = pytest.importorskip("boto3")
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")  # no credential probing
    command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", "{port}"]
    with _serving("moto server", command, "/moto-api/") as endpoint:
        options = {"key": "testing", "secret": "testing", "endpoint_url": endpoint,
                   "client_kwargs": {"region_name": "us-east-1"}}
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                     aws_access_key_id="testing",
                     aws_secret_access_key="testing").create_bucket(Bucket=BUCKET)
        yield options


@pytest.fixture
def s3_url() -> str:
    """A fresh prefix in the test bucket."""
    return f"s3://{BUCKET}/{uuid.uuid4().hex}"


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[dict[str, Any]]:
    """A Google Cloud Storage emulator on 127.0.0.1 (objects in memory) with a bucket; yields
    fsspec storage_options for it (anonymous: the emulator checks no credentials)."""
    # Plain GCSFileSystem: the one for zonal buckets first asks a gRPC control plane, which
    # the emulator lacks, for the bucket's type (a 60 s wait per bucket). Read at gcsfs' import.
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    pytest.importorskip("gcsfs", reason="gcsfs is in the test extra")
    pytest.importorskip("gcp_storage_emulator", reason="gcp-storage-emulator is in the test extra")
    command = [sys.executable, "-m", "gcp_storage_emulator", "start", "-H", "127.0.0.1",
               "--port", "{port}", "--in-memory", "--default-bucket", BUCKET, "--quiet"]
    with _serving("GCS emulator", command, "/") as endpoint:
        yield {"endpoint_url": endpoint, "token": "anon", "project": "test"}


@pytest.fixture
def gcs_url() -> str:
    """A fresh prefix in the test bucket."""
    return f"gs://{BUCKET}/{uuid.uuid4().hex}"
