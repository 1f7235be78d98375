"""`elastic run --node-lease`: the workers of a node share their launcher's etcd lease.

The launcher then does what the end of a worker's own lease would do: it removes a worker that
dies at once, and one that stops sending heartbeats (stopped, hung) after a lease TTL; a removed
worker that comes back is fenced and registers again, under a lease of its own.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from elastic.cluster.etcd.client import EtcdClient
from elastic.cluster.rounds.keys import JobKeys
from tests.support.cli import WORKERS, events, is_alive, wait_until, worker_pids

pytestmark = pytest.mark.timeout(120)
WORKER = str(WORKERS / "elastic_worker.py")


def trained_in(log_dir, world: int, since: float = 0.0) -> set[int]:
    return {e["pid"] for e in events(log_dir)
            if e["event"] == "resumed" and e["world_size"] == world and e["t"] > since}


def member_leases(client: EtcdClient, keys: JobKeys) -> dict[int, int]:
    """The lease of each registered worker, by pid."""
    return {json.loads(kv.value)["pid"]: kv.lease for kv in client.get_prefix(keys.members)[0]}


def two_workers_in_world_two(cli, etcd, tmp_path, name: str):  # noqa: ANN001, ANN201
    """Starts `elastic run --node-lease -n 2 --lease-ttl 2 --release-grace 5` and waits for
    world 2 (a worker whose step gloo does not wake restarts in place after 5 s, not 30).
    Its temporary files go under ``tmp_path``: a launcher killed by a test cannot remove them."""
    log_dir, job = tmp_path / "events", f"{name}-{os.getpid()}"
    run = cli("run", "--etcd", etcd.url, "--job-id", job, "-n", "2", "--node-lease",
              "--lease-ttl", "2", "--release-grace", "5", "--log-dir", str(log_dir), WORKER,
              "--steps", "100000", env={"TMPDIR": str(tmp_path)})
    wait_until(lambda: len(trained_in(log_dir, 2)) == 2, 60, "world 2", [run])
    return run, log_dir, JobKeys(job)


def test_workers_under_a_node_lease_share_the_launchers_lease_and_a_killed_one_is_removed_at_once(
        cli, etcd, tmp_path):
    log_dir, job = tmp_path / "events", f"node-kill-{os.getpid()}"
    keys = JobKeys(job)
    run = cli("run", "--etcd", etcd.url, "--job-id", job, "-n", "3", "--node-lease",
              "--lease-ttl", "30", "--max-restarts", "1", "--log-dir", str(log_dir), WORKER,
              "--steps", "100000")
    wait_until(lambda: len(trained_in(log_dir, 3)) == 3, 60, "world 3", [run])
    original = worker_pids(log_dir)
    client = EtcdClient(etcd.url)
    try:
        [launcher] = client.get_prefix(keys.launchers().members)[0]
        leases = member_leases(client, keys)
        assert set(leases) == original and set(leases.values()) == {launcher.lease}
        victim = min(leases)
        killed_at = time.time()
        os.kill(victim, signal.SIGKILL)
        # The shared lease lives on while the launcher does: only the launcher's delete can
        # remove the key (the bound is a hang guard).
        wait_until(lambda: victim not in member_leases(client, keys), 30,
                   "the victim's member key to go (the shared lease lives on)", [run])
        assert client.get(launcher.key) is not None, "the shared lease went"
        # Its replacement registers under the same lease and brings the world back to 3.
        wait_until(lambda: trained_in(log_dir, 3, killed_at) - original, 60,
                   "the replacement to train in world 3", [run])
        assert set(member_leases(client, keys).values()) == {launcher.lease}
    finally:
        client.close()
    assert f":pid {victim}) died (SIGKILL)\n" in run.text(), run.text()
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait(40) == 0, run.text()


def test_a_stopped_worker_under_a_node_lease_is_removed_after_a_ttl_and_rejoins_as_a_new_member(
        cli, etcd, tmp_path):
    run, log_dir, keys = two_workers_in_world_two(cli, etcd, tmp_path, "node-stop")
    frozen = min(worker_pids(log_dir))
    stopped_at = time.time()
    os.kill(frozen, signal.SIGSTOP)
    try:
        wait_until(lambda: trained_in(log_dir, 1, stopped_at), 30,
                   "the other worker to go on alone", [run])
        # The other worker's heartbeats left it out first; its launcher still drops its member
        # (the shared lease cannot see a stopped worker) once its lease file goes stale.
        wait_until(lambda: f":pid {frozen}) sent no heartbeat for " in run.text(), 30,
                   "the launcher to drop the stopped worker", [run])
    finally:
        # Read before the signal: a continued worker can register again within milliseconds,
        # and a stopped one cannot register at all.
        continued_at = time.time()
        os.kill(frozen, signal.SIGCONT)
    wait_until(lambda: frozen in trained_in(log_dir, 2, continued_at), 60,
               "the continued worker to train in world 2 again", [run])
    client = EtcdClient(etcd.url)
    try:
        [launcher] = client.get_prefix(keys.launchers().members)[0]
        [(member, lease)] = [(json.loads(kv.value), kv.lease)
                             for kv in client.get_prefix(keys.members)[0]
                             if json.loads(kv.value)["pid"] == frozen]
        assert member["since"] > continued_at, "it came back as a new member"
        # Fenced, it registers under a lease of its own; restarted in place (a fresh process
        # image, when its training thread could not let go of the round), under the node's.
        restarted = "restarting this worker in place" in run.text()
        assert (lease == launcher.lease) == restarted and lease != 0, run.text()
    finally:
        client.close()
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait(40) == 0, run.text()


def test_workers_whose_launcher_dies_under_a_node_lease_end_with_it_and_leave_the_job(
        cli, etcd, tmp_path):
    # A launcher's workers never outlive it (PR_SET_PDEATHSIG): none trains on unseen, and the
    # shared lease, no longer renewed, takes their registrations with it.
    run, log_dir, keys = two_workers_in_world_two(cli, etcd, tmp_path, "node-orphans")
    pids = worker_pids(log_dir)
    client = EtcdClient(etcd.url)
    try:
        run.proc.kill()
        run.wait(10)
        wait_until(lambda: not any(is_alive(pid) for pid in pids), 10,
                   "the killed launcher's workers to end with it", [])
        wait_until(lambda: not member_leases(client, keys), 30,
                   "the workers' registrations to go with the launcher's lease", [])
    finally:
        client.close()
