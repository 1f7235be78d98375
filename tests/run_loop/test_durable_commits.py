"""The runner's side of durable commits: failed writes are reported and training goes on."""

from __future__ import annotations

import json

import pytest
import torch

from elastic.checkpoint import CheckpointIncompatibleError, CheckpointWriteError
from elastic.durable import DurableCommits
from elastic.events import EventLog

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
    assert durable.latest_version() == 1  # the previous checkpoint is still the newest valid
    durable.write(payload(3.0), 3, {"epoch": 3, "generation": 1})
    durable.close()
    assert durable.latest_version() == 3
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
