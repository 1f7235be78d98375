"""Checkpoint storage that fails while a job resumes: retried, or one line; never a fresh start.

The workers see the checkpoint URL through ``faultfile://`` (``tests/support/faulty_fs.py``):
local files whose first reads fail the way S3 answers a 503 (``OSError(EBUSY)`` from s3fs).
"""

from __future__ import annotations

import json
import os

from elastic.checkpoint import CheckpointStore
from tests.support.faulty_fs import PAYLOAD_FILES, PLAN_VARIABLE
from tests.support.resume_scenario import (ARGS, model_params, resume, run_until_checkpoint,
                                           start_and_expect_refusal)


def test_a_resume_whose_first_reads_fail_goes_on_from_the_newest_checkpoint(make_job, tmp_path):
    path = tmp_path / "ckpt"
    store = CheckpointStore(str(path))
    run_until_checkpoint(make_job, {"ELASTIC_CHECKPOINT": str(path)}, store, epoch=2)
    saved = store.latest()
    flaky = {"ELASTIC_CHECKPOINT": f"faultfile://{path}",
             PLAN_VARIABLE: json.dumps({"read_failures": 2, "read_error": "busy"})}
    resume(make_job, flaky, saved.epoch, model_params(store, saved))


def test_a_resume_whose_storage_stays_unreadable_stops_with_one_line_naming_the_url(make_job,
                                                                                  tmp_path):
    url = f"faultfile://{tmp_path / 'ckpt'}"
    job = make_job(ARGS, {"ELASTIC_CHECKPOINT": url, "ELASTIC_STORAGE_RETRY": "1",
                          PLAN_VARIABLE: json.dumps({"read_failures": 10**6, "read_error": "busy"})})
    assert "injected: 503" in start_and_expect_refusal(job, url)


def test_a_checkpoint_write_that_hangs_at_exit_ends_the_worker_with_one_line_in_bounded_time(
        make_job, tmp_path):
    gate, started = tmp_path / "gate", tmp_path / "write-started"
    os.mkfifo(gate)  # never opened for writing: every payload write hangs, as on a hard mount
    plan = {"target": PAYLOAD_FILES, "gate_fifo": str(gate), "started_marker": str(started)}
    job = make_job(["--epochs", "1", "--samples", "96"],
                   {"ELASTIC_CHECKPOINT": f"faultfile://{tmp_path / 'ckpt'}",
                    PLAN_VARIABLE: json.dumps(plan), "ELASTIC_FINAL_WRITE_TIMEOUT": "2"})
    job.start(0)
    assert job.wait_exit(0, timeout=90) == 1, job.tails()
    assert started.exists(), "the checkpoint write never started"
    last = (job.out / "worker-0.log").read_text(errors="replace").strip().splitlines()[-1]
    assert "the last checkpoint write did not finish" in last, job.tails()
    waited = [e for e in job.events() if e["event"] == "checkpoint_unfinished"]
    assert [e["waited_s"] for e in waited] == [2.0]
