"""Shared fixtures: a real etcd on 127.0.0.1, worker jobs that always clean up, an S3 server
and a fault-injecting filesystem; and the tier of every test (``unit``, ``integration``,
``scenario``), given here so that a new test gets one without asking."""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from elastic.cluster.etcd.client import EtcdClient
from elastic.foundation.errors import EtcdAccessError
from elastic.launch.embedded_etcd import EmbeddedEtcd
from elastic.launch.warm_start import reap_adopted
from tests.support.etcd_cluster import EtcdCluster
from tests.support.faulty_fs import faulty_fs  # noqa: F401 (a fixture)
from tests.support.harness import WORKER, Job, loopback_env
from tests.support.limited_etcd import MAX_TXN_OPS, LimitedEtcd
from tests.support.object_stores import gcs_server, gcs_url, s3_server, s3_url  # noqa: F401
from tests.support.references import References
from tests.support.tls_etcd import JOB_A, JOB_USERS, Pki, SecureEtcd, make_pki, user_env
from tests.support.worker_template import LazyTemplate

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
_job_ids = itertools.count()

# Fixtures that start etcd, a server or worker processes: a test that asks for one of them
# cannot be a unit test.
_INTEGRATION_FIXTURES = frozenset({
    "etcd", "client", "small_txn_etcd", "full_etcd", "private_etcd", "make_job",
    "secure_etcd", "secure_job", "make_private_job", "s3_server", "s3_url", "gcs_server",
    "gcs_url", "faulty_fs", "etcd_cluster", "make_cluster_job"})


def _tier(item: pytest.Item) -> str:
    """A test's tier: ``scenario`` under tests/scenarios/; ``unit`` where its file or the test
    says ``pytest.mark.unit`` (pure logic and in-process parts); otherwise ``integration``
    (real etcd, servers or processes), the safe default for a test that says nothing."""
    if "scenarios" in Path(str(item.path)).relative_to(Path(__file__).parent).parts[:1]:
        return "scenario"
    if item.get_closest_marker("unit") is not None:
        wants = _INTEGRATION_FIXTURES.intersection(getattr(item, "fixturenames", ()))
        if wants:
            raise pytest.UsageError(
                f"{item.nodeid} is marked unit but starts {sorted(wants)}: remove its "
                "pytest.mark.unit (it is then an integration test) or drop the fixture.")
        return "unit"
    return "integration"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks each test with its tier, so that ``-m unit`` / ``integration`` / ``scenario``
    select the tiers of ``make test-unit``, ``test-integration`` and ``test-scenario``."""
    for item in items:
        tier = _tier(item)
        if tier != "unit":
            item.add_marker(getattr(pytest.mark, tier))


@pytest.fixture(scope="session")
def etcd() -> Iterator[EmbeddedEtcd]:
    """One real etcd for the session (jobs use distinct ids); always stopped."""
    server = EmbeddedEtcd().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def client(etcd: EmbeddedEtcd) -> Iterator[EtcdClient]:
    """A client of the session's etcd; always closed."""
    c = EtcdClient(etcd.url)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def small_txn_etcd() -> Iterator[EmbeddedEtcd]:
    """An etcd of the test's own that takes few operations per transaction."""
    server = LimitedEtcd("--max-txn-ops", str(MAX_TXN_OPS)).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def full_etcd() -> Iterator[SimpleNamespace]:
    """An etcd of the test's own with a 2 MiB quota (``url``), and ``fill()``, which writes
    until etcd refuses for want of space and returns the refusal's message."""
    server = LimitedEtcd("--quota-backend-bytes", str(2 << 20)).start()
    filler = EtcdClient(server.url)

    def fill() -> str:
        with pytest.raises(EtcdAccessError) as refused:
            for i in range(200):  # 20 MB of history
                filler.put(f"/filler/{i % 10}", b"x" * 100_000)
        return str(refused.value)

    try:
        yield SimpleNamespace(url=server.url, fill=fill)
    finally:
        filler.close()
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
def etcd_cluster(tmp_path: Path) -> Iterator[EtcdCluster]:
    """A cluster of three etcd members of the test's own, for tests that kill or freeze
    members; every member is stopped at the end."""
    cluster = EtcdCluster(tmp_path / "etcd-cluster")
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def worker_template() -> Iterator[LazyTemplate]:
    """The template that forks the Jobs' workers (tests/support/worker_template.py), started at
    its first use and ended with the session."""
    template = LazyTemplate([sys.executable, str(WORKER)], loopback_env())
    try:
        yield template
    finally:
        template.close()


@contextlib.contextmanager
def _jobs(url: str, tmp_path: Path, base_env: dict[str, str], template: LazyTemplate,
          folder: str = "job") -> Iterator:
    """Makes Jobs on the etcd at ``url``; every process they started is killed at the end."""
    jobs: list[Job] = []

    def make(args: list[str] | None = None, env: dict[str, str] | None = None,
             job_id: str | None = None, **kw) -> Job:
        job = Job(url, tmp_path / f"{folder}{len(jobs)}",
                  job_id or f"test-{os.getpid()}-{next(_job_ids)}", args,
                  {**base_env, **(env or {})}, template=template, **kw)
        jobs.append(job)
        return job

    try:
        yield make
    finally:
        for job in jobs:
            job.kill_all()
        reap_adopted()  # the workers' children, adopted by this process (a subreaper)


@pytest.fixture
def make_job(etcd: EmbeddedEtcd, tmp_path: Path,
             worker_template: LazyTemplate) -> Iterator:
    """Makes Jobs on the session etcd; every process they started is killed at the end."""
    with _jobs(etcd.url, tmp_path, {}, worker_template) as make:
        yield make


@pytest.fixture(scope="session")
def references() -> References:
    """Uninterrupted reference runs, each run once for the session and shared by the tests that
    compare with it (tests/support/references.py)."""
    return References()


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A CA, server and client certificates (one expired), and an unrelated CA."""
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="session")
def secure_etcd(pki: Pki) -> Iterator[SecureEtcd]:
    """A real etcd with TLS, client certificates required and auth on: a root user, and one
    user per job of ``JOB_USERS`` whose role covers that job's prefixes only."""
    server = SecureEtcd(pki).start()
    try:
        server.enable_auth()
        for job_id, (user, password) in JOB_USERS.items():
            server.add_job_user(job_id, user, password)
        yield server
    finally:
        server.stop()


@pytest.fixture
def secure_job(secure_etcd: SecureEtcd, pki: Pki, tmp_path: Path,
               worker_template: LazyTemplate) -> Iterator:
    """Makes Jobs on the TLS and auth etcd, whose workers hold the credentials of ``JOB_A``'s
    user (``job_id=`` picks the job)."""
    with _jobs(secure_etcd.url, tmp_path, user_env(pki, JOB_A),
               worker_template) as make:
        yield make


@pytest.fixture
def make_private_job(private_etcd: EmbeddedEtcd, tmp_path: Path,
                     worker_template: LazyTemplate) -> Iterator:
    """Makes Jobs on the test's own etcd (``private_etcd``), for tests that stop or lose it."""
    with _jobs(private_etcd.url, tmp_path, {}, worker_template, folder="private-job") as make:
        yield make


@pytest.fixture
def make_cluster_job(etcd_cluster: EtcdCluster, tmp_path: Path,
                     worker_template: LazyTemplate) -> Iterator:
    """Makes Jobs on the three-member etcd (``etcd_cluster``; all three URLs, the first
    member's first)."""
    with _jobs(etcd_cluster.urls, tmp_path, {}, worker_template, folder="cluster-job") as make:
        yield make
