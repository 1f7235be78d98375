"""Choosing a free TCP port on a given address of this machine (loopback by default)."""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """Returns a TCP port on ``host`` that was free a moment ago.

    Another process may take it before the caller binds it: callers that can, retry on
    ``EADDRINUSE``.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
