"""Heartbeats on the agreement connections: when a silent peer is frozen.

Each end of an agreement connection receives a two-byte heartbeat every ``heartbeat`` interval
(``Timeouts.heartbeat``) and the channel's watch thread looks at what arrived. A peer whose
process sent nothing for ``frozen`` (``Timeouts.frozen``) while its kernel still acknowledges
this end's traffic is *frozen*. A peer whose kernel stopped acknowledging too is on the far side
of a silent link: that is the kernel's ``TCP_USER_TIMEOUT`` to judge
(``channel_tcp.end_when_silent``), not this module.

Who beats: the worker's heartbeat process (``pulse_process``), which beats unless the worker is
stopped, so that a worker busy in a long pure-Python section, a native op, a full garbage
collection or on a starved CPU never falls silent. Where that process cannot run, the watch
thread beats itself (``send``): it gets the GIL at the interpreter's switch interval, but a full
collection stops it, so the collector announces one (``PAUSING``, from ``gc.callbacks``) and a
peer that announced one is not judged until its next message (its lease stays the backstop).

The messages share the stream with the agreement's flags (two bytes each, flags are 0 or 1, an
abandon is 0xFF): a heartbeat is ``FE 00``, a collection's start ``FE 01``. A reader of flags
passes every message it meets to ``heard``. No torch, no etcd.
"""

from __future__ import annotations

import gc
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from elastic.cluster.links.pulse_process import PulseProcess

BEAT = b"\xfe\x00"
PAUSING = b"\xfe\x01"  # a full garbage collection starts: nothing comes until it ends
ABANDON = b"\xff\xff"  # in place of flags: the sender released the round and beats no more
MESSAGE = 2  # bytes of every message on an agreement connection
_PEEK = 4096
# struct tcp_info (linux/tcp.h): tcpi_last_ack_recv, milliseconds since the peer's kernel last
# acknowledged anything, after 14 one-byte and four-byte fields.
_LAST_ACK_RECV = struct.Struct("=I")
_LAST_ACK_OFFSET = 56


def is_pulse(message: bytes) -> bool:
    """Whether ``message`` is a heartbeat or a collection's start (not the agreement's)."""
    return message in (BEAT, PAUSING)


@dataclass
class PeerPulse:
    """What one end heard from one peer: when last (None: never yet), since when this end
    judges it before it was ever heard (None: not until it is), and whether it announced a
    collection. A peer never heard from is judged one more limit late (its heartbeats start a
    moment after its connection, once its heartbeat process took it over), so that one frozen
    as its round forms is seen long before its lease ends."""

    last_heard: float | None
    since: float | None = None
    pausing: bool = False
    released: bool = False  # it let go of the round: it beats no more, and is not judged
    queued: int = 0  # bytes waiting behind the agreement's flags, last time they were counted

    def hear(self, message: bytes, now: float) -> None:
        """Anything from the peer is a sign of life; a collection's start suspends judgement,
        and so does the end of the round for the peer."""
        self.last_heard = now
        self.pausing = message == PAUSING
        self.released = self.released or message == ABANDON

    def is_frozen(self, now: float, frozen_s: float, last_ack_s: float) -> bool:
        """Whether the peer's process said nothing for ``frozen_s`` (twice that from ``since``
        when never heard) while its kernel answered within ``frozen_s`` (``last_ack_s``:
        seconds since its last acknowledgement)."""
        if self.last_heard is not None:
            silent_s = now - self.last_heard
        elif self.since is not None:
            silent_s = now - self.since - frozen_s
        else:
            return False
        return (not self.pausing and not self.released and silent_s >= frozen_s
                and last_ack_s < frozen_s)


class Heartbeat:
    """The heartbeats of one channel's connections, driven by its watch thread (``tick``) and
    told by its flag readers (``heard``).

    Args:
        peers: the channel's connections, by rank.
        send: sends one message on a connection without blocking (the channel's send lock);
            None when another process beats for this one (``pulse_process``).
        read_locks: per rank, the lock a reader of that connection holds while it reads.
        frozen: seconds of silence after which a peer that still acknowledges is frozen.
        judge_unheard: whether peers never heard from are judged, from now on (rank 0: every
            peer connected before it began to watch, and beats right after; a peer of rank 0
            may connect long before rank 0 has admitted the others and begins to beat).
        clock: the monotonic clock (injected by tests).
    """

    def __init__(self, peers: dict[int, socket.socket],
                 send: Callable[[socket.socket, bytes], None] | None,
                 read_locks: dict[int, threading.Lock], frozen_s: float,
                 judge_unheard: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._peers = dict(peers)
        self._send = send
        self._read_locks = read_locks
        self._frozen_s = frozen_s
        self._clock = clock
        since = clock() if judge_unheard else None
        self._pulses = {rank: PeerPulse(None, since=since) for rank in peers}
        self._pid = os.getpid()
        self._let_go: Callable[[], None] = lambda: None

    @classmethod
    def over(cls, peers: dict[int, socket.socket], pulse: PulseProcess | None,
             send: Callable[[socket.socket, bytes], None], read_locks: dict[int, threading.Lock],
             frozen_s: float, judge_unheard: bool = False) -> Heartbeat:
        """The heartbeats of ``peers``, beaten by ``pulse`` when it takes them, else by
        ``send`` from the watch thread."""
        key = f"{id(peers)}"
        beats = pulse is not None and pulse.start() and pulse.hold(key, list(peers.values()))
        heartbeat = cls(peers, None if beats else send, read_locks, frozen_s, judge_unheard)
        if beats:
            assert pulse is not None
            heartbeat._let_go = lambda: pulse.drop(key)
        return heartbeat

    def let_go(self) -> None:
        """Takes the connections back from the heartbeat process (before they are closed: its
        copies would keep them open)."""
        self._let_go()

    def heard(self, rank: int, message: bytes) -> None:
        """A reader of ``rank``'s connection met ``message`` (a heartbeat, or flags)."""
        pulse = self._pulses.get(rank)
        if pulse is not None:
            pulse.hear(message, self._clock())

    def tick(self) -> list[int]:
        """Beats every peer, takes in what they sent, and returns the ranks now frozen."""
        self.beat(BEAT)
        frozen = []
        for rank, sock in self._peers.items():
            self._drain(rank, sock)
            pulse = self._pulses[rank]
            if pulse.is_frozen(self._clock(), self._frozen_s, _last_ack_s(sock)):
                frozen.append(rank)
        return frozen

    def beat(self, message: bytes) -> None:
        """Sends ``message`` to every peer (a full buffer or a closed connection: skipped)."""
        if self._send is None or os.getpid() != self._pid:
            return  # beaten by another process, or a forked child: not its connections
        for sock in self._peers.values():
            try:
                self._send(sock, message)
            except OSError:
                pass  # full (the peer reads nothing: it is the one judged) or ended (watched)

    def on_gc(self, phase: str, info: dict[str, int]) -> None:
        """``gc.callbacks``: announces a full collection to the peers, and its end."""
        if info.get("generation", 0) >= 2:
            self.beat(PAUSING if phase == "start" else BEAT)

    def hook(self) -> Callable[[], None]:
        """Registers ``on_gc`` with the collector, when this thread beats; returns what
        removes it."""
        if self._send is None:
            return lambda: None
        gc.callbacks.append(self.on_gc)

        def unhook() -> None:
            if self.on_gc in gc.callbacks:
                gc.callbacks.remove(self.on_gc)
        return unhook

    def _drain(self, rank: int, sock: socket.socket) -> None:
        """Takes the heartbeats at the head of ``rank``'s connection (none while a reader holds
        it: the reader passes them on); bytes queued behind unread flags count as heard when
        more came since last time."""
        lock = self._read_locks[rank]
        if not lock.acquire(blocking=False):
            return
        try:
            if not _readable(sock):  # the socket's timeout would make recv wait for data
                return
            waiting = sock.recv(_PEEK, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            pulse = self._pulses[rank]
            head = 0
            while head + MESSAGE <= len(waiting) and is_pulse(waiting[head:head + MESSAGE]):
                head += MESSAGE
            if head:
                sock.recv(head, socket.MSG_DONTWAIT)
                pulse.hear(waiting[head - MESSAGE:head], self._clock())
            queued = len(waiting) - head
            if queued > pulse.queued:  # more came behind flags that nobody read yet
                end = head + queued // MESSAGE * MESSAGE
                pulse.hear(waiting[end - MESSAGE:end], self._clock())
            if waiting[head:head + MESSAGE] == ABANDON:
                pulse.hear(ABANDON, self._clock())  # left for the reader, who must see it too
            pulse.queued = queued
        except OSError:
            pass  # ended meanwhile: the watch sees that
        finally:
            lock.release()


def _readable(sock: socket.socket) -> bool:
    """Whether ``sock`` holds data (or an end) to read now."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    return bool(poller.poll(0))


def _last_ack_s(sock: socket.socket) -> float:
    """Seconds since the peer's kernel last acknowledged anything on ``sock`` (infinite when
    the connection cannot say)."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _LAST_ACK_OFFSET + 4)
    except OSError:
        return float("inf")
    if len(info) < _LAST_ACK_OFFSET + 4:
        return float("inf")
    return _LAST_ACK_RECV.unpack_from(info, _LAST_ACK_OFFSET)[0] / 1000
