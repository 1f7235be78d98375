"""What a person watching a real run sees: the console's story (one line per event, from rank
0, no worker prefix) and the launcher's Prometheus metrics over 127.0.0.1, through a kill and
the replacement's join."""

from __future__ import annotations

import os
import re
import signal
import socket
import urllib.error
import urllib.request

import pytest

from elastic.cluster.links.ports import free_port
from tests.support.cli import WORKERS, events, wait_until, worker_pids

pytestmark = pytest.mark.timeout(120)
WORKER = str(WORKERS / "elastic_worker.py")


def story(text: str) -> list[str]:
    return [line for line in text.splitlines()
            if re.match(r"elastic: (formed|joined|left|re-formed|resumed|durable)", line)]


def scrape(port: int) -> dict[str, float]:
    """The samples of one scrape, by name with labels (``name{label="v"}``); {} if none."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
            text = answer.read().decode()
    except (urllib.error.URLError, ConnectionError):
        return {}
    samples = {}
    for line in text.splitlines():
        match = re.fullmatch(r"(\w+(?:\{[^}]*\})?) (\S+)", line)
        if match:
            samples[match.group(1)] = float(match.group(2))
    return samples


def test_a_kill_and_the_join_are_told_once_each_and_scraped_from_the_launcher(cli, etcd,
                                                                               tmp_path):
    log_dir, port = tmp_path / "events", free_port()
    run = cli("run", "--etcd", etcd.url, "--job-id", f"story-{os.getpid()}", "-n", "2",
              "--max-restarts", "1", "--metrics-port", str(port), "--log-dir", str(log_dir),
              WORKER, "--steps", "100000")
    wait_until(lambda: any("elastic: formed: world 2" in line for line in story(run.text())),
               60, "the first formation's line", [run])
    wait_until(lambda: scrape(port).get("elastic_steps", 0) >= 20, 60, "step 20 scraped", [run])
    assert scrape(port)["elastic_world_size"] == 2
    victim = max(worker_pids(log_dir))
    os.kill(victim, signal.SIGKILL)
    wait_until(lambda: any(line.startswith("elastic: joined: world 1 -> 2")
                           for line in story(run.text())), 60, "the join's line", [run])
    seen = scrape(port)
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait(40) == 0, run.text()

    death = re.compile(rf"elastic: worker local_rank=[01] \({re.escape(socket.gethostname())}:"
                       rf"pid {victim}\) died \(SIGKILL\)")
    deaths = [line for line in run.text().splitlines()
              if re.match(r"elastic: worker .*(died|killed)", line)]
    assert len(deaths) == 1 and death.fullmatch(deaths[0]), run.text()
    told = story(run.text())
    failure = [line for line in told if line.startswith("elastic: re-formed after a failure")]
    assert len(failure) == 1, run.text()
    assert re.fullmatch(r"elastic: re-formed after a failure: world 2 -> 1 in \d+\.\d\d s, "
                        r"(rolled back \d+ steps? to |nothing rolled back \()step \d+\)?",
                        failure[0]), failure
    assert told.index(failure[0]) < max(i for i, line in enumerate(told)
                                        if line.startswith("elastic: joined: world 1 -> 2"))
    assert not [line for line in run.text().splitlines() if "]: elastic: formed" in line
                or "\x1e" in line], "a story line kept a worker prefix or its mark"

    assert seen['elastic_worker_failures_total{cause="SIGKILL"}'] == 1, seen
    assert seen['elastic_formations_total{reason="failure"}'] >= 1, seen
    assert seen['elastic_formations_total{reason="change"}'] >= 1, seen
    assert seen["elastic_recovery_seconds_count"] >= 2, seen  # the failure and the join
    assert 0 < seen["elastic_recovery_seconds_sum"] < 30, seen
    assert seen["elastic_world_size"] == 2 and seen["elastic_round"] >= 3, seen
    assert seen["elastic_etcd_errors_total"] == 0 and seen["elastic_spares"] == 0, seen
    assert seen["elastic_durable_checkpoint_bytes"] == 0, seen  # no --checkpoint
    assert scrape(port) == {}, "the metrics server outlived its launcher"
    assert [e for e in events(log_dir) if e["event"] == "resumed"]


def test_quiet_hides_the_story_with_its_deaths_and_restarts(cli, tmp_path):
    log_dir = tmp_path / "events"
    run = cli("run", "-n", "2", "--quiet", "--max-restarts", "1", "--log-dir", str(log_dir),
              WORKER, "--steps", "100000")
    wait_until(lambda: len(set(worker_pids(log_dir))) == 2, 60, "two workers to train", [run])
    os.kill(max(worker_pids(log_dir)), signal.SIGKILL)
    wait_until(lambda: len(set(worker_pids(log_dir))) == 3, 60, "the replacement to train",
               [run])
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait(40) == 0, run.text()
    said = [line for line in run.text().splitlines() if line.startswith("elastic: ")]
    assert story(run.text()) == [] and not [line for line in said if re.search(
        r"died|killed|restarting|replacement", line)], run.text()
