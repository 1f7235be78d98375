"""Warm spares (``elastic run --spares``) keep the world at its size through any deaths."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.support.cli import WORKERS, events, wait_until, worker_pids

pytestmark = pytest.mark.timeout(180)
WORKER = str(WORKERS / "elastic_worker.py")


def test_a_world_whose_workers_all_died_is_refilled_to_its_size_past_the_one_spare(
        cli, etcd, tmp_path):
    log_dir = tmp_path / "events"
    run = cli("run", "--etcd", etcd.url, "--job-id", f"refill-{os.getpid()}", "-n", "2",
              "--spares", "1", "--max-restarts", "2", "--log-dir", str(log_dir), WORKER,
              "--steps", "100000")

    def trained(since: float = 0.0) -> set[int]:
        return {e["pid"] for e in events(log_dir)
                if e["event"] == "resumed" and e["world_size"] == 2 and e["t"] > since}

    wait_until(lambda: len(trained()) == 2 and len(worker_pids(log_dir)) == 3, 60,
               "world 2 and a registered spare", [run])
    victims = trained()
    killed_at = time.time()
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    wait_until(lambda: len(trained(killed_at) - victims) == 2, 90,
               "two workers to train in world 2 again", [run])
    assert run.text().count("a warm spare takes the place of worker") == 1, run.text()
    assert run.text().count("restarting worker local_rank=") == 1, run.text()
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait(40) == 0, run.text()
