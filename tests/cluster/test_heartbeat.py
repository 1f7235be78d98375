"""Heartbeats on the agreement connections: when a silent peer counts as frozen (pure rules,
an injected clock), and the channel's watch over real loopback sockets, its ranks threads of
this process. A frozen rank here is one whose watch never runs: its kernel still answers."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest

from elastic.cluster.links.agreement_channel import AgreementChannel
from elastic.cluster.links.heartbeat import ABANDON, BEAT, PAUSING, PeerPulse
from elastic.cluster.links.pulse_process import PulseProcess
from tests.cluster.test_agreement_channel import _close, _connected, _in_threads
from tests.support.polling import poll_until

pytestmark = pytest.mark.timeout(60)

FROZEN_S = 0.5
BEAT_EVERY = timedelta(seconds=0.05)
FROZEN = timedelta(seconds=FROZEN_S)


def test_a_peer_silent_past_the_limit_whose_kernel_answers_is_frozen():
    pulse = PeerPulse(last_heard=10.0)
    assert not pulse.is_frozen(10.4, FROZEN_S, last_ack_s=0.05)
    assert pulse.is_frozen(10.5, FROZEN_S, last_ack_s=0.05)


def test_a_peer_whose_kernel_stopped_answering_is_left_to_the_peer_timeout():
    pulse = PeerPulse(last_heard=10.0)
    assert not pulse.is_frozen(11.0, FROZEN_S, last_ack_s=1.0)  # a silent link, not a freeze


def test_a_peer_that_announced_a_full_collection_is_not_judged_until_it_speaks_again():
    pulse = PeerPulse(last_heard=10.0)
    pulse.hear(PAUSING, 10.1)
    assert not pulse.is_frozen(30.0, FROZEN_S, last_ack_s=0.05)
    pulse.hear(BEAT, 31.0)
    assert pulse.is_frozen(31.5, FROZEN_S, last_ack_s=0.05)


def test_a_peer_that_released_its_round_is_never_judged_again():
    pulse = PeerPulse(last_heard=10.0)
    pulse.hear(ABANDON, 10.1)
    pulse.hear(BEAT, 10.2)
    assert not pulse.is_frozen(30.0, FROZEN_S, last_ack_s=0.05)


def _watch_all(channels: list[AgreementChannel], ranks: list[int]) -> list[tuple[int, int, str]]:
    seen: list[tuple[int, int, str]] = []
    for rank in ranks:
        channels[rank].watch(lambda peer, how, rank=rank: seen.append((rank, peer, how)),
                             BEAT_EVERY, FROZEN)
    return seen


def test_a_peer_never_heard_from_is_judged_one_more_limit_after_the_watch_began():
    pulse = PeerPulse(last_heard=None, since=10.0)  # its beats may not have started yet
    assert not pulse.is_frozen(10.9, FROZEN_S, last_ack_s=0.05)
    assert pulse.is_frozen(11.0, FROZEN_S, last_ack_s=0.05)
    assert not pulse.is_frozen(30.0, FROZEN_S, last_ack_s=1.0)  # a silent link, not a freeze
    assert not PeerPulse(last_heard=None).is_frozen(30.0, FROZEN_S, last_ack_s=0.05)


def test_a_rank_0_that_begins_to_beat_late_is_not_judged_by_peers_that_never_heard_it():
    channels = _connected(3)
    try:
        seen = _watch_all(channels, [1, 2])  # rank 0 still admitting others: it beats later
        threading.Event().wait(4 * FROZEN_S)  # nothing to wait on: a report would come now
        assert seen == [], seen
    finally:
        _close(channels)


def test_a_rank_frozen_before_its_first_beat_is_reported_frozen_by_rank_0():
    channels = _connected(3)
    try:
        seen = _watch_all(channels, [0, 1])  # rank 2 stops right as the round forms
        assert poll_until(lambda: seen, 10), "nobody reported rank 2 (waits for its lease)"
        assert seen == [(0, 2, "frozen")]
    finally:
        _close(channels)


def test_a_rank_whose_process_stops_beating_is_reported_frozen_by_rank_0():
    channels = _connected(3)
    try:
        seen = _watch_all(channels, [0, 1])  # rank 2 never beats: its kernel still answers
        def agree(rank: int) -> tuple[bool, bool]:  # rank 2 was heard once, in an agreement
            channels[rank].start(False, False)
            return channels[rank].finish()
        assert _in_threads(3, agree) == [(False, False)] * 3
        assert poll_until(lambda: seen, 10), "nobody reported rank 2"
        assert seen == [(0, 2, "frozen")]
        assert channels[0].peers_lost() == {2: "frozen"}
    finally:
        _close(channels)


def test_ranks_that_beat_agree_through_their_heartbeats_and_nobody_is_frozen():
    channels = _connected(3)
    try:
        seen = _watch_all(channels, [0, 1, 2])
        quiet = threading.Event()  # never set: agreements spaced past the frozen limit
        for pending in (False, True, False):
            def agree(rank: int, pending: bool = pending) -> tuple[bool, bool]:
                channels[rank].start(pending and rank == 2, False)
                return channels[rank].finish()
            assert _in_threads(3, agree) == [(pending, False)] * 3
            quiet.wait(2 * FROZEN_S)
        assert seen == [] and all(c.peers_lost() == {} for c in channels)
    finally:
        _close(channels)


def test_a_rank_that_released_the_round_is_not_reported_frozen():
    channels = _connected(3)
    try:
        seen = _watch_all(channels, [0, 1, 2])
        channels[0].release("re-forming (failure)")  # rank 0 beats no more, and said so
        watcher = channels[0]._watcher  # noqa: SLF001 (no event tells a test this)
        assert watcher is not None
        watcher.join(5)
        threading.Event().wait(4 * FROZEN_S)  # nothing to wait on: a report would come now
        assert seen == [], seen
    finally:
        _close(channels)


def test_a_rank_whose_beats_come_from_its_pulse_process_is_heard():
    channels = _connected(2)
    pulse = PulseProcess(BEAT_EVERY.total_seconds())
    try:
        seen: list[tuple[int, str]] = []
        channels[0].watch(lambda peer, how: seen.append((peer, how)), BEAT_EVERY, FROZEN)
        channels[1].watch(lambda peer, how: seen.append((peer, how)), BEAT_EVERY, FROZEN, pulse)
        assert pulse.pid is not None
        threading.Event().wait(4 * FROZEN_S)  # nothing to wait on: a report would come now
        assert seen == [], seen
    finally:
        _close(channels)
        pulse.close()
