"""End to end: how fast survivors re-form after a death nobody announces, and with whom.

No launcher runs beside these workers, so nobody revokes a dead worker's lease: the survivors
must see the death themselves (its connections end) and must not wait for its lease, and yet
must never leave out a live member that is only slow. The lease TTL is long here (6 s), so that
any recovery that waited for a lease shows plainly.
"""

from __future__ import annotations

import os
import signal

import pytest

from tests.scenarios.test_elastic_recovery import ARGS, check_outcome

LEASE_TTL_S = 6.0
# A recovery that saw the death directly takes well under a second on this machine; one that
# fell back to the lease (or to the DataLoader's own 5 s parent check) takes seconds.
FAST_S = LEASE_TTL_S / 4


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


def _recovery_after(job, kind: str, index: int) -> float:
    """Seconds from the fault to the first resumed event after it."""
    fired_at = job.fired(kind, index)["t"]
    job.wait_until(lambda: any(e["event"] == "resumed" and e["t"] > fired_at
                               for e in job.events()), 60, "the survivors to resume")
    resumed = next(e for e in job.events() if e["event"] == "resumed" and e["t"] > fired_at)
    return resumed["t"] - fired_at


@pytest.mark.parametrize("loader_workers", [0, 2])
def test_survivors_of_a_killed_worker_resume_at_once_even_when_it_had_dataloader_workers(
        make_job, loader_workers):
    job = make_job(ARGS + ["--loader-workers", str(loader_workers), "--step-ms", "30"],
                   {"FAULTS": "kill:1:20", "ELASTIC_LEASE_TTL": str(LEASE_TTL_S)})
    job.start_together(range(3))
    assert job.wait_exit(1) == -signal.SIGKILL
    recovery_s = _recovery_after(job, "kill", 1)
    assert recovery_s < FAST_S, (
        f"the survivors resumed {recovery_s:.2f} s after the kill ({loader_workers} loader "
        f"workers): they waited for something other than the dead worker's connections")
    assert job.wait_exit(0) == 0 and job.wait_exit(2) == 0
    check_outcome(job, [0, 2])


def test_a_member_inside_a_long_step_is_not_left_out_of_the_survivors_round(make_job):
    slow_ms = 3000
    job = make_job(ARGS + ["--step-ms", "30"],
                   {"FAULTS": "kill:1:20,slow:2:20", "SLOW_STEP_MS": str(slow_ms),
                    "ELASTIC_LEASE_TTL": str(LEASE_TTL_S)})
    job.start_together(range(3))
    assert job.wait_exit(1) == -signal.SIGKILL
    recovery_s = _recovery_after(job, "kill", 1)
    assert job.wait_exit(0) == 0 and job.wait_exit(2) == 0
    check_outcome(job, [0, 2])
    fired_at = job.fired("kill", 1)["t"]
    worlds = [e["world_size"] for e in job.events()
              if e["event"] == "round_formed" and e["t"] > fired_at]
    assert worlds and min(worlds) == 2, (
        f"a round formed without the member inside its long step: worlds {worlds}")
    assert recovery_s < slow_ms / 1000 + FAST_S < LEASE_TTL_S, (
        f"the survivors resumed {recovery_s:.2f} s after the kill: they waited for the dead "
        "worker's lease, not only for the slow member")


@pytest.mark.parametrize("victim_rank", [0, 2])
def test_survivors_of_a_killed_rank_close_their_round_without_the_settle_window(make_job,
                                                                                victim_rank):
    """The settle window is only for unknown joiners: with a long one (3 s), survivors that saw
    the dead member's connection end (rank 0 sees any rank's; every rank sees rank 0's) still
    re-form at once."""
    who = f"r{victim_rank}"
    # The job's size declared: the first round closes once all 3 joined, not after the window
    # (a re-formation's rule looks at the declared size only when an unknown member joins).
    job = make_job(ARGS + ["--step-ms", "30"],
                   {"FAULTS": f"kill:{who}:20", "ELASTIC_LEASE_TTL": str(LEASE_TTL_S),
                    "ELASTIC_SETTLE": "3", "ELASTIC_MAX_WORKERS": "3"})
    job.start_together(range(3))
    job.wait_until(lambda: (job.out / f"fired-kill-{who}").exists(), 90, "the kill")
    victim = job.fired("kill", who)["index"]
    assert job.wait_exit(victim) == -signal.SIGKILL
    recovery_s = _recovery_after(job, "kill", who)
    assert recovery_s < FAST_S, (
        f"the survivors resumed {recovery_s:.2f} s after rank {victim_rank} was killed: they "
        "waited for the settle window or the lease")
    survivors = [i for i in range(3) if i != victim]
    assert all(job.wait_exit(i) == 0 for i in survivors)
    check_outcome(job, survivors)


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
        recovery_s = _recovery_after(job, "kill", 1)
        assert recovery_s < FAST_S, (
            f"the survivors resumed {recovery_s:.2f} s after the kill: the dead worker's "
            "children kept its connections open")
        assert job.wait_exit(0) == 0 and job.wait_exit(2) == 0
        check_outcome(job, [0, 2])
    finally:
        for pid in map(int, pids.read_text().split() if pids.exists() else ()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
