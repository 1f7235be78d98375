"""Checkpoint storage that cannot be reached: a job that holds commits trains on from them; a
resume, which holds none, stops in bounded time with one line."""

from __future__ import annotations

import json
import signal
import socket

import pytest

from tests.scenarios.test_elastic_recovery import SAMPLES, check_outcome
from tests.support.faulty_fs import PLAN_VARIABLE
from tests.support.resume_scenario import start_and_expect_refusal

# Two epochs: each durable commit fails only after its retries and a listing's timeout (about
# 5 s, one after another on rank 0's writer), and two show as much as three.
ARGS = ["--epochs", "2", "--samples", str(SAMPLES), "--batch", "8", "--commit-every", "4",
        "--step-ms", "100"]


READ_TIMEOUT_S = 15  # how long the S3 client waits for an answer that never comes


def test_storage_that_cannot_be_listed_at_a_re_formation_costs_warnings_not_the_job(make_job,
                                                                                    tmp_path):
    """Every listing and read fails (after its retries, 1 s) from the moment the switch is
    on: once the job trains, before a worker is killed."""
    switch = tmp_path / "storage-down"
    plan = {"read_failures": 10**6, "read_error": "busy", "fail_while": str(switch)}
    job = make_job(ARGS, {"ELASTIC_CHECKPOINT": f"faultfile://{tmp_path / 'ckpt'}",
                          PLAN_VARIABLE: json.dumps(plan), "ELASTIC_STORAGE_RETRY": "1"})
    job.start_together(range(3))
    job.wait_until(lambda: any(p.get("world") == 3 and "loss" in p for p in job.progress(0)), 90,
                   "a world of 3 training")
    switch.touch()
    job.signal(2, signal.SIGKILL)  # a re-formation, whose rank 0 lists the storage again
    codes = {i: job.wait_exit(i, timeout=180) for i in range(2)}
    logs = {i: (job.out / f"worker-{i}.log").read_text(errors="replace") for i in range(3)}
    # Both trained to the end, exactly once, from the commits in memory; rank 0 (the only
    # writer) says in one error that nothing of the run was saved if no write landed before.
    for i, code in codes.items():
        assert code == 0 or (code == 1 and "DurableCommitsFailedError: none of the durable "
                             "commits" in logs[i]), job.tails()
    check_outcome(job, [i for i, code in codes.items() if code == 0])
    assert "going on from the commits in memory" in "".join(logs.values()), job.tails()
    assert [e for e in job.events() if e["event"] == "checkpoint_failed"], \
        "the failed durable writes were not recorded"


@pytest.mark.xfail(run=False, reason="since main's 5ca8047 a worker started outside `elastic run` "
                   "first probes the URL (setup_check.check_checkpoint), and that probe is not "
                   "bounded by twice storage_retry: on a silent endpoint it waits out the S3 "
                   "client's read timeouts (over 120 s), before the resume is reached")
def test_a_resume_whose_s3_storage_never_answers_stops_within_twice_the_retry_time(make_job):
    """An S3 endpoint that accepts connections and never answers (the kernel completes the
    handshake into the listen backlog, nobody reads)."""
    with socket.create_server(("127.0.0.1", 0), backlog=128) as hole:
        silent = {"key": "k", "secret": "s", "client_kwargs": {
            "endpoint_url": f"http://127.0.0.1:{hole.getsockname()[1]}",
            "region_name": "us-east-1"},
            "config_kwargs": {"connect_timeout": 2, "read_timeout": READ_TIMEOUT_S,
                              "retries": {"max_attempts": 1}}}
        job = make_job(ARGS, {"ELASTIC_CHECKPOINT": "s3://nowhere/ckpt",
                              "FSSPEC_S3": json.dumps(silent), "ELASTIC_STORAGE_RETRY": "1"})
        start_and_expect_refusal(job, "s3://nowhere/ckpt")
    # The listing waited at most twice the retry time, never for the S3 client's read timeout.
    formed = min(e["t"] for e in job.events() if e["event"] == "round_formed")
    refused = [e["t"] for e in job.events() if e["event"] == "resume_refused"]
    assert len(refused) == 2 and max(refused) - formed < READ_TIMEOUT_S / 2, job.tails()
