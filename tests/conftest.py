"""Shared fixtures: a real etcd on 127.0.0.1, worker jobs that always clean up, an S3 server
and a fault-injecting filesystem."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic.launch.embedded_etcd import EmbeddedEtcd
from tests.support.faulty_fs import faulty_fs  # noqa: F401 (a fixture)
from tests.support.harness import Job
from tests.support.s3_server import s3_server, s3_url  # noqa: F401 (fixtures)

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
_job_ids = itertools.count()


@pytest.fixture(scope="session")
def etcd() -> Iterator[EmbeddedEtcd]:
    """One real etcd for the session (jobs use distinct ids); always stopped."""
    server = EmbeddedEtcd().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def private_etcd() -> Iterator[EmbeddedEtcd]:
    """An etcd of the test's own, for tests that stop or freeze it."""
    server = EmbeddedEtcd().start()
    try:
        yield server
    finally:
        server.stop()


def _jobs(etcd_url: str, tmp_path: Path, prefix: str) -> Iterator:
    """Makes Jobs on ``etcd_url``; every process they started is killed at the end."""
    jobs: list[Job] = []

    def make(args: list[str] | None = None, env: dict[str, str] | None = None, **kw) -> Job:
        job = Job(etcd_url, tmp_path / f"{prefix}{len(jobs)}",
                  f"test-{os.getpid()}-{next(_job_ids)}", args, env, **kw)
        jobs.append(job)
        return job

    try:
        yield make
    finally:
        for job in jobs:
            job.kill_all()


@pytest.fixture
def make_job(etcd: EmbeddedEtcd, tmp_path: Path) -> Iterator:
    """Makes Jobs on the session etcd; every process they started is killed at the end."""
    yield from _jobs(etcd.url, tmp_path, "job")


@pytest.fixture
def make_private_job(private_etcd: EmbeddedEtcd, tmp_path: Path) -> Iterator:
    """Makes Jobs on the test's own etcd (``private_etcd``), for tests that stop or lose it."""
    yield from _jobs(private_etcd.url, tmp_path, "private-job")
