"""The file in which a worker reports to the launcher that started it: its etcd leases, and
that it committed.

``elastic run`` gives each worker a path of its own (``ELASTIC_LEASE_FILE``) in a directory
only its user can read; the worker appends the id of every lease it is granted, before any key
is bound to it. When the worker dies, its launcher revokes exactly these leases: never a lease
found by matching a host name and pid in etcd (containers can share both). The worker also
appends one ``committed`` line after its first commit: a worker that fails the same way twice
before that line is a bug no restart fixes.
"""

from __future__ import annotations

import os

COMMITTED = "committed"


def append_lease(path: str, lease: int) -> None:
    """Appends ``lease`` to the file at ``path`` (one id per line; created 0600)."""
    _append_line(path, str(lease))


def append_committed(path: str) -> None:
    """Records at ``path`` that the worker made its first commit."""
    _append_line(path, COMMITTED)


def read_leases(path: str) -> list[int]:
    """The leases recorded at ``path``, oldest first (none when the file does not exist)."""
    return [int(line) for line in _lines(path) if line.isdigit()]


def has_committed(path: str) -> bool:
    """Whether the worker reporting at ``path`` recorded a commit."""
    return COMMITTED in _lines(path)


def _append_line(path: str, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, f"{line}\n".encode())
    finally:
        os.close(fd)


def _lines(path: str) -> list[str]:
    try:
        with open(path, encoding="ascii") as lines:
            return [line.strip() for line in lines]
    except FileNotFoundError:
        return []
