"""Malformed keys and values under a job's prefix never blind its members."""

from __future__ import annotations

import json
import signal

from elastic.cluster.etcd.client import EtcdClient
from elastic.cluster.rounds.keys import JobKeys
from tests.scenarios.test_elastic_recovery import ARGS, check_outcome


def plant_garbage(client: EtcdClient, keys: JobKeys) -> None:
    """Writes what no member ever writes under ``keys``, about the current round and the next."""
    current = int(client.get(keys.round).value)
    upcoming = current + 1
    client.put(keys.join(upcoming, "not-json"), b"{this is not json")
    client.put(keys.join(upcoming, "extra-field"),
               json.dumps({"member_id": "extra-field", "version": 1, "reason": "change",
                           "addr": "127.0.0.1", "surprise": True}))
    client.put(keys.join(upcoming, "wrong-types"), json.dumps({"member_id": 7, "version": "x"}))
    client.put(keys.prefix.encode() + b"members/\xff\xfe-not-utf8", b"\xff")
    client.put(keys.done(current, "nobody"), b"\x00\x01")
    client.put(f"{keys.rounds}not-a-number/plan", b"[]")


def test_garbage_under_the_job_prefix_mid_run_leaves_a_frozen_member_detected_in_time(
        make_job, etcd):
    job = make_job(ARGS + ["--step-ms", "40"], {"ELASTIC_LEASE_TTL": "2"})
    job.start_together(range(3))
    job.wait_until(lambda: any(p.get("world") == 3 and "loss" in p for p in job.progress(0)),
                   60, "a world of 3 training")
    client = EtcdClient(etcd.url)
    try:
        plant_garbage(client, JobKeys(job.env["ELASTIC_JOB_ID"]))
    finally:
        client.close()
    job.signal(1, signal.SIGSTOP)  # only its lease expiring, seen by the watch, can tell
    job.wait_until(lambda: any(p.get("world") == 2 and "loss" in p for p in job.progress(0)),
                   30, "the survivors to train in world 2")
    job.signal(1, signal.SIGCONT)
    for i in range(3):
        assert job.wait_exit(i) == 0, job.tails()
    check_outcome(job, [0, 2])
