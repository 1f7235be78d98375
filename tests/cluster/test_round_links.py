"""The order in which a round's channel, store and group are released and dropped (no I/O)."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest

from elastic.cluster.links.round_links import RoundLinks

pytestmark = pytest.mark.unit


class Part:
    """A channel, store or group that writes each call it gets into a shared log."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name = name
        self.log = log

    def release(self, reason: str) -> None:
        self.log.append(f"{self.name}.release({reason})")

    def abort(self, reason: str) -> None:
        self.log.append(f"{self.name}.abort({reason})")

    def close(self) -> None:
        self.log.append(f"{self.name}.close")

    def destroy(self) -> None:
        self.log.append(f"{self.name}.destroy")


@pytest.fixture
def log() -> list[str]:
    return []


def opened(log: list[str]) -> RoundLinks:
    links = RoundLinks(Part("group", log), Part("idle_channel", log))
    links.open(Part("store", log), Part("channel", log))
    log.clear()  # the idle channel was closed
    return links


def test_release_wakes_the_channel_then_the_store_then_the_group(log):
    opened(log).release("m1 left")

    assert log == ["channel.release(m1 left)", "store.abort(m1 left)", "group.release(m1 left)"]


def test_release_before_any_round_releases_the_channel_and_the_group(log):
    RoundLinks(Part("group", log), Part("idle_channel", log)).release("fenced")

    assert log == ["idle_channel.release(fenced)", "group.release(fenced)"]


def test_drop_destroys_the_group_and_only_then_closes_its_store_keeping_the_channel(log):
    opened(log).drop()

    assert log == ["group.destroy", "store.close"]


def test_the_retired_channel_is_closed_when_the_next_round_opens(log):
    links = opened(log)
    links.drop()
    log.clear()

    links.open(Part("store2", log), Part("channel2", log))

    assert log == ["channel.close"]


def test_closing_drops_the_round_and_then_closes_its_channel(log):
    opened(log).close()

    assert log == ["group.destroy", "store.close", "channel.close"]


def test_a_release_after_drop_never_touches_the_dropped_store(log):
    links = opened(log)
    links.drop()
    log.clear()

    links.release("late watch event")

    assert log == ["channel.release(late watch event)", "group.release(late watch event)"]


def test_the_next_round_releases_its_own_store_not_the_previous_one(log):
    links = opened(log)
    links.drop()
    links.open(Part("store2", log), Part("channel2", log))
    log.clear()

    links.release("m2 left")

    assert log == ["channel2.release(m2 left)", "store2.abort(m2 left)", "group.release(m2 left)"]


def test_opening_a_round_before_dropping_the_last_is_refused(log):
    links = opened(log)

    with pytest.raises(AssertionError, match="drop"):
        links.open(Part("store2", log), Part("channel2", log))


class SlowGroup(Part):
    """A group whose destroy blocks until the test lets it go, then fails if told to."""

    def __init__(self, log: list[str], fails: bool = False) -> None:
        super().__init__("group", log)
        self.go = threading.Event()
        self.fails = fails

    def destroy(self) -> None:
        assert self.go.wait(10)
        super().destroy()
        if self.fails:
            raise RuntimeError("gloo: destroying failed")


def test_a_drop_meanwhile_lets_the_caller_go_on_and_its_waiter_returns_once_it_is_done(log):
    group = SlowGroup(log)
    links = RoundLinks(group, Part("idle_channel", log))
    links.open(Part("store", log), Part("channel", log))
    log.clear()
    dropped = links.drop_meanwhile(timedelta(seconds=10))
    log.append("asked for the next round")  # while the group is being destroyed
    group.go.set()
    dropped()
    assert log == ["asked for the next round", "group.destroy", "store.close"]
    links.open(Part("next_store", log), Part("next_channel", log))  # the round was dropped


def test_the_waiter_of_a_drop_meanwhile_raises_what_the_drop_raised_or_that_it_is_late(log):
    failing = SlowGroup(log, fails=True)
    failing.go.set()
    with pytest.raises(RuntimeError, match="destroying failed"):
        RoundLinks(failing, Part("idle_channel", log)).drop_meanwhile(timedelta(seconds=10))()
    stuck = SlowGroup(log)
    try:
        with pytest.raises(TimeoutError, match="longer than"):
            RoundLinks(stuck, Part("idle_channel", log)).drop_meanwhile(
                timedelta(milliseconds=50))()
    finally:
        stuck.go.set()
