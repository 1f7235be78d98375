"""The file in which a worker reports its etcd leases to the launcher that started it.

``elastic run`` gives each worker a path of its own (``ELASTIC_LEASE_FILE``) in a directory
only its user can read; the worker appends the id of every lease it is granted, before any key
is bound to it. When the worker dies, its launcher revokes exactly these leases: never a lease
found by matching a host name and pid in etcd (containers can share both).
"""

from __future__ import annotations

import os


def append_lease(path: str, lease: int) -> None:
    """Appends ``lease`` to the file at ``path`` (one id per line; created 0600)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, f"{lease}\n".encode())
    finally:
        os.close(fd)


def read_leases(path: str) -> list[int]:
    """The leases recorded at ``path``, oldest first (none when the file does not exist)."""
    try:
        with open(path, encoding="ascii") as lines:
            return [int(line) for line in lines if line.strip().isdigit()]
    except FileNotFoundError:
        return []
