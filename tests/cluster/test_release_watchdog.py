"""The release watchdog on its own: a release not followed by a drop within the grace."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest

from elastic.cluster.links.release_watchdog import ReleaseWatchdog

pytestmark = pytest.mark.unit

GRACE = timedelta(seconds=0.2)
WAIT_S = 10


class Verdicts:
    def __init__(self) -> None:
        self.reasons: list[str] = []
        self.called = threading.Event()

    def __call__(self, reason: str) -> None:
        self.reasons.append(reason)
        self.called.set()


def test_a_release_not_dropped_within_the_grace_calls_on_stuck_once_with_its_reason():
    verdicts = Verdicts()
    watchdog = ReleaseWatchdog(GRACE, verdicts)
    watchdog.arm("member a is gone")
    watchdog.arm("member b is gone")  # the same release, told twice
    assert verdicts.called.wait(WAIT_S)
    assert verdicts.reasons == ["member a is gone"]
    assert not watchdog.is_armed


def test_a_drop_within_the_grace_calls_nothing():
    verdicts = Verdicts()
    watchdog = ReleaseWatchdog(GRACE, verdicts)
    watchdog.arm("member a is gone")
    watchdog.disarm()
    assert not verdicts.called.wait(GRACE.total_seconds() * 5)
    assert not watchdog.is_armed


def test_after_a_drop_the_next_release_is_watched_again():
    verdicts = Verdicts()
    watchdog = ReleaseWatchdog(GRACE, verdicts)
    watchdog.arm("first")
    watchdog.disarm()
    watchdog.arm("second")
    assert verdicts.called.wait(WAIT_S)
    assert verdicts.reasons == ["second"]
