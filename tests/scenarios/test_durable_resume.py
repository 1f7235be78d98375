"""Durable commits end to end: a job killed outright resumes from its checkpoint path."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from elastic.checkpoint import CheckpointStore
from elastic.cluster.etcd.client import EtcdClient
from elastic.cluster.rounds.keys import JobKeys
from tests.scenarios.test_elastic_recovery import check_outcome
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
    [name] = newest.manifest.files
    payload = Path(url) / f"{newest.step:012d}" / name
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
    # That a commit does not wait for its write is proven with a write held open, in
    # tests/run_loop/test_durable_commits.py (blocked_s < write_s here held by construction).
    assert [r.epoch for r in CheckpointStore(url).list()] == [1, 2]


def test_durable_commits_still_land_after_a_resume_on_a_fresh_etcd_that_counts_rounds_from_one(
        make_job, make_private_job, tmp_path):
    url = str(tmp_path / "ckpt")
    env = {"ELASTIC_CHECKPOINT": url}
    store = CheckpointStore(url)
    args = ["--samples", "480", "--batch", "8"]
    # Far more epochs than the kill leaves it: joining one at a time can take a minute under load.
    first = make_job(args + ["--epochs", "1000", "--step-ms", "100"], env)
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

    resumed = make_private_job(args + ["--epochs", str(store.latest().epoch + 2),
                                       "--step-ms", "5"], env)
    resumed.start_together(range(2))
    for index in range(2):
        assert resumed.wait_exit(index) == 0, resumed.tails()
    events = resumed.events()
    failed = [e["error"] for e in events if e["event"] == "checkpoint_failed"]
    assert failed == [], "durable commits were refused after the resume"
    assert store.latest().step > before


@pytest.mark.parametrize("woken, refused_by", [
    ("after the others' next durable commit", "has already written"),  # the store's generation
    ("once the others went on, before they commit", "lease expired"),  # its own lease check
])
def test_a_rank_zero_frozen_with_its_durable_write_in_flight_never_publishes_it(
        make_job, tmp_path, woken, refused_by):
    url = str(tmp_path / "ckpt")
    job = make_job(["--epochs", "3", "--samples", "480", "--batch", "8", "--step-ms", "100"],
                   {"ELASTIC_CHECKPOINT": url, "FAULTS": "stop-durable:r0:1", "BALLAST_MB": "64"})
    job.start_together(range(3))
    job.wait_until(lambda: (job.out / "fired-stop-durable-r0").exists(), 90,
                   "rank 0 to freeze inside its first durable write")
    frozen = job.fired("stop-durable", "r0")
    zombie = job.procs[frozen["index"]].pid

    def landed_after_the_freeze() -> list[dict]:
        return [e for e in job.events() if e["event"] == "checkpoint_written"
                and e["t"] > frozen["t"]]

    def went_on() -> bool:
        return any(e["event"] == "resumed" and e["world_size"] == 2 and e["t"] > frozen["t"]
                   for e in job.events())

    if refused_by == "lease expired":
        job.wait_until(went_on, 90, "the others to go on without the frozen rank 0")
        # Its heartbeats leave it out well before its lease ends: wake it once the lease did.
        member = next(e["member"] for e in job.events()
                      if e["event"] == "joined" and e["pid"] == zombie)
        client = EtcdClient(job.env["ELASTIC_ETCD"])
        try:
            key = JobKeys(job.env["ELASTIC_JOB_ID"]).member(member)
            job.wait_until(lambda: client.get(key) is None, 30, "the frozen rank 0's lease to end")
        finally:
            client.close()
        assert not landed_after_the_freeze(), "the others committed durably before the wake-up"
    else:
        job.wait_until(landed_after_the_freeze, 90, "the others to go on and commit durably")
    assert frozen["version"] not in [r.step for r in CheckpointStore(url).list()], \
        "the frozen write landed before the freeze: nothing was in flight to fence"
    job.signal(frozen["index"], signal.SIGCONT)  # the zombie wakes up, its write half done
    for index in range(3):
        assert job.wait_exit(index, timeout=180) == 0, job.tails()
    check_outcome(job, [0, 1, 2])
    assert frozen["version"] not in [r.step for r in CheckpointStore(url).list()], \
        "the zombie published after the job moved on"
    refused = [e for e in job.events() if e["event"] == "checkpoint_failed" and e["fenced"]
               and e["pid"] == zombie and e["version"] == frozen["version"]]
    assert refused and refused_by in refused[0]["error"], refused
