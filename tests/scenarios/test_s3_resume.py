"""The kill-and-resume round trip on s3:// against a real S3-protocol server (moto)."""

from __future__ import annotations

import json

from elastic.checkpoint import CheckpointStore
from tests.support.resume_scenario import model_params, resume, run_until_checkpoint


def test_a_killed_job_resumes_from_an_s3_checkpoint(make_job, s3_server, s3_url):
    # Workers get the endpoint and credentials the standard fsspec way: FSSPEC_S3 (JSON).
    env = {"ELASTIC_CHECKPOINT": s3_url, "FSSPEC_S3": json.dumps(s3_server)}
    store = CheckpointStore(s3_url, storage_options=s3_server)
    run_until_checkpoint(make_job, env, store, epoch=2)
    saved = store.latest()
    resume(make_job, env, saved.epoch, model_params(store, saved))
