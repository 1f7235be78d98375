"""The console's story lines, from event records as a worker emits them (no I/O)."""

from __future__ import annotations

import io

import pytest

from elastic.console_story import MARK, ConsoleStory

pytestmark = pytest.mark.unit


def resumed(reason: str, world: int, rank: int = 0, **fields: object) -> dict[str, object]:
    return {"event": "resumed", "reason": reason, "world_size": world, "rank": rank,
            "round": 3, "recovery_s": 0.094, "version": 7, **fields}


def told(records: list[dict[str, object]], mode: str = "plain") -> list[str]:
    out = io.StringIO()
    story = ConsoleStory(mode, out)
    for record in records:
        story(record)
    return [line for line in out.getvalue().split("\n") if line]  # (\x1e: no splitlines)


def test_a_failure_tells_the_world_change_its_time_and_the_steps_rolled_back():
    lines = told([resumed("start", 3, step=0), resumed("failure", 2, step=1234, rolled_back=3)])
    assert lines[-1] == ("elastic: re-formed after a failure: world 3 -> 2 in 0.09 s, "
                         "rolled back 3 steps to step 1234")


def test_a_join_tells_the_world_change_and_how_long_the_running_workers_paused():
    lines = told([resumed("start", 2), resumed("change", 3, recovery_s=0.12)])
    assert lines == ["elastic: formed: world 2 in 0.09 s (round 3)",
                     "elastic: joined: world 2 -> 3 (running workers paused 0.12 s)"]


def test_a_resume_from_a_checkpoint_names_the_url_epoch_step_version_and_world():
    lines = told([{"event": "checkpoint_loaded", "rank": 0, "version": 41, "epoch": 4,
                   "url": "s3://b/run-7/000000000041"},
                  resumed("start", 3, step=9120)])
    assert lines == ["elastic: resumed from s3://b/run-7/000000000041 at epoch 4, step 9120 "
                     "(version 41, world 3)"]


def test_a_durable_checkpoint_tells_its_version_size_and_time():
    lines = told([{"event": "checkpoint_written", "rank": 0, "version": 42,
                   "bytes": 1_234_000_000, "write_s": 3.14}])
    assert lines == ["elastic: durable checkpoint v42 written (1.2 GB, 3.1 s)"]


def test_only_rank_0_tells_the_story_and_quiet_tells_nothing():
    assert told([resumed("failure", 2, rank=1, step=5, rolled_back=1)]) == []
    assert told([resumed("start", 2)], mode="quiet") == []


def test_under_the_launcher_each_line_is_marked_for_it():
    assert told([resumed("start", 2)], mode="launcher")[0].startswith(MARK + "elastic: formed")
