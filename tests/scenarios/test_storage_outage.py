"""Checkpoint storage that cannot be reached: a job that holds commits trains on from them; a
resume, which holds none, stops in bounded time with one line."""

from __future__ import annotations

import json
import signal
import socket

from tests.scenarios.test_elastic_recovery import SAMPLES, check_outcome
from tests.support.faulty_fs import PLAN_VARIABLE

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


def test_a_worker_whose_s3_storage_never_answers_stops_at_its_probe_within_twice_the_retry_time(make_job):
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
        job.start_together(range(2))
        codes = [job.wait_exit(i, timeout=120) for i in range(2)]
    assert codes == [1, 1], job.tails()
    for i in range(2):
        last = (job.out / f"worker-{i}.log").read_text(errors="replace").strip().splitlines()[-1]
        # The bound fired, not the S3 client's read timeout (that would name ReadTimeoutError).
        assert "s3://nowhere/ckpt" in last and "did not answer a probe write" in last, job.tails()
    assert not [p for i in range(2) for p in job.progress(i) if "loss" in p], job.tails()
