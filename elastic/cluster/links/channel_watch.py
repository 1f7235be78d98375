"""The agreement channel's watch thread: it tells the channel's holder, once per rank, that a
peer is lost (its connection ended, went silent, or its heartbeats stopped: ``heartbeat``), and
drives the heartbeats. No torch, no etcd.
"""

from __future__ import annotations

import select
import socket
from collections.abc import Callable
from typing import Protocol

from elastic.cluster.links.heartbeat import Heartbeat

FROZEN = "frozen"  # how a peer was lost: its kernel answers, its process stopped beating


class WatchedChannel(Protocol):
    """What the watch asks of its channel (``AgreementChannel``)."""

    def is_released(self) -> bool: ...

    def peers_lost(self) -> dict[int, str]: ...

    def mark_frozen(self, rank: int) -> bool: ...


def watch_until_released(channel: WatchedChannel, peers: dict[int, socket.socket],
                         on_gone: Callable[[int, str], None], wake_s: float,
                         heartbeat: Heartbeat | None) -> None:
    """Calls ``on_gone(rank, how)`` once per rank lost, until the channel is released or every
    peer is lost; with a ``heartbeat``, beats and judges every ``wake_s``."""
    unhook = heartbeat.hook() if heartbeat is not None else (lambda: None)
    try:
        _watch(channel, peers, on_gone, wake_s, heartbeat)
    finally:
        unhook()


def _watch(channel: WatchedChannel, peers: dict[int, socket.socket],
           on_gone: Callable[[int, str], None], wake_s: float, heartbeat: Heartbeat | None) -> None:
    poller = select.poll()
    ranks = {}
    for rank, sock in peers.items():
        ranks[sock.fileno()] = rank
        poller.register(sock.fileno(), select.POLLRDHUP)  # not POLLIN: data never wakes it
    while ranks:
        ready = poller.poll(wake_s * 1000)
        if channel.is_released():
            return  # ours: releasing shuts the receiving sides, which wakes the poll
        for fd, _ in ready:
            rank = ranks.pop(fd, None)
            if rank is not None:
                poller.unregister(fd)
                how = channel.peers_lost().get(rank)
                if how is not None:  # its kernel, or the silence, ended it
                    on_gone(rank, how)
        for rank in heartbeat.tick() if heartbeat is not None else ():
            fd = peers[rank].fileno()
            if fd in ranks and channel.mark_frozen(rank):
                del ranks[fd]
                poller.unregister(fd)
                on_gone(rank, FROZEN)
