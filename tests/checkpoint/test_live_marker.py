"""Which other jobs are live on a checkpoint URL: fresh markers of other job ids only."""

from __future__ import annotations

from datetime import timedelta

import pytest

from elastic.checkpoint.live_marker import LiveJob, LiveMarker

pytestmark = pytest.mark.unit
STALE = timedelta(seconds=30)


def test_only_another_jobs_fresh_marker_counts_as_live(tmp_path):
    LiveMarker(str(tmp_path), "other").touch(now=1000.0)
    LiveMarker(str(tmp_path), "ended").touch(now=900.0)
    (tmp_path / ".elastic-live-torn").write_text("{")
    mine = LiveMarker(str(tmp_path), "mine")
    mine.touch(now=1000.0)
    assert mine.others(STALE, now=1010.0) == [LiveJob("other", 10.0)]
    mine.remove()
    mine.remove()  # gone already is fine
    assert not (tmp_path / ".elastic-live-mine").exists()
