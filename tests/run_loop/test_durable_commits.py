"""The runner's side of durable commits: failed writes are reported and training goes on."""

from __future__ import annotations

import errno
import json
import threading
from datetime import timedelta

import pytest
import torch

from elastic.checkpoint import (CheckpointFencedError, CheckpointIncompatibleError,
                                CheckpointReadError,
                                CheckpointStorageError, CheckpointStore, CheckpointWriteError)
from elastic.cluster.etcd.client import EtcdClient
from elastic.cluster.fencing import claim_fencing_epoch
from elastic.cluster.rounds.keys import JobKeys
from elastic.cluster.rounds.membership import EtcdMembership
from elastic.durable import DurableCommits, fencing_generation, next_epoch
from elastic.foundation.events import EventLog
from elastic.foundation.timeouts import Timeouts
from tests.support.faulty_fs import PAYLOAD_FILES

URL = "faultmem://run"


def payload(value: float) -> dict:
    return {"version": 1, "objects": {"model": {"w": torch.full((64, 1024), value)},
                                      "epoch": 1}}


def test_a_storage_error_is_reported_and_the_next_durable_commit_still_lands(faulty_fs,
                                                                             tmp_path):
    events = EventLog(str(tmp_path), "w")
    durable = DurableCommits(URL, events)
    durable.write(payload(1.0), 1, {"epoch": 1, "generation": 1})
    durable.store.wait()
    faulty_fs.plan.fail_after_bytes = 10_000
    durable.write(payload(2.0), 2, {"epoch": 2, "generation": 1})  # returns at once
    durable.store.wait()
    assert faulty_fs.plan.fired == 1
    assert isinstance(durable.last_error, CheckpointWriteError)
    assert durable.survey()[0] == 1  # the previous checkpoint is still the newest valid
    durable.write(payload(3.0), 3, {"epoch": 3, "generation": 1})
    durable.close()
    assert durable.survey()[0] == 3
    kinds = [json.loads(line)["event"] for line in events.path.read_text().splitlines()]
    assert kinds == ["checkpoint_written", "checkpoint_failed", "checkpoint_written"]


def test_resuming_reads_the_newest_valid_checkpoint_and_checks_model_shapes(faulty_fs):
    durable = DurableCommits(URL)
    durable.write(payload(4.0), 4, {"epoch": 4})
    durable.store.wait()
    loaded = durable.load_latest(payload(0.0))
    assert torch.equal(loaded["objects"]["model"]["w"], torch.full((64, 1024), 4.0))
    wrong = {"version": 1, "objects": {"model": {"w": torch.zeros(3, 3)}, "epoch": 0}}
    with pytest.raises(CheckpointIncompatibleError) as info:
        durable.load_latest(wrong)
    assert "'model'" in str(info.value) and "(64, 1024)" in str(info.value)
    assert "(3, 3)" in str(info.value)
    durable.close()


def test_fencing_generations_of_a_later_epoch_outrank_every_round_of_an_earlier_one():
    assert fencing_generation(2, 1) > fencing_generation(1, 10_000_000)
    assert fencing_generation(1, 4) > fencing_generation(1, 3)


def test_a_fresh_etcd_claims_one_epoch_above_what_the_checkpoint_url_holds(tmp_path):
    store = CheckpointStore(str(tmp_path))
    assert next_epoch(store.list()) == 1
    store.save(1, {"w": torch.zeros(2)}, {"generation": 12})  # a round-only token (epoch 0)
    assert next_epoch(store.list()) == 1
    store.save(2, {"w": torch.zeros(2)}, {"generation": fencing_generation(3, 7)})
    assert next_epoch(store.list()) == 4


def test_after_a_resume_that_counts_rounds_from_one_the_next_durable_commit_lands(tmp_path):
    url = str(tmp_path / "ckpt")
    before = DurableCommits(url)
    before.arm(12, claim_epoch=lambda floor: floor, confirm_lease=lambda: True, floor=1)
    before.write(payload(1.0), 1, {"epoch": 1})
    before.close()
    resumed = DurableCommits(url)  # a fresh etcd: round 1 again, the epoch claimed anew
    resumed.arm(1, claim_epoch=lambda floor: floor, confirm_lease=lambda: True,
                floor=resumed.survey()[1])
    resumed.write(payload(2.0), 2, {"epoch": 2})
    resumed.close()
    assert resumed.last_error is None
    assert resumed.survey()[0] == 2


def test_a_writer_whose_lease_expired_before_publishing_never_publishes(tmp_path):
    events = EventLog(str(tmp_path), "w")
    durable = DurableCommits(str(tmp_path / "ckpt"), events)
    lease_alive = [True]
    durable.arm(3, claim_epoch=lambda floor: floor, confirm_lease=lambda: lease_alive[0],
                floor=1)
    durable.write(payload(1.0), 1, {"epoch": 1})
    durable.store.wait()
    lease_alive[0] = False  # frozen past its lease at the next commit(durable=True)
    durable.write(payload(2.0), 2, {"epoch": 2})
    durable.close()
    assert [ref.step for ref in durable.store.list()] == [1]
    # A fenced write is discarded, not a storage failure: it never reads as "nothing saved".
    assert durable.last_error is None
    discarded = [json.loads(line) for path in tmp_path.glob("*.jsonl")
                 for line in path.read_text().splitlines()]
    assert [(e["version"], e["fenced"]) for e in discarded
            if e["event"] == "checkpoint_failed"] == [(2, True)]


def test_a_confirmation_asks_etcd_so_a_revoked_lease_refuses_at_once(etcd):
    client = EtcdClient(etcd.url)
    membership = EtcdMembership(client, JobKeys("confirm-test"), "127.0.0.1",
                                Timeouts.from_env({}, lease_ttl=timedelta(seconds=30)))
    membership.register()
    try:
        assert membership.confirm_lease()
        client.revoke(membership.lease)  # what a frozen member finds when it wakes
        assert not membership.confirm_lease()
        assert membership.fenced.is_set()
    finally:
        membership.leave()
        client.close()


def test_an_error_of_any_type_on_the_writer_thread_is_recorded(tmp_path):
    durable = DurableCommits(str(tmp_path / "ckpt"))

    def broken_lease_check() -> bool:
        raise KeyError("not a CheckpointError")

    durable.arm(1, claim_epoch=lambda floor: floor, confirm_lease=broken_lease_check, floor=1)
    durable.write(payload(1.0), 1, {"epoch": 1})
    durable.close()
    assert isinstance(durable.last_error, KeyError)


def test_a_durable_commit_while_storage_hangs_is_skipped_after_the_retry_bound(faulty_fs,
                                                                              tmp_path):
    events = EventLog(str(tmp_path), "w")
    durable = DurableCommits(URL, events, retry_for=timedelta(seconds=0.5))
    release = threading.Event()
    faulty_fs.plan.gate = release  # the first write hangs until released
    try:
        durable.write(payload(1.0), 1, {"epoch": 1})
        assert faulty_fs.plan.started.wait(10)
        durable.write(payload(2.0), 2, {"epoch": 2})  # waits 0.5 s, then skips
    finally:
        release.set()
    durable.close()
    kinds = [json.loads(line)["event"] for line in events.path.read_text().splitlines()]
    assert kinds == ["checkpoint_skipped", "checkpoint_written"]
    assert durable.survey()[0] == 1


def test_a_failed_read_of_the_newest_checkpoint_is_an_error_never_a_resume_from_an_older_one(
        faulty_fs, caplog):
    # it may be intact: resuming from the one before would lose its steps for good (a later
    # save of them is refused, and retention prunes it)
    durable = DurableCommits(URL)
    for version in (1, 2):
        durable.write(payload(float(version)), version, {"epoch": version})
        durable.store.wait()
    faulty_fs.plan.read_target = PAYLOAD_FILES
    faulty_fs.plan.read_failures = 1  # an input/output error: not worth another try
    faulty_fs.plan.read_error = lambda: OSError(errno.EIO, "injected: input/output error")
    with pytest.raises(CheckpointReadError, match="000000000002.*injected"):
        durable.load_latest(payload(0.0))
    assert faulty_fs.plan.reads_failed == 1
    assert "falling back to an older one" not in caplog.text
    assert torch.equal(durable.load_latest(payload(0.0))["objects"]["model"]["w"],
                       torch.full((64, 1024), 2.0))  # once the storage answers: the newest
    durable.close()


def test_storage_that_never_answers_holds_at_most_one_thread_however_often_it_is_asked(
        faulty_fs):
    durable = DurableCommits(URL, retry_for=timedelta(seconds=0.2))
    faulty_fs.plan.read_gate = threading.Event()  # every listing hangs, as on a hard mount
    for _ in range(3):  # three formations
        with pytest.raises(CheckpointStorageError, match="did not answer|earlier call"):
            durable.survey()
    hung = [t for t in threading.enumerate() if t.name == "checkpoint-call"]
    assert len(hung) == 1, f"{len(hung)} threads wait on the storage"
    faulty_fs.plan.read_gate.set()
    hung[0].join(10)
    assert not hung[0].is_alive()
    assert durable.survey() == (0, 1)  # answered again: asked afresh


def test_a_write_fenced_by_another_job_on_the_url_is_a_failure_naming_that_job(tmp_path,
                                                                              caplog):
    url = str(tmp_path / "ckpt")
    events = EventLog(str(tmp_path), "a")
    ours = DurableCommits(url, events)
    ours.arm(3, claim_epoch=lambda floor: floor, confirm_lease=lambda: True, floor=1)
    ours.write(payload(1.0), 1, {"epoch": 1})
    ours.store.wait()
    theirs = DurableCommits(url)  # a second job on the same URL: one epoch above ours
    theirs.arm(1, claim_epoch=lambda floor: floor, confirm_lease=lambda: True,
               floor=theirs.survey()[1])
    theirs.write(payload(2.0), 2, {"epoch": 2, "job_id": "job-b"})
    theirs.close()
    ours.write(payload(3.0), 3, {"epoch": 3})  # this worker's lease is alive: it is current
    ours.close()
    assert isinstance(ours.last_error, CheckpointFencedError)
    assert "'job-b'" in caplog.text and str(fencing_generation(2, 1)) in caplog.text
    failed = [json.loads(line) for line in events.path.read_text().splitlines()
              if json.loads(line)["event"] == "checkpoint_failed"]
    assert [(e["version"], e["fenced"], e["stale"]) for e in failed] == [(3, True, True)]
    assert failed[0]["newer_job"] == "job-b"



class _StrayWriter(EtcdClient):
    """A real client whose every compare-and-swap loses: a stray value is put just before it."""

    def replace(self, key, value, mod_revision, **kwargs):  # type: ignore[override]
        self.put(key, "stray")
        return super().replace(key, value, mod_revision, **kwargs)


def test_a_fencing_epoch_that_cannot_be_claimed_fails_the_write_instead_of_training(etcd,
                                                                                    tmp_path):
    stray, key = _StrayWriter(etcd.url), JobKeys("durable-contested").fence
    durable = DurableCommits(str(tmp_path / "ckpt"))
    durable.arm(2, claim_epoch=lambda floor: claim_fencing_epoch(stray, key, floor),
                confirm_lease=lambda: True, floor=None)  # the formation could not list
    try:
        durable.write(payload(1.0), 1, {"epoch": 1})
        durable.close()
    finally:
        stray.close()
    assert type(durable.last_error).__name__ == "FencingContestedError"
    assert durable.store.list() == []
