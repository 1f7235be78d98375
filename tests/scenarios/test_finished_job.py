"""End to end: what a finished job leaves on its etcd (a user's, shared with other jobs), and
what a worker that comes after it is told."""

from __future__ import annotations

from elastic.cluster.etcd.client import EtcdClient
from elastic.cluster.rounds.keys import JobKeys
from tests.scenarios.test_elastic_recovery import ARGS, check_outcome


def _keys_left(job, etcd) -> list:
    client = EtcdClient(etcd.url)
    try:
        left, _ = client.get_prefix(JobKeys(job.env["ELASTIC_JOB_ID"]).prefix)
    finally:
        client.close()
    return left


def test_a_finished_job_leaves_no_keys_without_a_lease_under_its_prefix(make_job, etcd):
    job = make_job(ARGS)
    job.start_together(range(2))
    assert job.wait_exit(0) == 0 and job.wait_exit(1) == 0
    check_outcome(job, [0, 1])
    unleased = [kv.key for kv in _keys_left(job, etcd) if not kv.lease]
    assert unleased == [], f"{len(unleased)} keys without a lease left behind: {unleased}"


def test_a_worker_that_comes_after_the_job_finished_is_told_so_and_trains_nothing(make_job,
                                                                                  etcd):
    job = make_job(ARGS)
    job.start_together(range(2))
    assert job.wait_exit(0) == 0 and job.wait_exit(1) == 0
    late = job.start(2)  # e.g. one that restarted in place and was slow to register again
    assert job.wait_exit(2) == 0
    told = [e for e in job.events() if e["event"] == "job_finished" and e["pid"] == late.pid]
    assert told, f"the late worker was not told that the job finished\n{job.tails()}"
    trained = [p for p in job.progress(2) if "loss" in p]
    assert not trained, f"the late worker started the job again: {len(trained)} steps"
    unleased = [kv.key for kv in _keys_left(job, etcd) if not kv.lease]
    assert unleased == [], f"the late worker left keys without a lease: {unleased}"
