"""Checkpoint storage that cannot be reached: the job trains on from the commits in memory."""

from __future__ import annotations

import contextlib
import json
import signal
import socket

import pytest

from elastic.cluster.links.ports import free_port
from tests.scenarios.test_elastic_recovery import SAMPLES, check_outcome

# Two epochs: each durable commit fails only after its retries and a listing's timeout (about
# 5 s, one after another on rank 0's writer), and two show as much as three.
ARGS = ["--epochs", "2", "--samples", str(SAMPLES), "--batch", "8", "--commit-every", "4",
        "--step-ms", "100"]


READ_TIMEOUT_S = 15  # how long the S3 client waits for an answer that never comes


@contextlib.contextmanager
def s3_endpoint(kind: str):
    """The port of an S3 endpoint where nothing listens ("refused": every call fails at once),
    or of one that accepts connections and never answers ("silent": the kernel completes the
    handshake into the listen backlog, nobody reads)."""
    if kind == "refused":
        yield free_port()
        return
    with socket.create_server(("127.0.0.1", 0), backlog=128) as hole:
        yield hole.getsockname()[1]


@pytest.mark.parametrize("kind", ["refused", "silent"])
def test_storage_that_cannot_be_listed_at_a_re_formation_costs_warnings_not_the_job(make_job,
                                                                                    kind):
    with s3_endpoint(kind) as port:
        run_and_kill_one(make_job, port)


def run_and_kill_one(make_job, port: int) -> None:
    """Every listing and write fails (or never answers) after its retries (1 s)."""
    dead = {"key": "k", "secret": "s", "client_kwargs": {
        "endpoint_url": f"http://127.0.0.1:{port}", "region_name": "us-east-1"},
        "config_kwargs": {"connect_timeout": 2, "read_timeout": READ_TIMEOUT_S,
                          "retries": {"max_attempts": 1}}}
    job = make_job(ARGS, {"ELASTIC_CHECKPOINT": "s3://nowhere/ckpt",
                          "FSSPEC_S3": json.dumps(dead), "ELASTIC_STORAGE_RETRY": "1"})
    job.start_together(range(3))
    job.wait_until(lambda: any(p.get("world") == 3 and "loss" in p for p in job.progress(0)), 90,
                   "a world of 3 training")
    job.signal(2, signal.SIGKILL)  # a re-formation, whose rank 0 lists the storage again
    codes = {i: job.wait_exit(i, timeout=180) for i in range(2)}
    # The survivors' new round waited for the listing at most twice the retry time, never for
    # the S3 client's read timeout.
    detected = min(e["t"] for e in job.events() if e["event"] == "failure_detected")
    resumed = [e["t"] for e in job.events() if e["event"] == "resumed" and e["t"] > detected]
    assert resumed and resumed[0] - detected < READ_TIMEOUT_S / 2, job.tails()
    assert sorted(codes.values()) == [0, 1], job.tails()
    # Both trained to the end, exactly once, from the commits in memory; rank 0 (the only
    # writer) then says in one error that nothing of the run was saved.
    check_outcome(job, [i for i, code in codes.items() if code == 0])
    logs = {i: (job.out / f"worker-{i}.log").read_text(errors="replace") for i in range(3)}
    failed = next(i for i, code in codes.items() if code == 1)
    assert "DurableCommitsFailedError: none of the durable commits" in logs[failed]
    # Whichever was rank 0 of each round (the newest holder: it may change, and the first
    # round's may be the worker killed) warned once.
    assert "".join(logs.values()).count("going on from the commits in memory") >= 2, job.tails()
    assert [e for e in job.events() if e["event"] == "checkpoint_failed"], \
        "the failed durable writes were not recorded"
