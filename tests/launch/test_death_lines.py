"""The launcher's line for a dead worker: the issue's wording, with its etcd bookkeeping on the
line only under ELASTIC_DEBUG=1."""

from __future__ import annotations

import signal

import pytest

from elastic.launch.death_lines import died, with_detail

pytestmark = pytest.mark.unit


def test_a_killed_worker_is_named_by_local_rank_host_and_pid_and_its_signal():
    assert died(1, "host-a", 812, -signal.SIGKILL) == \
        "worker local_rank=1 (host-a:pid 812) died (SIGKILL)"
    assert died(0, "h", 7, -200).endswith("died (signal 200)")


def test_a_worker_that_exited_with_an_error_status_failed():
    assert died(0, "h", 7, 3) == "worker local_rank=0 (h:pid 7) failed (exit code 3)"


def test_the_revoked_lease_stays_off_the_console_unless_elastic_debug(monkeypatch):
    line = died(1, "h", 7, -signal.SIGKILL)
    monkeypatch.delenv("ELASTIC_DEBUG", raising=False)
    assert with_detail(line, "revoked its lease 1f") == line
    monkeypatch.setenv("ELASTIC_DEBUG", "1")
    assert with_detail(line, "revoked its lease 1f") == f"{line}; revoked its lease 1f"
