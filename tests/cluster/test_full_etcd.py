"""An etcd whose history filled its quota: what a worker can still do (the ``full_etcd``
fixture)."""

from __future__ import annotations

import logging
from datetime import timedelta
from types import SimpleNamespace

import pytest

from elastic.cluster.cluster import Cluster
from elastic.cluster.etcd.client import EtcdClient
from elastic.foundation.events import EventLog
from elastic.foundation.settings import WorkerSettings

pytestmark = pytest.mark.timeout(60)


def test_a_worker_keeps_its_lease_and_records_checkpoints_as_warnings_once_etcd_is_full(
        full_etcd, monkeypatch, caplog):
    monkeypatch.setenv("ELASTIC_LEASE_TTL", "2")
    settings = WorkerSettings.resolve(etcd=full_etcd.url, job_id="full-etcd", min_workers=None,
                                      max_workers=None, checkpoint=None)
    cluster = Cluster(settings, EventLog(None, "full-etcd"))
    try:
        assert "out of space" in full_etcd.fill()
        ref = SimpleNamespace(step=7, url="file:///ckpt/7", epoch=1)
        with caplog.at_level(logging.WARNING, logger="elastic.cluster.cluster"):
            cluster.publish_checkpoint(ref)  # the durable commit landed; etcd cannot say so
        assert any("could not record checkpoint file:///ckpt/7" in r.getMessage()
                   for r in caplog.records)
        # Renewals are not writes: the lease outlives a TTL and a half of a full etcd.
        client = EtcdClient(full_etcd.url)
        try:
            assert cluster.membership.fenced.wait(3) is False
            assert client.refresh(cluster.membership.lease) > 0
        finally:
            client.close()
    finally:
        cluster.close()
