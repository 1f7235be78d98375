"""End to end: real etcd, real worker processes, gloo on loopback, faults fired deterministically.

After every scenario the survivors hold identical parameters, the committed ledger shows every
sample index of every epoch exactly once (except the sampler's documented skipped tail), and the
final loss is under a threshold.
"""

from __future__ import annotations

import signal
from collections import Counter

import pytest

from tests.support.cli import WORKERS
from tests.support.harness import Job

SAMPLES = 480
EPOCHS = 3
LOSS_THRESHOLD = 0.05  # the noise floor is 1e-4; an untrained model is at ~1.3
ARGS = ["--epochs", str(EPOCHS), "--samples", str(SAMPLES), "--batch", "8",
        "--commit-every", "4"]


def check_outcome(job: Job, survivors: list[int]) -> list[dict]:
    """Asserts what every scenario must end with; returns the survivors' results."""
    results = [job.result(i) for i in survivors]
    first = results[0]
    for other in results[1:]:
        assert other["params"] == first["params"], "survivors ended with different parameters"
        assert other["ledger"] == first["ledger"]
    for epoch, seen in enumerate(first["ledger"]):
        counts = Counter(seen)
        repeated = sorted(i for i, c in counts.items() if c > 1)
        assert not repeated, f"epoch {epoch}: indices handed out twice: {repeated[:10]}"
        skipped = set(first["skipped"][epoch])
        assert len(skipped) < 4, f"epoch {epoch}: skipped {len(skipped)} >= world size"
        assert set(counts) | skipped == set(range(SAMPLES)), f"epoch {epoch}: indices lost"
        assert not set(counts) & skipped
    assert first["result"]["loss"] < LOSS_THRESHOLD, first["result"]
    return results


def test_survivors_finish_in_world_two_after_a_worker_is_killed(make_job):
    job = make_job(ARGS, {"FAULTS": "kill:2:20"})
    job.start_together(range(3))
    assert job.wait_exit(2) == -signal.SIGKILL
    assert job.fired("kill", 2)["world"] == 3
    assert job.wait_exit(0) == 0 and job.wait_exit(1) == 0
    check_outcome(job, [0, 1])
    worlds = [p["world"] for p in job.progress(0) if "loss" in p]
    assert worlds[0] == 3 and worlds[-1] == 2
    recoveries = [e for e in job.events() if e["event"] == "resumed" and e["reason"] == "failure"]
    assert len(recoveries) == 2 and all(e["world_size"] == 2 for e in recoveries)
    # The first round sends rank 0's state; the survivors already hold the same commit.
    for pid in {e["pid"] for e in recoveries}:
        assert [e["moved"] for e in job.events()
                if e["event"] == "state_synced" and e["pid"] == pid] == [True, False]


def test_a_users_own_runtime_error_leaves_run_on_its_rank_and_the_others_go_on(make_job):
    job = make_job(ARGS, {"FAULTS": "raise:1:12"})
    job.start_together(range(2))
    assert job.wait_exit(1) == 1, "the user's error must end the worker (no re-formation)"
    assert job.fired("raise", 1)["world"] == 2
    errors = [e for e in job.events() if e["event"] == "error"]
    assert len(errors) == 1 and "file closed" in errors[0]["error"], errors
    retried = [e for e in job.events() if e["event"] == "failure_detected"
               and e.get("member") == errors[0].get("member")]
    assert not retried, f"the failing rank treated its own error as a peer failure: {retried}"
    assert job.wait_exit(0) == 0
    check_outcome(job, [0])


def test_a_joiner_enters_at_the_next_commit_with_rank_zero_parameters(make_job):
    job = make_job(ARGS + ["--hold-at", "8"])
    job.start_together([0, 1])
    job.wait_step(0, 5)
    job.start(2)
    for i in range(3):
        assert job.wait_exit(i) == 0
    check_outcome(job, [0, 1, 2])
    resets = {i: [p for p in job.progress(i) if p.get("event") == "reset"] for i in range(3)}
    joined = resets[2][0]
    assert joined["world"] == 3
    rank0 = next(i for i in (0, 1) if any(r["world"] == 3 and r["rank"] == 0 for r in resets[i]))
    at_join = next(r for r in resets[rank0] if r["world"] == 3)
    assert joined["params"] == at_join["params"], "the joiner's parameters differ from rank 0's"
    assert joined["step"] == at_join["step"] > 0
    changes = [e for e in job.events() if e["event"] == "membership_changed"]
    assert changes, "the running members never agreed on the join at a commit"


def test_a_survivor_holding_the_newest_commit_moves_no_state_when_a_worker_joins(make_job):
    job = make_job(["--epochs", "1", "--samples", str(SAMPLES), "--batch", "8",
                    "--commit-every", "4", "--hold-at", "8"])
    job.start_together([0, 1])
    job.wait_step(0, 5)
    job.start(2)
    for i in range(3):
        assert job.wait_exit(i) == 0
    synced = {i: [e for e in job.events() if e["event"] == "state_synced"
                  and e["pid"] == job.procs[i].pid] for i in range(3)}
    at_join = {i: synced[i][-1] for i in range(3)}  # the joiner's only round
    assert len(synced[2]) == 1 and at_join[2]["moved"], synced[2]
    movers = [i for i in (0, 1) if at_join[i]["moved"]]
    assert len(movers) == 1, f"a survivor holding the source's commit moved state: {at_join}"
    holder = 1 - movers[0]
    assert at_join[holder]["bytes"] == 0 < at_join[2]["bytes"] == at_join[movers[0]]["bytes"]


def test_a_terminated_worker_leaves_at_once_without_waiting_for_its_lease(make_job):
    """The lease TTL is ten minutes: the survivors can finish within the waits' bounds only if
    the terminated worker left the job itself."""
    job = make_job(ARGS, {"FAULTS": "term:1:20", "ELASTIC_LEASE_TTL": "600"})
    job.start_together(range(3))
    assert job.wait_exit(1) == 0
    fired_at = job.fired("term", 1)["t"]
    assert job.wait_exit(0) == 0 and job.wait_exit(2) == 0
    check_outcome(job, [0, 2])
    resumed = [e for e in job.events() if e["event"] == "resumed" and e["t"] > fired_at
               and e["world_size"] == 2]
    assert resumed, "the survivors never resumed in world 2"
    assert any(e["event"] == "leaving" for e in job.events())


def test_a_frozen_worker_is_dropped_within_the_lease_and_stays_fenced(make_job):
    job = make_job(ARGS + ["--step-ms", "30"], {"FAULTS": "stop:1:12", "ELASTIC_LEASE_TTL": "2"})
    job.start_together(range(3))
    job.wait_until(lambda: (job.out / "fired-stop-1").exists(), 60, "the SIGSTOP to fire")
    fired_at = job.fired("stop", 1)["t"]
    # A hang guard, far below the other ways out (--rejoin-timeout 120 s, the collective
    # timeout); how soon after the lease TTL they go on is the recovery benchmark's claim.
    job.wait_until(lambda: any(p.get("world") == 2 and "loss" in p for p in job.progress(0)),
                   30, "the survivors to train in world 2")
    old_member = next(e["member"] for e in job.events()
                      if e["event"] == "joined" and e["pid"] == job.procs[1].pid)
    job.signal(1, signal.SIGCONT)
    for i in range(3):
        assert job.wait_exit(i) == 0
    check_outcome(job, [0, 2])
    later = [e for e in job.events() if e.get("member") == old_member and e["t"] > fired_at
             and e["event"] in ("round_formed", "state_synced", "resumed")]
    assert not later, f"the fenced member acted under its old identity: {later}"
    assert any(e["event"] == "reregistered" and e["previous_member"] == old_member
               for e in job.events())


def test_workers_waiting_for_a_frozen_peer_inside_the_commit_agreement_are_released(make_job):
    job = make_job(ARGS + ["--step-ms", "30"],
                   {"FAULTS": "stop-commit:1:12", "ELASTIC_LEASE_TTL": "2"})
    job.start_together(range(3))
    job.wait_until(lambda: (job.out / "fired-stop-commit-1").exists(), 60, "the SIGSTOP to fire")
    fired_at = job.fired("stop-commit", 1)["t"]
    # A hang guard, as in the test above.
    job.wait_until(lambda: any(p.get("world") == 2 and "loss" in p for p in job.progress(0)),
                   30, "the survivors to train in world 2")
    failures = [e for e in job.events() if e["event"] == "failure_detected"
                and e.get("source") == "collective" and e["t"] > fired_at]
    assert failures and all("membership agreement" in e["error"] for e in failures), failures
    job.signal(1, signal.SIGCONT)
    for i in range(3):
        assert job.wait_exit(i) == 0
    check_outcome(job, [0, 2])


def test_a_rank_0_killed_as_it_publishes_its_store_is_replaced_with_no_restart_in_place(make_job):
    job = make_job(ARGS, {"DIE_HOSTING_ROUND": "1"}, script=WORKERS / "dies_hosting.py")
    job.start_together(range(3))
    job.wait_until(lambda: any(p.poll() is not None for p in job.procs.values()), 60,
                   "round 1's rank 0 to die")
    victim = next(i for i, p in job.procs.items() if p.poll() is not None)
    assert job.wait_exit(victim) == -signal.SIGKILL
    survivors = [i for i in job.procs if i != victim]
    assert all(job.wait_exit(i) == 0 for i in survivors)
    check_outcome(job, survivors)
    events = job.events()
    stuck = [e for e in events if e["event"] == "restarting_in_place"]
    assert not stuck, f"a survivor stayed connecting to the dead rank 0's store: {stuck}"
    assert {e["world_size"] for e in events if e["event"] == "resumed"} == {2}


def test_too_few_workers_end_in_a_rendezvous_timeout_that_names_the_counts(make_job):
    job = make_job(ARGS, {"ELASTIC_MIN_WORKERS": "2", "ELASTIC_RENDEZVOUS_TIMEOUT": "2"})
    job.start(0)
    assert job.wait_exit(0, timeout=60) != 0
    log = (job.out / "worker-0.log").read_text()
    assert "RendezvousTimeoutError" in log
    assert "only 1 of min_workers=2" in log


def test_an_unreachable_etcd_fails_after_bounded_retries_naming_the_url(make_job, tmp_path):
    from elastic.cluster.links.ports import free_port
    url = f"http://127.0.0.1:{free_port()}"
    # Retries of 3 s, not the default 10 s: the bound is what is tested, not its default.
    job = make_job(ARGS, {"ELASTIC_ETCD": url, "ELASTIC_ETCD_RETRY": "3"})
    job.start(0)
    assert job.wait_exit(0, timeout=60) != 0  # a hang guard: unbounded retries never exit
    log = (job.out / "worker-0.log").read_text()
    assert "EtcdUnavailableError" in log and url in log


@pytest.mark.parametrize("loader", [[], ["--persistent-loader"]], ids=["per-call", "persistent"])
def test_a_killed_worker_with_dataloader_workers_keeps_samples_exactly_once(make_job, loader):
    # "persistent": one DataLoader made before run() with persistent_workers=True, whose
    # workers outlive the re-formation; the rolled-back sampler order reaches them anyway.
    job = make_job(ARGS + ["--loader-workers", "2", *loader], {"FAULTS": "kill:0:25"})
    job.start_together(range(3))
    assert job.wait_exit(0) == -signal.SIGKILL
    assert job.wait_exit(1) == 0 and job.wait_exit(2) == 0
    check_outcome(job, [1, 2])


def test_a_spare_beyond_max_workers_takes_over_when_a_worker_dies(make_job):
    job = make_job(ARGS + ["--step-ms", "30"], {"ELASTIC_MAX_WORKERS": "2"})
    job.start_together(range(3))
    job.wait_until(lambda: any(e["event"] == "spare" for e in job.events()), 60, "a spare")
    spare_pid = next(e["pid"] for e in job.events() if e["event"] == "spare")
    spare = next(i for i, p in job.procs.items() if p.pid == spare_pid)
    victim = next(i for i in job.procs if i != spare)
    job.wait_step(victim, 3)
    job.signal(victim, signal.SIGKILL)
    survivors = [i for i in job.procs if i != victim]
    assert job.wait_exit(victim) == -signal.SIGKILL
    assert all(job.wait_exit(i) == 0 for i in survivors)
    check_outcome(job, survivors)
    events = job.events()
    assert max(e["world_size"] for e in events if e["event"] == "resumed") == 2
    trained = [p for p in job.progress(spare) if "loss" in p]
    assert trained and all(p["world"] == 2 for p in trained)
