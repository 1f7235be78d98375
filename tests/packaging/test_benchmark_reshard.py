"""The reshard benchmark splits a survivor's way back into phases that add up to its first step,
reports the survivor that was ready last, and compares steady throughput over whole commit
intervals."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import reshard_steady  # noqa: E402
import reshard_timeline  # noqa: E402

pytestmark = pytest.mark.unit


def event(t: float, name: str, pid: int = 7, world: int = 6, **fields) -> dict:
    return {"t": t, "event": name, "pid": pid, "world_size": world, **fields}


def way_back(pid: int, shift: float = 0.0) -> list[dict]:
    """A survivor's events after a kill at t=100: detected at 101, round at 103, group at 104,
    rebuilt (1.5 s of parts) at 106, resumed at 106.5."""
    parts = {"choose_s": 0.1, "mesh_s": 0.1, "parallelize_s": 0.5, "state_dict_s": 0.1,
             "moves_s": 0.3, "load_s": 0.1, "commit_s": 0.3}
    return [event(99.0 + shift, "progress", pid, 8),
            event(101.0 + shift, "failure_detected", pid, 8),
            event(103.0 + shift, "round_formed", pid), event(104.0 + shift, "group_formed", pid),
            event(106.0 + shift, "rebuilt", pid, **parts),
            event(106.5 + shift, "resumed", pid)]


def test_a_recovery_is_split_into_phases_that_add_up_to_the_first_step():
    progress = [{"pid": 7, "world": 8, "step": 12, "t": 99.0},
                {"pid": 7, "world": 6, "step": 11, "t": 110.0}]
    split = reshard_timeline.split(way_back(7), progress, 7, 100.0, 6, "failure_detected")
    assert split is not None
    assert split["detection_s"] == pytest.approx(1.0)
    assert split["rendezvous_s"] == pytest.approx(2.0)
    assert split["group_s"] == pytest.approx(1.0)
    assert split["parallelize_s"] == pytest.approx(0.5)
    assert split["small_state_s"] == pytest.approx(0.5)  # 2 s to rebuilt, 1.5 s of parts
    assert split["first_step_s"] == pytest.approx(3.5)
    assert split["ready_s"] == pytest.approx(6.5)
    phases = [v for k, v in split.items() if k not in ("ready_s", "total_s")]
    assert sum(phases) == pytest.approx(split["total_s"]) == pytest.approx(10.0)


def test_the_survivor_ready_last_is_the_one_reported():
    events = sorted(way_back(7) + way_back(8, shift=0.7), key=lambda e: e["t"])
    progress = [{"pid": pid, "world": 6, "step": 11, "t": 120.0} for pid in (7, 8)]
    splits = {pid: reshard_timeline.split(events, progress, pid, 100.0, 6, "failure_detected")
              for pid in (7, 8)}
    pid, split = reshard_timeline.slowest(splits)
    assert pid == 8 and split["ready_s"] == pytest.approx(7.2)


def test_a_survivor_that_has_not_stepped_in_the_new_world_has_no_split():
    progress = [{"pid": 7, "world": 8, "step": 12, "t": 99.0}]
    assert reshard_timeline.split(way_back(7), progress, 7, 100.0, 6, "failure_detected") is None
    assert reshard_timeline.split(way_back(7)[:-1], progress, 7, 100.0, 6,
                                  "failure_detected") is None


def test_steady_throughput_counts_only_the_steps_after_the_warm_up():
    stamps = [5.0, 6.0, 7.0, 8.0]  # the first step ends late, then one step a second
    assert reshard_steady.throughput(stamps, 1) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="too few"):
        reshard_steady.throughput(stamps, 4)
