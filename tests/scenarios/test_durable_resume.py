"""Durable commits end to end: a job killed outright resumes from its checkpoint path."""

from __future__ import annotations

import signal
from pathlib import Path

from elastic.checkpoint import CheckpointStore
from tests.support.resume_scenario import model_params, resume, run_until_checkpoint


def test_a_killed_job_resumes_at_the_next_epoch_on_another_world_size(make_job, tmp_path):
    url = f"file://{tmp_path / 'ckpt'}"
    store = CheckpointStore(url)
    run_until_checkpoint(make_job, {"ELASTIC_CHECKPOINT": url}, store, epoch=2)
    saved = store.latest()
    assert saved.epoch >= 2 and saved.world_size == 3
    resume(make_job, {"ELASTIC_CHECKPOINT": url}, saved.epoch, model_params(store, saved))


def test_a_corrupt_newest_checkpoint_falls_back_to_the_one_before(make_job, tmp_path):
    url = str(tmp_path / "ckpt")
    store = CheckpointStore(url)
    run_until_checkpoint(make_job, {"ELASTIC_CHECKPOINT": url}, store, epoch=2)
    refs = store.list()
    assert len(refs) >= 2
    newest, previous = refs[-1], refs[-2]
    payload = Path(url) / f"{newest.step:012d}" / "state.pt"
    data = bytearray(payload.read_bytes())
    data[len(data) // 2] ^= 0xFF
    payload.write_bytes(bytes(data))
    job = resume(make_job, {"ELASTIC_CHECKPOINT": url}, previous.epoch,
                 model_params(store, previous))
    loaded = [e for e in job.events() if e["event"] == "checkpoint_loaded"]
    assert loaded and loaded[0]["version"] == previous.step


def test_durable_commits_are_written_by_rank_zero_only_and_recorded_as_events(make_job,
                                                                              tmp_path):
    url = str(tmp_path / "ckpt")
    job = make_job(["--epochs", "2", "--samples", "96"], {"ELASTIC_CHECKPOINT": url})
    for i in range(2):
        job.start(i)
    for i in range(2):
        assert job.wait_exit(i) == 0
    written = [e for e in job.events() if e["event"] == "checkpoint_written"]
    assert len(written) == 2 and all(e["rank"] == 0 for e in written)
    assert all(e["blocked_s"] < e["write_s"] for e in written)
    assert [r.epoch for r in CheckpointStore(url).list()] == [1, 2]


def test_durable_commits_still_land_after_a_resume_on_a_fresh_etcd_that_counts_rounds_from_one(
        make_job, make_private_job, tmp_path):
    url = str(tmp_path / "ckpt")
    env = {"ELASTIC_CHECKPOINT": url}
    store = CheckpointStore(url)
    args = ["--epochs", "20", "--samples", "480", "--batch", "8", "--step-ms", "100"]
    first = make_job(args, env)
    for index in range(3):  # one join at a time: rounds 1, 2 and 3
        first.start(index)
        first.wait_until(lambda: any(p.get("world") == index + 1 for p in first.progress(0)),
                         90, f"a world of {index + 1}")
    first.wait_until(lambda: any(ref.world_size == 3 for ref in store.list()), 120,
                     "a durable commit of round 3")
    for index in range(3):
        first.signal(index, signal.SIGKILL)
        first.wait_exit(index)
    before = store.latest().step

    resumed = make_private_job(args + ["--step-ms", "5"], env)
    resumed.start_together(range(2))
    for index in range(2):
        assert resumed.wait_exit(index) == 0, resumed.tails()
    events = resumed.events()
    failed = [e["error"] for e in events if e["event"] == "checkpoint_failed"]
    assert failed == [], "durable commits were refused after the resume"
    assert store.latest().step > before
