"""A launcher killed with SIGKILL takes its job on this node with it: its workers and its
embedded etcd end within seconds (they are not left training, re-parented to PID 1), and the
next launcher removes the directories the dead one left."""

from __future__ import annotations

import os
import re
import signal
import tempfile
from pathlib import Path

import pytest

from tests.launch.test_run import etcd_processes_on
from tests.support.cli import WORKERS, is_alive, wait_until, worker_pids

pytestmark = pytest.mark.timeout(180)
WORKER = str(WORKERS / "elastic_worker.py")


def dirs_owned_by(pid: int) -> list[Path]:
    found = []
    for prefix in ("elastic-etcd-", "elastic-leases-"):
        for directory in Path(tempfile.gettempdir()).glob(f"{prefix}*"):
            try:
                owner = (directory / ".owner").read_text().split()
            except OSError:
                continue
            if owner and owner[0] == str(pid):
                found.append(directory)
    return found


def test_sigkill_of_the_launcher_ends_its_workers_and_its_embedded_etcd(cli, tmp_path):
    log_dir = tmp_path / "events"
    run = cli("run", "-n", "2", "--log-dir", str(log_dir), WORKER, "--steps", "100000")
    wait_until(lambda: len(worker_pids(log_dir)) == 2, 90, "both workers joined", [run])
    port = int(re.search(r"embedded etcd http://127\.0\.0\.1:(\d+)", run.text()).group(1))
    [etcd] = etcd_processes_on(port)
    workers = worker_pids(log_dir)
    left = dirs_owned_by(run.proc.pid)

    os.kill(run.proc.pid, signal.SIGKILL)
    run.proc.wait(10)
    wait_until(lambda: not any(is_alive(p) for p in {*workers, etcd}), 10,
               "the workers and the embedded etcd to end with their launcher")
    assert len(left) == 2, left  # its etcd's data and its workers' lease files

    again = cli("run", WORKER, "--steps", "5")
    assert again.wait(90) == 0, again.text()
    assert not any(d.exists() for d in left), left
