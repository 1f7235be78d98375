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


def test_a_drop_that_comes_while_the_verdict_is_reached_waits_for_the_verdict():
    entered, verdict_given = threading.Event(), threading.Event()

    def slow_verdict(reason: str) -> bool:
        entered.set()
        verdict_given.wait(WAIT_S)  # the verdict (etcd reads, or a restart) takes a while
        return False

    watchdog = ReleaseWatchdog(GRACE, slow_verdict)
    watchdog.arm("member a is gone")
    assert entered.wait(WAIT_S)
    dropped = threading.Event()
    threading.Thread(target=lambda: (watchdog.disarm(), dropped.set()), daemon=True).start()
    assert not dropped.wait(GRACE.total_seconds() * 5), \
        "the training thread went on into the next round while its process was judged stuck"
    verdict_given.set()
    assert dropped.wait(WAIT_S)


def test_a_verdict_to_wait_is_asked_again_after_another_grace_until_the_drop():
    asked = Verdicts()
    calls: list[str] = []

    def wait_twice(reason: str) -> bool:
        calls.append(reason)
        if len(calls) < 3:
            return True
        asked(reason)
        return True

    watchdog = ReleaseWatchdog(GRACE, wait_twice)
    watchdog.arm("member a is gone")
    assert asked.called.wait(WAIT_S)
    assert calls == ["member a is gone"] * 3
    watchdog.disarm()
    assert not watchdog.is_armed
