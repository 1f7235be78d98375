"""The TCP connections of a gloo process group, as this process's descriptors: found among
the sockets a formation opened (by inode, so that a reused descriptor number is never taken for
one), shut on their receiving side at a release with a copy held open, and let go of at the end.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass

from elastic.cluster.links.fork_guard import guard as fork_guard

log = logging.getLogger(__name__)

TCP_ESTABLISHED = "01"  # the connection state in /proc/net/tcp


@dataclass(frozen=True)
class SocketId:
    fd: int
    inode: int


def socket_fds() -> dict[int, int]:
    """Returns {fd: inode} for every socket this process holds."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found[int(name)] = int(target[8:-1])
    return found


def opened_since(before: dict[int, int]) -> tuple[dict[int, int],
                                                  dict[int, tuple[int, int | None]]]:
    """The sockets opened since ``before`` (``socket_fds``), and the TCP ports of those that
    are TCP (``tcp_ports``)."""
    new = {fd: inode for fd, inode in socket_fds().items() if before.get(fd) != inode}
    return new, {fd: p for fd, p in ((fd, tcp_ports(fd)) for fd in new) if p is not None}


def tcp_ports(fd: int) -> tuple[int, int | None] | None:
    """(local port, remote port) of a TCP socket, remote None while it listens; None for any
    other kind of fd."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
            return None
        local = sock.getsockname()[1]
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            return local, None
        return local, sock.getpeername()[1]
    except OSError:
        return None
    finally:
        sock.close()


def of_group(new: dict[int, int], ends: dict[int, tuple[int, int | None]],
             listener_ports: set[int], skip_ports: frozenset[int]) -> list[SocketId]:
    """The connections of a gloo group among the sockets ``new`` since it started forming
    (``ends``: their TCP ports, ``tcp_ports``).

    Every pair connection of gloo ends at some rank's listening port, so with ``listener_ports``
    (every rank's) only the group's own connections are taken; without them (a gloo that
    listens on no new socket), every connection that is not etcd's.
    """
    found = []
    for fd, (local, remote) in ends.items():
        if remote is None:
            continue
        mine = (local in listener_ports or remote in listener_ports) if listener_ports \
            else remote not in skip_ports
        if mine:
            found.append(SocketId(fd, new[fd]))
    return found


def shut_receiving(sockets: list[SocketId]) -> list[socket.socket]:
    """Shuts down the receiving side of each of ``sockets`` still open under its recorded
    identity, and returns a copy of each (held from forked children), which keeps the
    connection open until it is closed."""
    held = []
    for sock_id in sockets:
        try:
            copy = os.dup(sock_id.fd)
        except OSError:
            continue  # closed by gloo already
        if os.fstat(copy).st_ino != sock_id.inode:
            os.close(copy)  # the number was closed by gloo and belongs to someone else now
            continue
        fork_guard.hold([copy])
        held.append(socket.socket(fileno=copy))
        try:
            held[-1].shutdown(socket.SHUT_RD)
        except OSError as exc:
            log.debug("shutdown of fd %d: %r", sock_id.fd, exc)
    return held


def let_go(held: list[socket.socket]) -> None:
    """Closes the copies ``shut_receiving`` returned: their connections end."""
    fork_guard.release([sock.fileno() for sock in held])
    for sock in held:
        sock.close()


def tcp_states() -> dict[int, str]:
    """Returns {inode: state} of this network namespace's TCP sockets (hex states of the kernel)."""
    states = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as rows:
                next(rows, None)  # the header
                for row in rows:
                    fields = row.split()
                    states[int(fields[9])] = fields[3]
        except FileNotFoundError:
            continue  # no IPv6 in this namespace
    return states
