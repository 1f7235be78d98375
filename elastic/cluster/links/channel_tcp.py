"""The TCP of the agreement channel: listening on the advertised address, letting the kernel end
a connection whose peer went silent, telling a silent end from a reset, and reading a message
whole. No torch, no channel state.
"""

from __future__ import annotations

import errno
import math
import socket
from datetime import timedelta

from elastic.foundation.errors import AdvertiseAddressError

TCP_ESTABLISHED = 1  # tcpi_state, the first byte of the kernel's struct tcp_info


def listen(address: str) -> socket.socket:
    """A listening socket on ``address`` (IPv4 or IPv6) and a free port.

    Raises:
        AdvertiseAddressError: ``address`` is not an address of this machine.
    """
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        return socket.create_server((address, 0), family=family)
    except OSError as exc:
        if exc.errno not in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT) \
                and not isinstance(exc, socket.gaierror):
            raise
        raise AdvertiseAddressError(
            f"cannot listen on the advertised address {address!r} ({exc.strerror or exc}): "
            f"--advertise-addr / ELASTIC_ADVERTISE_ADDR must be an address of this machine that "
            f"the other workers can reach (behind NAT, advertise the interface's own address "
            f"and route to it).") from exc


def end_when_silent(conn: socket.socket, silence: timedelta, probe: timedelta) -> None:
    """Lets the kernel end ``conn`` once the peer acknowledged nothing for ``silence``: probed
    every ``probe`` while idle (keepalive), and bounded by ``TCP_USER_TIMEOUT`` whether idle or
    not, so a link cut without a reset ends like a dead peer's (``peers_gone``, ``watch``)."""
    every_s = math.ceil(probe.total_seconds())  # the kernel counts whole seconds
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, every_s)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, every_s)
    # With TCP_USER_TIMEOUT set, it alone decides when unanswered probes end the connection.
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 127)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT,
                    int(silence.total_seconds() * 1000))


def unanswered(error: int | None) -> bool:
    """Whether a connection's error says that the peer's side never answered (the kernel's
    timeout, an unreachable route), not that the peer's kernel ended it (a reset)."""
    return error not in (None, 0, errno.ECONNRESET, errno.EPIPE)


def link_state(sock: socket.socket) -> tuple[int, int] | None:
    """The connection's TCP state and pending error (read once), or None once it is closed."""
    try:  # the state first: an error that comes between the two reads is still seen
        state = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]
        return state, sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    except OSError:
        return None


def receive_exactly(sock: socket.socket, size: int) -> bytes:
    """Reads ``size`` bytes; fewer means the peer closed the connection (or it was released)."""
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            break
        data += chunk
    return data
