"""``elastic report`` lists each reshard of sharded state with its bytes next to the minimum."""

from __future__ import annotations

import pytest

from elastic.launch.report import build_timeline, render_tables

pytestmark = pytest.mark.unit


def _resharded(t: float, rank: int, seconds: float) -> dict:
    return {"t": t, "event": "resharded", "round": 2, "rank": rank, "version": 3,
            "from_world": 4, "to_world": 3, "bytes_moved": 1248, "bytes_minimum": 1248,
            "bytes_lost": 640, "reshard_s": seconds}


def test_a_reshard_is_one_line_with_moved_minimum_and_lost_bytes_and_the_slowest_rank():
    events = [{"t": 100.0, "event": "resumed", "round": 1, "world_size": 4, "reason": "start"},
              _resharded(101.0, 0, 0.2), _resharded(101.1, 1, 0.35),
              {"t": 101.2, "event": "resumed", "round": 2, "world_size": 3,
               "reason": "failure"}]
    text = render_tables(build_timeline(events))
    assert ("resharded in round 2 at 1.00 s: world 4 -> 3, version 3: moved 1248 bytes "
            "(minimum 1248, dead ranks' shards 640), 0.35 s") in text
    assert text.count("resharded in round") == 1
