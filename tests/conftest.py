"""Shared fixtures: a real etcd on 127.0.0.1 and worker jobs that always clean up."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic.embedded_etcd import EmbeddedEtcd
from tests.harness import Job

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


@pytest.fixture
def make_job(etcd: EmbeddedEtcd, tmp_path: Path) -> Iterator:
    """Makes Jobs on the session etcd; every process they started is killed at the end."""
    jobs: list[Job] = []

    def make(args: list[str] | None = None, env: dict[str, str] | None = None, **kw) -> Job:
        job = Job(etcd.url, tmp_path / f"job{len(jobs)}", f"test-{os.getpid()}-{next(_job_ids)}",
                  args, env, **kw)
        jobs.append(job)
        return job

    try:
        yield make
    finally:
        for job in jobs:
            job.kill_all()
