"""Hostile input from etcd and from peers: nothing runs, and the job finishes without it.

Whoever can write the job's etcd prefix can ask to join with any commit version, or write any
bytes where join requests are read. Real etcd, real worker processes, gloo on loopback: the
honest workers hold at a commit until a change is agreed, the test then plants its input, and
the job must finish with the usual outcome (equal parameters, every sample exactly once) while
no marker of code run from the wire appears.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from elastic.cluster.etcd.client import EtcdClient
from elastic.cluster.rounds.keys import JobKeys
from tests.scenarios.test_elastic_recovery import ARGS, check_outcome
from tests.support.harness import Job
from tests.workers.hostile_member import HUGE, RunsCode

HOSTILE = Path(__file__).resolve().parents[1] / "workers" / "hostile_member.py"
HOLD = ["--hold-for-change-at", "8"]


def _start_and_hold(job: Job) -> None:
    """Starts two honest workers and waits until both hold at a commit."""
    job.start_together([0, 1])
    job.wait_until(lambda: all((job.out / f"holding-{i}").exists() for i in (0, 1)), 120,
                   "both workers to hold at a commit")


def _code_ran(job: Job) -> list[str]:
    return sorted(path.name for path in job.out.glob("code-ran-*"))


@pytest.mark.timeout(300)
def test_a_member_claiming_the_newest_commit_cannot_run_code_and_the_job_finishes(make_job):
    job = make_job(ARGS + HOLD)
    _start_and_hold(job)
    job.start(2, script=HOSTILE)
    assert job.wait_exit(2) == 0, job.tails()
    sent = json.loads((job.out / "hostile-sent").read_text())
    assert sent["world"] == 3, "the hostile member was not rank 0 of a round with both workers"
    assert job.wait_exit(0) == 0 and job.wait_exit(1) == 0
    assert not _code_ran(job), "a worker unpickled what the hostile member sent"
    check_outcome(job, [0, 1])
    refused = [e for e in job.events() if e["event"] == "failure_detected"
               and e.get("round") == sent["round"] and "refused the state" in e.get("error", "")]
    assert len({e["member"] for e in refused}) == 2, "both workers refused the hostile state"


def _planted(out: Path, member_key: str) -> dict[str, bytes]:
    """Join requests no honest worker wrote, by the member id in their key."""
    def request(**fields) -> bytes:
        record = {"member_id": "", "version": 1, "reason": "start", "addr": "127.0.0.1",
                  "port": 29500}
        record.update(fields)
        return json.dumps(record).encode()

    return {
        "ghost": request(member_id="ghost", version=HUGE),  # well formed, never registered
        "pickled": pickle.dumps(RunsCode(str(out))),
        "not-json": b"\xff{{",
        "huge": request(member_id="huge", version=10**30),
        "typed": request(member_id="typed", version="7", port="x"),
        "ranges": request(member_id="ranges", version=-1, port=70000),
        "renamed": request(member_id=member_key),  # claims to be a live worker
        "extra": request(member_id="extra", __class__="os.system"),
        "not-a-dict": b"[1, 2, 3]",
    }


@pytest.mark.timeout(300)
def test_planted_and_malformed_join_requests_are_skipped_with_one_warning_each(make_job, etcd):
    job = make_job(ARGS + HOLD)
    _start_and_hold(job)
    keys = JobKeys(job.env["ELASTIC_JOB_ID"])
    client = EtcdClient(etcd.url)
    try:
        live = [kv.key[len(keys.members):] for kv in client.get_prefix(keys.members)[0]]
        next_round = int(client.get(keys.round).value) + 1
        planted = _planted(job.out, live[0])
        first, *rest = planted  # one transaction: no round can close between two of them
        assert client.create(keys.join(next_round, first), planted[first],
                             also={keys.join(next_round, name): planted[name] for name in rest})
    finally:
        client.close()
    assert job.wait_exit(0) == 0 and job.wait_exit(1) == 0
    assert not _code_ran(job)
    check_outcome(job, [0, 1])
    # Only the job's coordinator reads join requests (cluster/rounds/coordinator.py): once in
    # the job.
    logs = [(job.out / f"worker-{index}.log").read_text() for index in (0, 1)]
    for name in planted:
        key = keys.join(next_round, name)
        warned = [log.count(key) for log in logs]
        assert sum(warned) == 1, f"{key} warned {warned} times by the workers"
