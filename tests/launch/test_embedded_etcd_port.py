"""The embedded etcd serves on its own port or not at all: a port taken by another etcd
between choosing it and binding it must not pass for ours."""

from __future__ import annotations

import pytest

import elastic.launch.embedded_etcd as embedded

pytestmark = pytest.mark.timeout(120)


def test_an_embedded_etcd_whose_port_another_etcd_took_starts_on_another_port(monkeypatch):
    other = embedded.EmbeddedEtcd().start()
    try:
        ports = iter([other.client_port])
        real_free_port = embedded.free_port

        def taken_first() -> int:  # the race: the first port chosen is the other etcd's
            return next(ports, None) or real_free_port()
        monkeypatch.setattr(embedded, "free_port", taken_first)
        ours = embedded.EmbeddedEtcd().start()
        try:
            assert ours.client_port != other.client_port
            assert ours.process is not None and ours.process.poll() is None
        finally:
            ours.stop()
    finally:
        other.stop()
