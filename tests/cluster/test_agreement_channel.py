"""The agreement channel over real loopback sockets: ranks are threads of this process, the
address book is torch's in-memory ``HashStore``. A worker that dies is a rank whose sockets
close (what the kernel does for a killed process); a frozen one is a rank that stops talking."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest

from elastic.agreement import MembershipAgreement
from elastic.cluster.links.agreement_channel import AgreementChannel
from elastic.foundation.errors import AdvertiseAddressError, PeerFailureError
from tests.support.address_book import StoreBook
from tests.support.polling import poll_until

pytestmark = pytest.mark.timeout(60)

_ADDR = "127.0.0.1"
_LONG = timedelta(seconds=30)


def _in_threads(world_size: int, fn: Callable[[int], Any], timeout_s: float = 20) -> list[Any]:
    """Runs ``fn(rank)`` for every rank in its own thread; returns results or raised errors."""
    results: list[Any] = [None] * world_size

    def run(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except Exception as exc:  # noqa: BLE001 (handed back to the test)
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
        assert not thread.is_alive(), "a rank is still blocked"
    return results


def _connected(world_size: int, round_: int = 7,
               silence: timedelta | None = None) -> list[AgreementChannel]:
    store = StoreBook()
    probe = None if silence is None else timedelta(seconds=1)
    channels = [AgreementChannel(r, world_size, _LONG, silence, probe) for r in range(world_size)]
    errors = _in_threads(world_size, lambda r: channels[r].connect(store, _ADDR, round_, _LONG))
    assert errors == [None] * world_size
    return channels


def _unproven(channel: AgreementChannel) -> int:
    """How many connections rank 0 holds without a hello yet (0 when it is not admitting)."""
    admission = channel._admission  # noqa: SLF001 (no event tells a test this)
    return 0 if admission is None else len(admission._callers)  # noqa: SLF001


def _close(channels: list[AgreementChannel]) -> None:
    for channel in channels:
        channel.close()


def test_every_rank_learns_the_maximum_of_every_flag_in_each_agreement():
    channels = _connected(4)
    try:
        quiet = (False, False)
        flags = [[quiet] * 4, [quiet, quiet, (True, False), quiet], [quiet] * 3 + [(True, True)]]

        def agree(rank: int, mine: list[tuple[bool, bool]]) -> tuple[bool, bool]:
            channels[rank].start(*mine[rank])
            return channels[rank].finish()

        for mine, expected in zip(flags, [(False, False), (True, False), (True, True)]):
            assert _in_threads(4, lambda r, mine=mine: agree(r, mine)) == [expected] * 4
    finally:
        _close(channels)


def test_a_world_of_one_agrees_with_itself_without_any_socket():
    channel = AgreementChannel(0, 1, _LONG)
    channel.connect(StoreBook(), _ADDR, 1, _LONG)
    channel.start(True, False)
    assert channel.finish() == (True, False)


def test_a_dead_peer_fails_the_agreement_on_every_rank_at_once():
    """Rank 0 reads the dead peer's end; rank 1, which never talks to rank 2, learns it from
    rank 0's release, not from its own exchange timeout (30 s, a socket timeout)."""
    channels = _connected(3)
    try:
        channels[2].close()  # rank 2's process is gone: the kernel closes its sockets

        def agree(rank: int) -> tuple[bool, bool]:
            channels[rank].start(False, False)
            return channels[rank].finish()

        results = _in_threads(2, agree)
        assert all(isinstance(r, PeerFailureError) for r in results), results
        assert [str(r.__cause__) for r in results] == ["the connection was closed",
                                                       "the peer released the round"], results
    finally:
        _close(channels)


def test_a_failed_agreement_raises_the_same_failure_again_without_asking_the_channel():
    """Asked twice (a sharded commit asks whether to send its copies, then acts on it), a
    failed agreement answers from what it learnt, not by reading a broken channel again."""
    channels = _connected(2)
    try:
        channels[1].close()  # rank 1's process is gone
        channels[0].start(False, False)
        agreement = MembershipAgreement(SimpleNamespace(channel=channels[0]), threading.Event(),
                                        None)
        with pytest.raises(PeerFailureError) as first:
            agreement.wait()
        assert not agreement.is_reached()
        with pytest.raises(PeerFailureError) as again:
            agreement.finish()
        assert again.value is first.value
    finally:
        _close(channels)


def test_releasing_frees_a_rank_blocked_on_a_frozen_peer_and_names_the_reason():
    channels = _connected(2, round_=8)  # rank 1 is frozen: it never hands its flags over
    try:
        # The membership watch's part: the frozen member's lease ran out. Whether it lands
        # before or during the wait, the wait ends with the reason.
        watch = threading.Timer(0.2, channels[0].release, ("member m1 of round 8 is gone",))
        watch.start()
        channels[0].start(False, False)
        # Only the release names this reason; the exchange's own timeout (30 s) names none.
        with pytest.raises(PeerFailureError, match="member m1 of round 8 is gone"):
            channels[0].finish()
        watch.join(5)
    finally:
        _close(channels)


def test_a_connection_from_another_round_is_turned_away():
    store = StoreBook()
    channels = [AgreementChannel(r, 2, _LONG) for r in range(2)]
    stale = AgreementChannel(1, 2, _LONG)
    turned_away: list[Exception] = []

    def connect(rank: int) -> None:
        if rank == 0:
            channels[0].connect(store, _ADDR, 5, _LONG)
        elif rank == 1:
            with pytest.raises(PeerFailureError, match="did not prove|closed") as raised:
                stale.connect(store, _ADDR, 4, timedelta(seconds=5))  # a worker of round 4
            turned_away.append(raised.value)
            channels[1].connect(store, _ADDR, 5, _LONG)

    try:
        assert _in_threads(2, connect) == [None, None]
        assert turned_away, "the stale worker was admitted"
        agreed = _in_threads(2, lambda r: (channels[r].start(r == 1, False),
                                           channels[r].finish())[1])
        assert agreed == [(True, False)] * 2
    finally:
        _close(channels + [stale])


def test_forming_fails_with_a_peer_failure_when_a_rank_never_connects():
    channel = AgreementChannel(0, 3, _LONG)
    # connect's timeout is its only bound: one it ignored would hang until pytest-timeout.
    with pytest.raises(PeerFailureError, match="could not be formed"):
        channel.connect(StoreBook(), _ADDR, 3, timedelta(seconds=0.5))
    channel.close()


def test_a_channel_released_before_it_connects_refuses_to_form():
    channel = AgreementChannel(0, 2, _LONG)
    channel.release("the round broke while the group formed")
    with pytest.raises(PeerFailureError, match="the round broke"):
        channel.connect(StoreBook(), _ADDR, 3, _LONG)
    channel.close()


def test_releasing_frees_rank_zero_while_it_awaits_a_silent_connections_hello():
    store = StoreBook()
    channel = AgreementChannel(0, 2, _LONG)
    silent: list[socket.socket] = []

    def connect_silently() -> None:  # a peer frozen between its connect and its hello
        address = json.loads(store.find(timedelta(seconds=10)))
        silent.append(socket.create_connection((address["host"], address["port"]), timeout=10))
        # Nothing signals "rank 0 holds this connection" from inside connect(): look.
        assert poll_until(lambda: _unproven(channel), 5)
        channel.release("member m1 of round 9 is gone")

    helper = threading.Thread(target=connect_silently, daemon=True)
    helper.start()
    # Only the release names this reason; connect's own deadline (30 s) names none.
    with pytest.raises(PeerFailureError, match="member m1 of round 9 is gone"):
        channel.connect(store, _ADDR, 9, timedelta(seconds=30))
    helper.join(5)
    for sock in silent:
        sock.close()
    channel.close()


def test_an_advertised_address_that_is_not_this_machines_is_a_clear_configuration_error():
    channel = AgreementChannel(0, 2, _LONG)
    with pytest.raises(AdvertiseAddressError, match="--advertise-addr"):
        channel.connect(StoreBook(), "192.0.2.1", 3, timedelta(seconds=5))  # TEST-NET-1
    channel.close()


def test_a_released_rank_zero_frees_the_others_without_looking_dead_to_them():
    channels = _connected(3)
    try:
        for rank in (1, 2):
            channels[rank].start(False, False)
        channels[0].release("re-forming (failure)")
        results = _in_threads(3, lambda r: channels[r].finish() if r else None)
        assert all(isinstance(r, PeerFailureError) for r in results[1:]), results
        assert [c.peers_gone() for c in channels] == [[], [], []]
    finally:
        _close(channels)


def test_a_peer_whose_process_ended_its_connection_is_reported_gone_after_any_release():
    channels = _connected(3)
    try:
        for channel in channels:
            channel.release("re-forming (failure)")
        channels[2].close()  # rank 2's process is gone: the kernel closes its sockets
        assert poll_until(lambda: channels[0].peers_gone() == [2], 5)
        assert channels[0].peers_lost() == {2: "ended"}  # its kernel ended it: not a silent link
        assert channels[1].peers_gone() == []
        channels[0].close()  # rank 0's process is gone
        assert poll_until(lambda: channels[1].peers_gone() == [0], 5)
        assert channels[1].peers_lost() == {0: "ended"}
    finally:
        _close(channels)


def test_the_watch_reports_a_peer_whose_process_ended_its_connection_at_once():
    channels = _connected(3)
    seen: list[int] = []
    reported = threading.Event()
    try:
        channels[0].watch(lambda rank, how: (seen.append((rank, how)), reported.set()),
                          timedelta(seconds=1))
        channels[2].close()  # rank 2's process is gone: the kernel closes its sockets
        assert reported.wait(5) and seen == [(2, "ended")]
    finally:
        _close(channels)


def test_the_watch_stays_silent_when_peers_re_form_and_ends_with_the_release():
    channels = _connected(3)
    seen: list[int] = []
    try:
        channels[1].watch(lambda rank, how: seen.append(rank), timedelta(seconds=1))
        channels[0].release("re-forming (failure)")  # rank 0 is alive: it only re-forms
        channels[1].release("re-forming (failure)")
        watcher = channels[1]._watcher  # noqa: SLF001 (no event tells a test this)
        assert watcher is not None
        watcher.join(5)
        assert not watcher.is_alive() and seen == []
    finally:
        _close(channels)


def test_every_connection_is_ended_by_the_kernel_after_the_peer_timeout_of_silence():
    # A link cut without a reset is only seen by the kernel's timers (the partition scenario
    # cuts one for real, in network namespaces); here: each connection carries them.
    channels = _connected(3, silence=timedelta(seconds=1.5))
    try:
        for channel in channels:
            for sock in channel._peers.values():  # noqa: SLF001 (the kernel's view of a socket)
                assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 1500
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 1
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 1
        assert len(channels[0]._peers) == 2  # noqa: SLF001
    finally:
        _close(channels)


class _ReplyHook:
    """Rank 0's connection to one rank, with ``after_reply`` run once its reply was sent (or in
    place of sending it): what another thread of rank 0 does right then."""

    def __init__(self, sock: socket.socket, after_reply: Callable[[], None],
                 fails: bool = False) -> None:
        self._sock, self._after_reply, self._fails = sock, after_reply, fails

    def sendall(self, data: bytes) -> None:
        if self._fails:  # the rank died after handing its flags over
            raise BrokenPipeError(32, "Broken pipe")
        self._sock.sendall(data)
        self._after_reply()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def _agree_all(channels: list[AgreementChannel]) -> list[Any]:
    def agree(rank: int) -> tuple[bool, bool]:
        channels[rank].start(False, False)
        return channels[rank].finish()
    return _in_threads(len(channels), agree)


def test_a_release_while_rank_zero_replies_reaches_no_rank_before_the_decision():
    # Rank 1 read its reply and died at once: rank 0's watch releases the channel while rank
    # 0 still replies to rank 2. Rank 2 must hear the decision that ranks 0 and 1 act on.
    channels = _connected(3)
    try:
        def watch_fires() -> None:  # on the watch's thread; waits for it only so long
            watch = threading.Thread(target=channels[0].release, args=("rank 1 is gone",))
            watch.start()
            watch.join(1)

        peers = channels[0]._peers  # noqa: SLF001 (the seam between two replies)
        peers[1] = _ReplyHook(peers[1], watch_fires)  # type: ignore[assignment]
        assert _agree_all(channels) == [(False, False)] * 3
    finally:
        _close(channels)


def test_a_rank_that_died_after_handing_its_flags_over_keeps_the_decision_from_no_other():
    channels = _connected(4)
    try:
        peers = channels[0]._peers  # noqa: SLF001 (the seam between two replies)
        peers[2] = _ReplyHook(peers[2], lambda: None, fails=True)  # type: ignore[assignment]
        results = _agree_all(channels)
        assert [results[r] for r in (0, 1, 3)] == [(False, False)] * 3, results
        assert isinstance(results[2], PeerFailureError)  # told of the release, not the decision
        with pytest.raises(PeerFailureError):  # and the next agreement knows of the death
            channels[0].finish()
    finally:
        _close(channels)
