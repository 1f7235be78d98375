"""`elastic run` end to end: embedded etcd, joining launchers, SIGTERM, crashes, plain DDP."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
import urllib.error
import urllib.request
from datetime import timedelta
from pathlib import Path

import pytest

from elastic.cluster.etcd.client import EtcdClient
from elastic.cluster.rounds.keys import JobKeys
from tests.support.cli import WORKERS, events, is_alive, wait_until, worker_pids

pytestmark = pytest.mark.timeout(120)
WORKER = str(WORKERS / "elastic_worker.py")


def resumed_worlds(log_dir: Path) -> list[int]:
    return [e["world_size"] for e in events(log_dir) if e["event"] == "resumed"]


def etcd_processes_on(port: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "etcd" in cmdline and f"127.0.0.1:{port}" in cmdline:
                found.append(int(entry.name))
    return found


def test_the_embedded_etcd_starts_prints_the_join_command_and_stops(cli, tmp_path):
    run = cli("run", "-n", "1", "--log-dir", str(tmp_path / "events"), WORKER, "--steps", "10")
    assert run.wait(90) == 0, run.text()
    text = run.text()
    match = re.search(r"elastic run --etcd (http://127\.0\.0\.1:(\d+)) --job-id (\S+) -n 1", text)
    assert match, text
    assert "elastic_worker.py --steps 10" in text
    url, port = match.group(1), int(match.group(2))
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(f"{url}/health", timeout=2)
    assert not etcd_processes_on(port), "the embedded etcd outlived the job"
    assert "worker done at step 10" in text


def test_a_second_launcher_joins_the_running_job_and_the_world_grows(cli, etcd, tmp_path):
    log_dir, job = tmp_path / "events", f"join-{os.getpid()}"
    common = ["run", "--etcd", etcd.url, "--job-id", job, "--log-dir", str(log_dir)]
    first = cli(*common, "-n", "2", WORKER, "--steps", "100000", name="a")
    wait_until(lambda: 2 in resumed_worlds(log_dir), 60, "world 2", [first])
    status = cli("status", "--etcd", etcd.url, "--job-id", job, "--json", name="status")
    assert status.wait(30) == 0
    shown = json.loads(status.text())
    assert len(shown["members"]) == 2 and shown["plan"]["world_size"] == 2
    assert len(shown["launchers"]) == 1
    second = cli(*common, "-n", "1", WORKER, "--steps", "100000", name="b")
    wait_until(lambda: 3 in resumed_worlds(log_dir), 60, "world 3", [first, second])
    for launcher in (first, second):
        launcher.proc.send_signal(signal.SIGTERM)
    assert first.wait(40) == 0 and second.wait(40) == 0
    assert not [pid for pid in worker_pids(log_dir) if is_alive(pid)]


def test_sigterm_to_the_launcher_ends_every_worker_gracefully(cli, etcd, tmp_path):
    log_dir = tmp_path / "events"
    run = cli("run", "--etcd", etcd.url, "--job-id", f"term-{os.getpid()}", "-n", "2",
              "--log-dir", str(log_dir), WORKER, "--steps", "100000")
    wait_until(lambda: 2 in resumed_worlds(log_dir), 60, "world 2", [run])
    wait_until(lambda: any(e["event"] == "progress" and e["step"] >= 40 for e in events(log_dir)),
               60, "rank 0 to report step 40", [run])
    pids = worker_pids(log_dir)
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait(40) == 0, run.text()
    assert not [pid for pid in pids if is_alive(pid)], "a worker outlived its launcher"
    left = {e["pid"] for e in events(log_dir) if e["event"] == "left"}
    assert left == pids, "not every worker left gracefully"
    progress = [e for e in events(log_dir) if e["event"] == "progress"]
    assert progress and {e["rank"] for e in progress} == {0}, "rank 0 reports progress"
    steps = [e["step"] for e in sorted(progress, key=lambda e: e["t"])]
    assert steps == sorted(steps) and steps[-1] > steps[0] and all(s % 5 == 0 for s in steps)
    report = cli("report", str(log_dir), "--out", str(tmp_path / "t.png"), name="report")
    assert report.wait(60) == 0, report.text()
    assert f"progress: {steps[-1]} steps" in report.text()


def test_a_crashed_worker_has_its_lease_revoked_at_once_and_is_restarted(cli, etcd, tmp_path):
    """The lease TTL is ten minutes: the victim's key can go within the test only by the
    launcher revoking its lease."""
    log_dir, job = tmp_path / "events", f"crash-{os.getpid()}"
    run = cli("run", "--etcd", etcd.url, "--job-id", job, "-n", "2", "--lease-ttl", "600",
              "--max-restarts", "1", "--log-dir", str(log_dir), WORKER, "--steps", "100000")
    wait_until(lambda: 2 in resumed_worlds(log_dir), 60, "world 2", [run])
    original = worker_pids(log_dir)
    victim = min(original)
    client = EtcdClient(etcd.url)
    try:
        keys = JobKeys(job)
        registered = lambda: any(json.loads(kv.value)["pid"] == victim  # noqa: E731
                                 for kv in client.get_prefix(keys.members)[0]
                                 if kv.key != keys.member("look-alike"))
        assert registered()
        # A member of another container with the same host name and pid: not the launcher's.
        look_alike = client.grant(timedelta(seconds=30))
        client.put(keys.member("look-alike"), json.dumps(
            {"host": socket.gethostname(), "pid": victim, "lease": look_alike}), lease=look_alike)
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: not registered(), 60, "the victim's lease to be revoked", [run])
        assert client.get(keys.member("look-alike")) is not None, \
            "the launcher revoked a lease it does not own"
        client.revoke(look_alike)
    finally:
        client.close()
    wait_until(lambda: any(e["event"] == "resumed" and e["pid"] not in original
                           and e["world_size"] == 2 for e in events(log_dir)),
               60, "the restarted worker to rejoin in world 2", [run])
    # Its cold start waited until the survivor had re-formed without it: held back when the
    # launcher saw the death first, else started once that round was there already.
    seen = events(log_dir)
    alone = min(e["t"] for e in seen if e["event"] == "round_formed" and e["world_size"] == 1)
    replacement = min(e["t"] for e in seen if e["pid"] not in original)
    assert alone < replacement, run.text()
    held = re.search(r"restarting worker local_rank=(\d) once the others re-formed without "
                     r"it \(at most 2 s\)", run.text())
    if held:
        started = re.search(r"starting the replacement of worker local_rank=(\d) \(the "
                            r"others formed round \d+\)", run.text())
        assert started and held.end() < started.start(), run.text()
        assert held.group(1) == started.group(1)
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait(40) == 0, run.text()


def test_a_warm_spare_takes_a_killed_workers_place_and_a_new_spare_is_started(cli, etcd,
                                                                              tmp_path):
    log_dir = tmp_path / "events"
    run = cli("run", "--etcd", etcd.url, "--job-id", f"spares-{os.getpid()}", "-n", "2",
              "--spares", "1", "--max-restarts", "1", "--log-dir", str(log_dir), WORKER,
              "--steps", "100000")
    trained = lambda: {e["pid"] for e in events(log_dir)  # noqa: E731
                       if e["event"] == "resumed" and e["world_size"] == 2}
    # A spare that registered after the first round formed waits in the next round's joins.
    wait_until(lambda: len(trained()) == 2 and len(worker_pids(log_dir)) == 3, 60,
               "world 2 and a registered spare", [run])
    original = worker_pids(log_dir)
    [spare] = original - trained()
    assert "with 2 worker(s) and 1 warm spare(s)" in run.text()
    os.kill(min(trained()), signal.SIGKILL)
    wait_until(lambda: spare in trained(), 60, "the spare to train in world 2", [run])
    wait_until(lambda: worker_pids(log_dir) - original, 60, "a new spare", [run])
    assert max(e["world_size"] for e in events(log_dir) if e["event"] == "resumed") == 2, \
        "a spare grew the world"
    assert "a warm spare takes the place of worker local_rank=" in run.text()
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait(40) == 0, run.text()


def test_a_launched_job_trains_through_an_etcd_freeze_longer_than_the_lease_with_no_restart(
        cli, private_etcd, tmp_path):
    log_dir = tmp_path / "events"
    run = cli("run", "--etcd", private_etcd.url, "--job-id", f"freeze-{os.getpid()}", "-n", "2",
              "--lease-ttl", "2", "--log-dir", str(log_dir), WORKER, "--steps", "100000")
    wait_until(lambda: 2 in resumed_worlds(log_dir), 60, "world 2", [run])
    workers = worker_pids(log_dir)
    steps = lambda since: [e["step"] for e in events(log_dir)  # noqa: E731
                           if e["event"] == "progress" and e["t"] > since]
    private_etcd.pause()
    frozen_at = time.monotonic()
    try:
        frozen_wall = time.time()
        wait_until(lambda: time.monotonic() - frozen_at > 12, 20, "12 s of frozen etcd", [run])
        assert run.proc.poll() is None, run.text()
        trained = steps(frozen_wall)
    finally:
        private_etcd.resume()
    assert len(trained) > 5 and trained == sorted(trained), "training stalled while etcd froze"
    thawed = time.time()
    wait_until(lambda: len(steps(thawed)) > 5, 60, "training after the thaw", [run])
    assert "restarting" not in run.text() and "revoked" not in run.text(), run.text()
    # The leases ran out inside the frozen etcd: the same two processes may re-form once, as
    # new members; none is restarted and the world ends whole.
    wait_until(lambda: resumed_worlds(log_dir)[-1] == 2, 60, "a world of 2 again", [run])
    assert worker_pids(log_dir) == workers, "a worker process was replaced"
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait(40) == 0, run.text()


def test_a_plain_ddp_script_runs_unchanged_and_survives_a_crash_by_restart(cli, etcd, tmp_path):
    run = cli("run", "--plain", "--etcd", etcd.url, "--job-id", f"plain-{os.getpid()}",
              "-n", "2", "--max-restarts", "1", str(WORKERS / "plain_ddp.py"), str(tmp_path),
              env={"CRASH_RANK": "1"})
    assert run.wait(90) == 0, run.text()
    results = [json.loads((tmp_path / f"plain-{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world"] == 2 and r["restart"] == 1 for r in results)
    assert results[0]["params"] == results[1]["params"]
    assert results[0]["master"] == "127.0.0.1"
    assert re.search(r"elastic: worker local_rank=1 \(\S+:pid \d+\) died \(SIGKILL\); "
                     r"restarting every worker \(restart 1 of 1\)", run.text()), run.text()


def test_sigint_while_a_plain_generation_forms_stops_the_launcher_at_once(cli, etcd, tmp_path):
    job = f"plain-wait-{os.getpid()}"
    run = cli("run", "--plain", "--etcd", etcd.url, "--job-id", job, "-n", "1",
              "--min-workers", "2", str(WORKERS / "plain_ddp.py"), str(tmp_path))
    client = EtcdClient(etcd.url)
    try:
        rounds = JobKeys(job).launchers().rounds
        wait_until(lambda: client.get_prefix(rounds)[0], 60,
                   "the launcher to ask for a generation (it waits for a second one)", [run])
    finally:
        client.close()
    # The generation never forms (one worker of min 2): a launcher that waited for it would
    # hang past the bound (a hang guard) below.
    run.proc.send_signal(signal.SIGINT)
    assert run.wait(30) == 130, run.text()  # Ctrl-C, as torchrun reports it
    assert "stopped while the next generation was forming" in run.text()
    assert not list(tmp_path.glob("plain-*.json")), "no worker was started"


def test_a_worker_stopped_by_sigterm_before_it_joined_leaves_the_job_a_clean_exit(cli, etcd,
                                                                                   tmp_path):
    pid_file = tmp_path / "starting.pid"
    run = cli("run", "--etcd", etcd.url, "--job-id", f"starting-{os.getpid()}", "-n", "1",
              str(WORKERS / "slow_import.py"), str(pid_file))
    wait_until(pid_file.exists, 60, "the worker to start", [run])
    starting = int(pid_file.read_text())
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait(30) == 0, run.text()
    assert f":pid {starting}) was stopped before it joined the job" in run.text()


def test_a_second_sigint_kills_workers_that_ignore_the_first_without_waiting_the_grace(
        cli, etcd, tmp_path):
    pid_file = tmp_path / "stuck.pid"
    run = cli("run", "--etcd", etcd.url, "--job-id", f"stuck-{os.getpid()}", "-n", "1",
              "--grace", "90", str(WORKERS / "ignores_sigterm.py"), str(pid_file))
    wait_until(pid_file.exists, 60, "the worker to start", [run])
    stuck = int(pid_file.read_text())
    try:
        run.proc.send_signal(signal.SIGINT)
        wait_until(lambda: "signal SIGINT" in run.text(), 30, "the launcher to see SIGINT", [run])
        assert is_alive(stuck), "the worker ignores SIGTERM, so it is still there"
        run.proc.send_signal(signal.SIGINT)
        run.wait(30)  # a hang guard: the grace period is 90 s
        assert run.proc.poll() is not None, "the launcher waited out the grace period"
        assert not is_alive(stuck), run.text()
        assert "asked again" in run.text()
        assert "signal SIGINT: asked again: killing the workers now" in run.text()
        assert run.proc.returncode == 130, "Ctrl-C exits 130, as torchrun reports it"
    finally:
        if is_alive(stuck):
            os.kill(stuck, signal.SIGKILL)


def test_the_launcher_holding_the_embedded_etcd_serves_the_other_node_until_it_leaves(cli,
                                                                                      tmp_path):
    log_dir = tmp_path / "events"
    holder = cli("run", "-n", "1", "--log-dir", str(log_dir), WORKER, "--steps", "100000",
                 name="holder")
    wait_until(lambda: re.search(r"elastic run --etcd (\S+) --job-id (\S+)", holder.text()),
               60, "the join command", [holder])
    url, job = re.search(r"elastic run --etcd (\S+) --job-id (\S+)", holder.text()).groups()
    other = cli("run", "--etcd", url, "--job-id", job, "-n", "1", "--log-dir", str(log_dir),
                WORKER, "--steps", "100000", name="other")
    wait_until(lambda: 2 in resumed_worlds(log_dir), 60, "world 2", [holder, other])
    holder.proc.send_signal(signal.SIGINT)
    wait_until(lambda: "keeps serving the 1 other launcher(s) until they leave" in holder.text(),
               60, "the holder's one line", [holder])
    wait_until(lambda: resumed_worlds(log_dir)[-1] == 1 and holder.proc.poll() is None, 60,
               "the other node to train on alone", [holder, other])
    other.proc.send_signal(signal.SIGTERM)
    assert other.wait(40) == 0, other.text()
    assert holder.wait(30) == 130, holder.text()
    assert "the other launchers left; ending the embedded etcd" in holder.text()
    assert "Check that etcd runs" not in other.text(), other.text()
