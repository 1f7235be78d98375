"""etcd outages: training goes on without etcd; re-forming waits for it within a budget."""

from __future__ import annotations

import signal
import time

from elastic.checkpoint import CheckpointStore
from tests.scenarios.test_elastic_recovery import EPOCHS, SAMPLES, check_outcome
from tests.support.harness import Job

# Several times every wait a worker has on etcd (the 2 s lease, the 3 s retry deadline set
# below, connect and ping), as the minute-long freeze of issue 14 was with the defaults.
OUTAGE_S = 20


def train_args(step_ms: int) -> list[str]:
    return ["--epochs", str(EPOCHS), "--samples", str(SAMPLES), "--batch", "8",
            "--commit-every", "4", "--step-ms", str(step_ms)]


# Long enough that training spans the outage: about 30 s of steps in a world of 3.
LONG_ARGS = train_args(200)
SHORT_ARGS = train_args(100)
ENV = {"ELASTIC_LEASE_TTL": "2"}


def steps_after(job: Job, t: float) -> int:
    return sum(1 for p in job.progress(0) if "loss" in p and p["t"] > t)


def training_in_world(job: Job, world: int) -> bool:
    return any(p.get("world") == world and "loss" in p for p in job.progress(0))


def test_training_and_durable_commits_go_on_through_an_etcd_freeze_of_many_retry_deadlines(
        make_private_job, private_etcd, tmp_path):
    job = make_private_job(LONG_ARGS, {**ENV, "ELASTIC_ETCD_RETRY": "3",
                                       "ELASTIC_CHECKPOINT": str(tmp_path / "ckpt")})
    job.start_together(range(3))
    job.wait_until(lambda: training_in_world(job, 3), 60, "a world of 3 training")
    private_etcd.pause()
    frozen_at = time.time()
    try:
        job.wait_until(lambda: time.time() - frozen_at > OUTAGE_S, OUTAGE_S + 10,
                       f"{OUTAGE_S} s of frozen etcd")
        trained = steps_after(job, frozen_at)
        late = steps_after(job, frozen_at + OUTAGE_S / 2)
    finally:
        private_etcd.resume()
    # A job that stalled would make none; how many is a matter of the machine's load.
    assert trained > 5 and late > 0, f"{trained} steps while etcd was frozen, {late} in its " \
        "second half"
    landed = [e for e in job.events() if e["event"] == "checkpoint_written"
              and frozen_at < e["t"] < frozen_at + OUTAGE_S]
    assert landed, "no durable commit landed while etcd was frozen"
    for i in range(3):
        assert job.wait_exit(i, timeout=180) == 0, job.tails()
    check_outcome(job, [0, 1, 2])


def test_training_goes_on_while_etcd_is_killed_and_restarted_on_its_data(make_private_job,
                                                                        private_etcd):
    job = make_private_job(SHORT_ARGS, ENV)
    job.start_together(range(3))
    job.wait_until(lambda: training_in_world(job, 3), 60, "a world of 3 training")
    private_etcd.process.kill()  # SIGKILL: no goodbye to anyone
    private_etcd.process.wait(timeout=10)
    killed_at = time.time()
    job.wait_until(lambda: steps_after(job, killed_at) > 20, 60, "training without etcd")
    private_etcd.restart()
    for i in range(3):
        assert job.wait_exit(i, timeout=180) == 0, job.tails()
    check_outcome(job, [0, 1, 2])
    fenced = [e for e in job.events() if e["event"] == "reregistered"]
    assert not fenced, "etcd keeps leases across a restart: nobody should have re-registered"


def test_survivors_of_a_worker_killed_while_etcd_is_down_re_form_once_it_returns(
        make_private_job, private_etcd):
    # Their re-formation tells that etcd is unreachable once a request's retries ran out: 3 s,
    # not the default 10 s, so that the outage they wait through is known sooner.
    # Three epochs: survivors whose leases ran out in the outage may re-form as 1 and then 2,
    # and after two epochs that path can end over the outcome's loss threshold.
    job = make_private_job(SHORT_ARGS, {**ENV, "ELASTIC_ETCD_RETRY": "3"})
    job.start_together(range(3))
    job.wait_until(lambda: training_in_world(job, 3), 60, "a world of 3 training")
    private_etcd.pause()
    try:
        job.signal(2, signal.SIGKILL)
        killed_at = time.time()
        job.wait_until(lambda: any(e["event"] == "etcd_unreachable" and e["t"] > killed_at
                                   for e in job.events()), 60,
                       "the survivors to wait for etcd")
    finally:
        private_etcd.resume()
    job.wait_until(lambda: training_in_world(job, 2), 90, "the survivors to train in world 2")
    for i in range(2):
        assert job.wait_exit(i, timeout=180) == 0, job.tails()
    check_outcome(job, [0, 1])


def test_a_job_whose_etcd_lost_its_data_re_forms_once_and_its_durable_commits_still_land(
        make_private_job, private_etcd, tmp_path):
    url = str(tmp_path / "ckpt")
    job = make_private_job(SHORT_ARGS, {**ENV, "ELASTIC_CHECKPOINT": url})
    job.start_together(range(3))
    job.wait_until(lambda: training_in_world(job, 3), 60, "a world of 3 training")
    # Taken before the restart returns: a worker may re-register (and the job re-form) as soon
    # as the fresh etcd answers, while the restart still waits for its health probe.
    lost_at = time.time()
    private_etcd.restart(lose_data=True)  # the same URL, no leases, rounds counted from 1
    for i in range(3):
        assert job.wait_exit(i, timeout=180) == 0, job.tails()
    check_outcome(job, [0, 1, 2])
    events = [e for e in job.events() if e["t"] > lost_at]
    reregistered = {e["pid"] for e in events if e["event"] == "reregistered"}
    assert reregistered == {job.procs[i].pid for i in range(3)}, "some did not re-register"
    rounds = {e["round"] for e in events if e["event"] == "round_formed"}
    assert len(rounds) == 1, f"re-formed {len(rounds)} times after the loss: {sorted(rounds)}"
    written = [e for e in events if e["event"] == "checkpoint_written"]
    assert written and not [e for e in events if e["event"] == "checkpoint_failed"], \
        "durable commits stopped landing after the loss"
    assert CheckpointStore(url).latest().epoch == EPOCHS
