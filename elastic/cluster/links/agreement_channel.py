"""The membership agreement's transport: one TCP connection from every rank to rank 0.

An agreement moves two flags per rank (is a change pending, is this rank leaving). The callers'
threads exchange two bytes directly: every rank sends its flags to rank 0, rank 0 replies with
the maximum of each. (A gloo all-reduce would cross three threads in each process; what that
costs is in benchmarks/RESULTS.md.)

One channel per round: rank 0 listens on its advertised address, on a port it publishes with a
fresh secret in the round's address book (in a job, a key under the job's etcd prefix: never the
round's TCPStore, which anyone on the network can read and write); every other rank reads the
address from there, connects and proves that it knows the round's secret (``admission``), so that a stale worker of another round, a replayed hello, a
stranger and a connection that never speaks are turned away without holding the round up, and
only the round's ranks vote. Once rank 0 holds every rank's flags its decision is final: it
reaches every live rank before any release does. ``release`` (from any thread) tells the peers that this rank let
go of the round (an ``_ABANDON`` message in place of flags, so that a peer blocked on this rank
returns at once) and shuts the receiving side of every socket down, so that a rank blocked in
an exchange with a frozen or dead peer returns at once.

The connections are also a detector: when a process dies its kernel closes its sockets, so the
connection between it and rank 0 ends at once. Releasing sends nothing to the peer (only the
receiving side is shut), and a released channel is closed only once its holder's next round has
formed; so until then, a connection that the peer ended (``peers_gone``) means that the peer's
process is gone, never that it is re-forming; ``watch`` reports such an end as it happens (rank
0 sees any rank's; every rank sees rank 0's), so that survivors blocked where no socket of
theirs breaks (an NCCL collective) are released at once. A connection can also end with both
processes alive: the network between them acknowledged nothing for ``silence`` (the kernel's
``TCP_USER_TIMEOUT``, ``ETIMEDOUT``); ``peers_lost`` tells those apart, so that a cut link is
not mistaken for a death. The watch also hears heartbeats (``heartbeat``): a frozen peer's
kernel keeps its connection open. No torch.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
from datetime import timedelta
from collections.abc import Callable
from typing import TypeVar

from elastic.cluster.links.admission import Admission, RoundAddress
from elastic.cluster.links.channel_forming import ChannelForming
from elastic.cluster.links.fork_guard import guard as fork_guard
from elastic.cluster.links.channel_watch import FROZEN, watch_until_released
from elastic.cluster.links.heartbeat import ABANDON, Heartbeat, is_pulse
from elastic.cluster.links.pulse_process import PulseProcess
from elastic.cluster.links.channel_tcp import (TCP_ESTABLISHED, link_state, receive_exactly,
                                               unanswered)
from elastic.foundation.errors import PeerFailureError

log = logging.getLogger(__name__)
T = TypeVar("T")

_FLAGS = struct.Struct("!BB")  # change pending, leaving
_ABANDON = ABANDON  # in place of flags: the sender released the round
ENDED, SILENT = "ended", "silent"  # how a peer was lost (``peers_lost``; also FROZEN)


class AgreementChannel(ChannelForming):
    """The connections of one round's agreements.

    Created empty by the cluster (so that ``release`` can reach it while it connects), then
    ``connect``-ed once the round's process group is formed.

    Args:
        rank: this worker's rank in the round.
        world_size: the round's size.
        timeout: how long an exchange may block without a release (a backstop; the membership
            watch releases a channel whose peer is gone long before).
        silence: how long a connection may go unacknowledged before the kernel ends it (a
            network that drops the link silently); None leaves the system's TCP defaults.
        probe: how often an idle connection is probed, rounded up to whole seconds (with
            ``silence``; both or neither).
    """

    def __init__(self, rank: int, world_size: int, timeout: timedelta,
                 silence: timedelta | None = None, probe: timedelta | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self._timeout_s = timeout.total_seconds()
        self._silence, self._probe = silence, probe
        self._lock = threading.Lock()
        self._released: str | None = None
        self._silent: set[int] = set()  # ranks whose connection the kernel timed out
        self._frozen: set[int] = set()  # ranks that stopped beating while their kernel answered
        self._send_lock = threading.RLock()  # one message at a time on a connection
        self._read_locks: dict[int, threading.Lock] = {}  # held by whoever reads a connection
        self._heartbeat: Heartbeat | None = None
        self._listener: socket.socket | None = None
        self._address: RoundAddress | None = None  # rank 0, once it listens
        self._admission: Admission | None = None  # rank 0, while the others connect
        self._peers: dict[int, socket.socket] = {}  # rank 0: every other rank; else {0: rank 0}
        self._flags = (0, 0)
        self._watcher: threading.Thread | None = None

    # -- one agreement ----------------------------------------------------------------------
    def start(self, pending: bool, leaving: bool) -> None:
        """Hands this rank's flags over (ranks > 0 send them to rank 0 now).

        Raises:
            PeerFailureError: rank 0's connection is gone.
        """
        self._flags = (int(pending), int(leaving))
        if self.rank != 0 and self.world_size > 1:
            self._guard(lambda: self._with(0, lambda: self._send(
                self._peers[0], _FLAGS.pack(*self._flags))))

    def finish(self) -> tuple[bool, bool]:
        """Waits for the agreement; returns (a change is pending anywhere, someone leaves).

        Raises:
            PeerFailureError: a peer died, or the channel was released.
        """
        if self.world_size == 1:
            return bool(self._flags[0]), bool(self._flags[1])
        if self.rank != 0:
            return self._guard(lambda: self._with(0, lambda: self._decode(0, self._peers[0])))
        return self._guard(self._gather_and_reply)

    def _gather_and_reply(self) -> tuple[bool, bool]:
        pending, leaving = self._flags
        peers = dict(self._peers)
        for rank, sock in peers.items():
            their_pending, their_leaving = self._with(rank, lambda: self._decode(rank, sock))
            pending, leaving = max(pending, their_pending), max(leaving, their_leaving)
        failed = self._reply(peers, _FLAGS.pack(pending, leaving))
        if failed:  # the next agreement fails at once; this one stands
            self.release(f"rank(s) {sorted(failed)} took no reply: {failed}")
        return bool(pending), bool(leaving)

    def _reply(self, peers: dict[int, socket.socket], reply: bytes) -> dict[int, str]:
        """Sends the decision to every rank; returns the ranks that could not take it.

        Once every rank's flags are in, the decision is final, and every live rank must hear
        it: a release that comes meanwhile (the watch saw a rank that read its reply die)
        waits, so its ``_ABANDON`` never reaches a rank before the decision does, and a rank
        that died after handing its flags over keeps the decision from no other.

        Raises:
            ConnectionResetError: the channel was released before the decision; every rank was
                told so instead.
        """
        failed = {}
        with self._lock:
            if self._released is not None:
                raise ConnectionResetError(f"released before replying: {self._released}")
            for rank, sock in peers.items():
                try:  # 2 bytes: the buffer takes them at once, whatever the peer does
                    self._send(sock, reply)
                except OSError as exc:
                    if unanswered(exc.errno):
                        self._silent.add(rank)  # the error is read once: remember what it said
                    failed[rank] = repr(exc)
        return failed

    def _with(self, rank: int, io: Callable[[], T]) -> T:
        """Runs ``io`` on ``rank``'s connection, remembering a silent end (the kernel reports
        the error once, to whichever reads it first: here or ``peers_gone``)."""
        try:
            return io()
        except OSError as exc:
            if unanswered(exc.errno):
                with self._lock:
                    self._silent.add(rank)
            raise

    def _send(self, sock: socket.socket, message: bytes, flags: int = 0) -> None:
        """Sends one whole message (the agreement's or a heartbeat) on ``sock``."""
        with self._send_lock:
            if flags:
                sock.send(message, flags)
            else:
                sock.sendall(message)

    def _decode(self, rank: int, sock: socket.socket) -> tuple[int, int]:
        with self._read_locks[rank]:
            data = receive_exactly(sock, _FLAGS.size)
            while is_pulse(data):  # heartbeats share the stream: pass them on, read on
                if self._heartbeat is not None:
                    self._heartbeat.heard(rank, data)
                data = receive_exactly(sock, _FLAGS.size)
        if len(data) < _FLAGS.size:
            raise ConnectionResetError("the connection was closed")
        if self._heartbeat is not None:
            self._heartbeat.heard(rank, data)
        if data == _ABANDON:
            raise ConnectionResetError("the peer released the round")
        pending, leaving = _FLAGS.unpack(data)
        return pending, leaving

    def _guard(self, exchange: Callable[[], T]) -> T:
        """Runs one exchange; any socket error releases the channel and is a peer failure."""
        try:
            return exchange()
        except OSError as exc:
            with self._lock:
                released = self._released
            self.release(f"an exchange failed: {exc!r}")  # peers blocked on us return at once
            why = f"released ({released})" if released else repr(exc)
            raise PeerFailureError(f"membership agreement failed: {why}") from exc

    # -- watching for a dead peer ------------------------------------------------------------
    def watch(self, on_gone: Callable[[int, str], None], wake: timedelta,
              frozen: timedelta | None = None, pulse: PulseProcess | None = None) -> None:
        """Calls ``on_gone(rank, how)`` (``peers_lost``) on a thread of its own, once per rank,
        as soon as a peer is lost while this channel is neither released nor closed; it wakes
        every ``wake``. With ``frozen`` (and ``wake`` the heartbeat interval), a peer whose
        heartbeats stop that long is ``FROZEN``; ``pulse``, else the thread, beats for this one."""
        with self._lock:
            if self._released is not None or not self._peers:
                return
            peers = dict(self._peers)
            if frozen is not None:
                self._heartbeat = Heartbeat.over(
                    peers, pulse, lambda sock, message: self._send(sock, message,
                                                                   socket.MSG_DONTWAIT),
                    self._read_locks, frozen.total_seconds(), judge_unheard=self.rank == 0)
        self._watcher = threading.Thread(target=self._watch, name="elastic-channel-watch",
                                         args=(peers, on_gone, wake.total_seconds()),
                                         daemon=True)
        self._watcher.start()

    def _watch(self, peers: dict[int, socket.socket], on_gone: Callable[[int, str], None],
               wake_s: float) -> None:
        watch_until_released(self, peers, on_gone, wake_s, self._heartbeat)

    def is_released(self) -> bool:
        with self._lock:
            return self._released is not None

    def mark_frozen(self, rank: int) -> bool:
        """Records that ``rank`` stopped beating; false when released, or known already."""
        with self._lock:
            if self._released is not None or rank in self._frozen:
                return False
            self._frozen.add(rank)
            return True

    # -- teardown ---------------------------------------------------------------------------
    def release(self, reason: str) -> None:
        """Unblocks every exchange of this channel now; safe from any thread, idempotent."""
        with self._lock:
            if self._released is not None:
                return
            self._released = reason
            if self._admission is not None:
                self._admission.abort(reason)
            for rank, sock in self._peers.items():
                try:  # never blocks: the message is 2 bytes, the buffer holds at most a few
                    self._send(sock, _ABANDON, socket.MSG_DONTWAIT)
                except OSError as exc:  # gone already, or its buffer is full: it is not waiting
                    if unanswered(exc.errno):
                        self._silent.add(rank)  # the error is read once: remember what it said
            for sock in self._sockets():
                try:  # the receiving side only: the peer must not see this as our death
                    sock.shutdown(socket.SHUT_RD)
                except OSError:
                    pass  # not connected (a listener) or already reset by the peer

    def peers_gone(self) -> list[int]:
        """The ranks lost (rank 0: any rank; another rank: rank 0), however (``peers_lost``)."""
        return list(self.peers_lost())

    def peers_lost(self) -> dict[int, str]:
        """The ranks lost, each with how: ``ENDED``, ``SILENT`` or ``FROZEN``.

        Until this channel is closed, a connection that ended means that the peer's process is
        gone (its kernel ended it: ``ENDED``), no live member ends its connection before its
        next round formed; or that the network acknowledged nothing for ``silence``
        (``SILENT``): the peer may be alive on the other side of a cut link, or its machine
        vanished. A peer whose kernel answers but whose process stopped beating is ``FROZEN``.
        """
        with self._lock:
            peers = dict(self._peers)
        lost = {}
        for rank, sock in sorted(peers.items()):
            read = link_state(sock)
            if read is None:
                continue  # closed by this side: nothing to tell
            state, error = read
            with self._lock:
                if unanswered(error):
                    self._silent.add(rank)  # the error is read once: remember what it said
                silent, frozen = rank in self._silent, rank in self._frozen
            if state != TCP_ESTABLISHED:
                lost[rank] = SILENT if silent else ENDED
            elif frozen:
                lost[rank] = FROZEN
        return lost

    def peer_address(self, rank: int) -> tuple[str, int] | None:
        """Where this channel's connection to ``rank`` ends on the peer's machine (rank 0's
        listening address, open until its next round formed); None once it is closed."""
        with self._lock:
            sock = self._peers.get(rank)
        try:
            return None if sock is None else sock.getpeername()[:2]
        except OSError:
            return None

    def close(self) -> None:
        """Closes every socket (after ``release``, or once the round ended normally)."""
        with self._lock:
            if self._released is None:
                self._released = "closed"
            sockets = self._sockets()
            self._peers, self._listener = {}, None
            watcher, self._watcher = self._watcher, None
            heartbeat = self._heartbeat
        if heartbeat is not None:  # the heartbeat process's copies too, or no peer sees the end
            heartbeat.let_go()
        if watcher is not None:
            for sock in sockets:
                try:  # wakes the watcher (a socket closed under a poll would not)
                    sock.shutdown(socket.SHUT_RD)
                except OSError:
                    pass  # not connected, or already shut
            watcher.join(self._timeout_s)
        fork_guard.release([sock.fileno() for sock in sockets])
        for sock in sockets:
            sock.close()

    def _sockets(self) -> list[socket.socket]:
        """Every socket this channel holds now (call with the lock held)."""
        held = [] if self._listener is None else [self._listener]
        return list(self._peers.values()) + held
