"""End to end: a worker whose step stays blocked after a peer failure released its round.

gloo can leave a send blocked past the release of its group (README, Known limits); the
``stuck`` fault blocks the training thread the same way (a read that nothing ever answers)
right when another worker dies. Without a remedy the job waits ``--rejoin-timeout`` (120 s)
for the blocked member and that member waits for the collective timeout (30 minutes).
"""

from __future__ import annotations

import signal

from tests.scenarios.test_elastic_recovery import ARGS, check_outcome

GRACE_S = 2.0


def test_a_worker_blocked_after_its_round_was_released_restarts_in_place_and_rejoins(make_job):
    # From step 24 on, each commit waits until the world is 2 again: the restarted process
    # (a cold start: seconds of CPU, several times that on a loaded machine) rejoins before the
    # job can end without it, whatever the machine's load.
    job = make_job(ARGS + ["--step-ms", "100", "--hold-at", "24", "--hold-world", "2"],
                   {"FAULTS": "kill:1:20,stuck:2:20", "ELASTIC_RELEASE_GRACE": str(GRACE_S)})
    job.start_together(range(3))
    assert job.wait_exit(1) == -signal.SIGKILL
    stuck_at = job.fired("stuck", 2)["t"]
    job.wait_until(lambda: any(e["event"] == "restarting_in_place" for e in job.events()), 60,
                   "the blocked worker to restart in place")
    restart = next(e for e in job.events() if e["event"] == "restarting_in_place")
    # The release watchdog fired on its grace; the 60 s wait above is the hang guard.
    assert restart["grace_s"] == GRACE_S and restart["t"] > stuck_at, restart
    # The job went on without waiting for the blocked member's --rejoin-timeout (120 s) ...
    job.wait_until(lambda: any(e["event"] == "resumed" and e["t"] > restart["t"]
                               for e in job.events()), 60, "the job to go on")
    # ... and the restarted process (the same pid: its launcher keeps it) came back and finished.
    assert job.wait_exit(0) == 0 and job.wait_exit(2) == 0
    results = check_outcome(job, [0, 2])
    assert results[1]["params"] == results[0]["params"]
    rejoined = [e for e in job.events() if e["event"] == "joined" and e["t"] > restart["t"]]
    assert rejoined, "the restarted worker never registered again"


def test_every_survivor_in_a_long_step_at_a_death_waits_and_the_job_goes_on_from_its_commit(
        make_job):
    # Both survivors stay inside a step with no collective (5 s, past the 2 s grace) when the
    # third worker dies: nobody else holds their commit, so neither may restart in place.
    job = make_job(ARGS + ["--step-ms", "100"],
                   {"FAULTS": "slow:0:20,slow:2:20,kill:1:20", "SLOW_STEP_MS": "5000",
                    "ELASTIC_RELEASE_GRACE": str(GRACE_S)})
    job.start_together(range(3))
    assert job.wait_exit(1) == -signal.SIGKILL
    assert job.wait_exit(0) == 0 and job.wait_exit(2) == 0
    slow_at = job.fired("slow", 0)["step"]
    for index in (0, 2):
        resumed = [p for p in job.progress(index) if p.get("event") == "reset" and p["world"] == 2]
        assert resumed and resumed[0]["step"] >= slow_at - 4, \
            f"worker {index} went on from step {resumed[0]['step'] if resumed else None}, " \
            f"not from its last commit (step {slow_at - 4} or later)"
    assert any(e["event"] == "stuck_holding" for e in job.events()), \
        "the long step never outlasted the grace: the scenario tested nothing"
    check_outcome(job, [0, 2])


def test_a_worker_blocked_in_a_released_step_after_the_job_finished_restarts_and_ends_too(
        make_job):
    # The blocked worker is frozen past its lease, so the others go on without it and finish;
    # it wakes to a finished job, where no live member can hold its commit. Before its fix it
    # stayed for the collective timeout (30 minutes), "holding" a commit nobody needs.
    job = make_job(ARGS + ["--step-ms", "40"],
                   {"FAULTS": "stuck:1:8", "ELASTIC_LEASE_TTL": "2",
                    "ELASTIC_RELEASE_GRACE": str(GRACE_S)})
    job.start_together(range(3))
    job.wait_until(lambda: (job.out / "fired-stuck-1").exists(), 60, "worker 1 to block")
    job.signal(1, signal.SIGSTOP)
    try:
        assert job.wait_exit(0) == 0 and job.wait_exit(2) == 0
    finally:
        job.signal(1, signal.SIGCONT)
    assert job.wait_exit(1, timeout=60) == 0
    restart = [e for e in job.events() if e["event"] == "restarting_in_place"]
    assert restart and restart[0]["holder"] == "", restart
    check_outcome(job, [0, 2])
