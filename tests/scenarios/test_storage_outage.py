"""Checkpoint storage that cannot be reached: the job trains on from the commits in memory."""

from __future__ import annotations

import json
import signal

from elastic.cluster.ports import free_port
from tests.scenarios.test_elastic_recovery import EPOCHS, SAMPLES, check_outcome

ARGS = ["--epochs", str(EPOCHS), "--samples", str(SAMPLES), "--batch", "8", "--commit-every", "4",
        "--step-ms", "100"]


def test_storage_that_cannot_be_listed_at_a_re_formation_costs_warnings_not_the_job(make_job):
    # An S3 endpoint where nothing listens: every listing and write fails after its retries.
    dead = {"key": "k", "secret": "s", "client_kwargs": {
        "endpoint_url": f"http://127.0.0.1:{free_port()}", "region_name": "us-east-1"}}
    job = make_job(ARGS, {"ELASTIC_CHECKPOINT": "s3://nowhere/ckpt",
                          "FSSPEC_S3": json.dumps(dead), "ELASTIC_STORAGE_RETRY": "1"})
    job.start_together(range(3))
    job.wait_until(lambda: any(p.get("world") == 3 and "loss" in p for p in job.progress(0)), 90,
                   "a world of 3 training")
    job.signal(2, signal.SIGKILL)  # a re-formation, whose rank 0 lists the storage again
    codes = {i: job.wait_exit(i, timeout=180) for i in range(2)}
    assert sorted(codes.values()) == [0, 1], job.tails()
    # Both trained to the end, exactly once, from the commits in memory; rank 0 (the only
    # writer) then says in one error that nothing of the run was saved.
    check_outcome(job, [i for i, code in codes.items() if code == 0])
    logs = {i: (job.out / f"worker-{i}.log").read_text(errors="replace") for i in codes}
    failed = next(i for i, code in codes.items() if code == 1)
    assert "DurableCommitsFailedError: none of the durable commits" in logs[failed]
    # Whichever was rank 0 of each round (the newest holder: it may change) warned once.
    assert "".join(logs.values()).count("going on from the commits in memory") >= 2, job.tails()
    assert [e for e in job.events() if e["event"] == "checkpoint_failed"], \
        "the failed durable writes were not recorded"
