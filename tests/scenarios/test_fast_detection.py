"""End to end: survivors re-form after a death nobody announces without waiting for its lease,
and with whom.

No launcher runs beside these workers, so nobody revokes a dead worker's lease: the survivors
must see the death themselves (its connections end) and must not wait for its lease, and yet
must never leave out a live member that is only slow. The proof is in etcd, not in a stopwatch:
the coordinator names in a round's plan (``cut``) the members it left out while they still held
a lease, so a round that names the dead worker there closed before its lease expired, on the
evidence of its ended connections. How long recovery takes is the ``recovery`` benchmark's claim
(``python -m benchmarks recovery``).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from elastic.cluster.etcd.client import EtcdClient
from elastic.cluster.rounds.keys import JobKeys
from elastic.cluster.rounds.plan import Plan
from tests.scenarios.test_elastic_recovery import ARGS, check_outcome
from tests.support.harness import Job

LEASE_TTL_S = 6.0


def _first_plan_after(job: Job, kind: str, who: int | str) -> tuple[Plan, str]:
    """The plan of the first round the survivors formed after fault ``kind`` fired on ``who``,
    and the member id of the worker it fired on."""
    fired = job.fired(kind, who)
    victim_pid = job.procs[fired["index"]].pid
    job.wait_until(lambda: any(e["event"] == "resumed" and e["t"] > fired["t"]
                               for e in job.events()), 60, "the survivors to resume")
    events = job.events()
    victim = [e["member"] for e in events if e["pid"] == victim_pid and "member" in e][-1]
    round_ = min(e["round"] for e in events if e["event"] == "round_formed"
                 and e["t"] > fired["t"])
    client = EtcdClient(job.env["ELASTIC_ETCD"])
    try:
        kv = client.get(JobKeys(job.env["ELASTIC_JOB_ID"]).plan(round_))
    finally:
        client.close()
    assert kv is not None, f"round {round_} has no plan in etcd"
    return Plan.from_json(kv.value, round_), victim


def _assert_left_out_while_leased(plan: Plan, victim: str, what: str) -> None:
    assert victim not in plan.ranks, f"round {plan.round} took the dead member {victim}"
    assert victim in plan.cut, (
        f"round {plan.round} closed without {victim} only once its lease was gone (cut "
        f"{plan.cut}): the survivors waited for {what}, not for its connections to end")


@pytest.mark.parametrize("loader_workers", [0, 2])
def test_survivors_leave_a_killed_worker_out_before_its_lease_expires_even_if_its_loaders_live(
        make_job, loader_workers):
    """Its DataLoader workers are frozen, not killed: if they held copies of its connections,
    those would never end, and only the lease could tell the survivors."""
    job = make_job(ARGS + ["--loader-workers", str(loader_workers), "--step-ms", "30"],
                   {"FAULTS": "kill-freezing-loaders:1:10",
                    "ELASTIC_LEASE_TTL": str(LEASE_TTL_S)})
    job.start_together(range(3))
    try:
        assert job.wait_exit(1) == -signal.SIGKILL
        loaders = job.fired("kill-freezing-loaders", 1)["loaders"]
        assert len(loaders) == loader_workers, loaders
        plan, victim = _first_plan_after(job, "kill-freezing-loaders", 1)
        _assert_left_out_while_leased(plan, victim, f"its lease ({loader_workers} loaders)")
        assert job.wait_exit(0) == 0 and job.wait_exit(2) == 0
        check_outcome(job, [0, 2])
    finally:
        _end_frozen_loaders(job.out / "fired-kill-freezing-loaders-1")


def _end_frozen_loaders(marker: Path) -> None:
    """Kills the frozen DataLoader workers named in ``marker`` (if the fault fired), by pid."""
    if not marker.exists():
        return
    for pid in json.loads(marker.read_text())["loaders"]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_member_inside_a_long_step_is_not_left_out_of_the_survivors_round(make_job):
    """The lease TTL (12 s) is four times the long step (3 s): a round that waited for the dead
    worker's lease, not only for the slow member, would not name it cut off."""
    slow_ms, lease_ttl_s = 3000, 12.0
    job = make_job(ARGS + ["--step-ms", "30"],
                   {"FAULTS": "kill:1:20,slow:2:20", "SLOW_STEP_MS": str(slow_ms),
                    "ELASTIC_LEASE_TTL": str(lease_ttl_s)})
    job.start_together(range(3))
    assert job.wait_exit(1) == -signal.SIGKILL
    plan, victim = _first_plan_after(job, "kill", 1)
    assert job.wait_exit(0) == 0 and job.wait_exit(2) == 0
    check_outcome(job, [0, 2])
    assert plan.world_size == 2, (
        f"round {plan.round} formed without the member inside its long step: {plan.ranks}")
    _assert_left_out_while_leased(plan, victim, "the dead worker's lease")


@pytest.mark.parametrize("victim_rank", [0, 2])
def test_survivors_of_a_killed_rank_close_their_round_without_the_settle_window(make_job,
                                                                                victim_rank):
    """The settle window is only for unknown joiners: with one three times the lease TTL,
    survivors that saw the dead member's connection end (rank 0 sees any rank's; every rank sees
    rank 0's) still re-form while its lease lasts."""
    who = f"r{victim_rank}"
    # The job's size declared: the first round closes once all 3 joined, not after the window
    # (a re-formation's rule looks at the declared size only when an unknown member joins).
    job = make_job(ARGS + ["--step-ms", "30"],
                   {"FAULTS": f"kill:{who}:20", "ELASTIC_LEASE_TTL": str(LEASE_TTL_S),
                    "ELASTIC_SETTLE": str(3 * LEASE_TTL_S), "ELASTIC_MAX_WORKERS": "3"})
    job.start_together(range(3))
    job.wait_until(lambda: (job.out / f"fired-kill-{who}").exists(), 90, "the kill")
    victim_index = job.fired("kill", who)["index"]
    assert job.wait_exit(victim_index) == -signal.SIGKILL
    plan, victim = _first_plan_after(job, "kill", who)
    _assert_left_out_while_leased(plan, victim, "the settle window or the lease")
    survivors = [i for i in range(3) if i != victim_index]
    assert all(job.wait_exit(i) == 0 for i in survivors)
    check_outcome(job, survivors)


def _sockets_of(pid: int) -> list[int]:
    """The descriptors of process ``pid`` that are sockets."""
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:"):
                found.append(int(fd))
        except FileNotFoundError:
            continue  # closed meanwhile
    return found


def test_survivors_resume_at_once_when_a_killed_worker_left_children_made_without_fork(
        make_job):
    """Children started by ``os.system``, ``Popen(close_fds=False)`` and ``posix_spawn`` run no
    fork hook: only close-on-exec keeps the round's sockets out of them."""
    job = make_job(ARGS + ["--step-ms", "30"],
                   {"FAULTS": "children:1:10,kill:1:20", "ELASTIC_LEASE_TTL": str(LEASE_TTL_S)})
    pids = job.out / "children-1.pids"
    try:
        job.start_together(range(3))
        assert job.wait_exit(1) == -signal.SIGKILL
        children = [int(pid) for pid in pids.read_text().split()]
        assert len(children) == 3, "the worker did not start its children"
        held = {pid: _sockets_of(pid) for pid in children}
        assert not any(held.values()), (
            f"children of the killed worker hold sockets it had (pid: fds): {held}")
        plan, victim = _first_plan_after(job, "kill", 1)
        _assert_left_out_while_leased(plan, victim, "its lease (children kept its connections)")
        assert job.wait_exit(0) == 0 and job.wait_exit(2) == 0
        check_outcome(job, [0, 2])
    finally:
        for pid in map(int, pids.read_text().split() if pids.exists() else ()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
