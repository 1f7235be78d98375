"""TCP ports: choosing a free one on an address of this machine (loopback by default), and
asking whether another machine answers on one, or accepts on one."""

from __future__ import annotations

import socket

__all__ = ["accepts", "answers", "free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """Returns a TCP port on ``host`` that was free a moment ago.

    Another process may take it before the caller binds it: callers that can, retry on
    ``EADDRINUSE``.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def answers(host: str, port: int, timeout: float) -> bool:
    """Whether the machine at ``host`` answers a connection to ``port`` within ``timeout``
    seconds: accepted, or refused by its kernel (nothing listens there; the machine is
    reachable all the same). No answer, or no route, is False."""
    return _connect(host, port, timeout) in ("accepted", "refused")


def accepts(host: str, port: int, timeout: float) -> bool:
    """Whether something listening on ``host``:``port`` accepts a connection within
    ``timeout`` seconds (the connection is closed at once)."""
    return _connect(host, port, timeout) == "accepted"


def _connect(host: str, port: int, timeout: float) -> str:
    """Connects and hangs up: "accepted", "refused" (by the kernel), or "silent" (no answer,
    or no route)."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return "accepted"
    except ConnectionRefusedError:
        return "refused"
    except OSError:
        return "silent"
