"""Fixtures for the checkpoint tests: a real S3-protocol server (moto, on 127.0.0.1), a clean
``memory://`` store, and a fault-injecting fsspec filesystem registered as ``faultmem://``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFile, MemoryFileSystem

from tests.polling import poll_until

PAYLOAD_NAME = "state.pt"


@dataclass
class FaultPlan:
    """What the ``faultmem://`` filesystem does to writes of files named ``target``.

    Attributes:
        fail_after_bytes: Raise once this many bytes of the target were written (None: never).
        failures: How many writes fail before the filesystem heals.
        error: Builds the exception to raise.
        gate: If set, every target write blocks until this Event is set.
        started: Set when a target write begins.
        fired: How many failures were injected.
    """

    target: str = PAYLOAD_NAME
    fail_after_bytes: int | None = None
    failures: int = 1
    error: Callable[[], Exception] = lambda: OSError(28, "injected: no space left on device")
    gate: threading.Event | None = None
    started: threading.Event = field(default_factory=threading.Event)
    fired: int = 0


class _FaultyFile(MemoryFile):
    def __init__(self, fs: FaultyMemoryFileSystem, path: str) -> None:
        super().__init__(fs, path)
        self._written = 0
        self._plan = fs.plan if path.rsplit("/", 1)[-1] == fs.plan.target else None

    def write(self, data: Any) -> int:
        plan = self._plan
        if plan is not None:
            plan.started.set()
            if plan.gate is not None:
                assert plan.gate.wait(30), "test never released the gated write"
            n = memoryview(data).nbytes
            limit = plan.fail_after_bytes
            if limit is not None and plan.fired < plan.failures and self._written + n > limit:
                plan.fired += 1
                super().write(memoryview(data)[: max(0, limit - self._written)])
                raise plan.error()
            self._written += n
        return super().write(data)


class FaultyMemoryFileSystem(MemoryFileSystem):
    """An in-memory filesystem (its own store) whose writes fail or stall on request."""

    protocol = "faultmem"
    store: dict[str, Any] = {}
    pseudo_dirs = [""]
    plan = FaultPlan()

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if mode not in {"wb", "w+b"}:
            return super()._open(path, mode, **kwargs)
        path = self._strip_protocol(path)
        f = _FaultyFile(self, path)
        f.commit()
        return f


fsspec.register_implementation("faultmem", FaultyMemoryFileSystem, clobber=True)


@pytest.fixture
def faulty_fs() -> Iterator[type[FaultyMemoryFileSystem]]:
    """The fault-injecting filesystem class, with an empty store and a fresh plan."""
    FaultyMemoryFileSystem.store.clear()
    FaultyMemoryFileSystem.pseudo_dirs[:] = [""]
    FaultyMemoryFileSystem.plan = FaultPlan()
    yield FaultyMemoryFileSystem
    if FaultyMemoryFileSystem.plan.gate is not None:
        FaultyMemoryFileSystem.plan.gate.set()  # never leave a writer thread blocked
    FaultyMemoryFileSystem.store.clear()


@pytest.fixture
def clean_memory_fs() -> Iterator[None]:
    """Clears fsspec's global ``memory://`` store before and after the test."""
    MemoryFileSystem.store.clear()
    MemoryFileSystem.pseudo_dirs[:] = [""]
    yield
    MemoryFileSystem.store.clear()
    MemoryFileSystem.pseudo_dirs[:] = [""]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        port = _free_port()
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


@pytest.fixture
def marker_path(tmp_path: Path) -> Path:
    """A file that a malicious payload would create; tests assert it never appears."""
    path = tmp_path / "pwned"
    assert not path.exists()
    return path

