"""The file in which a worker reports to the launcher that started it: its etcd leases, and
that it committed.

``elastic run`` gives each worker a path of its own (``ELASTIC_LEASE_FILE``) in a directory
only its user can read; the worker appends the id of every lease it is granted, before any key
is bound to it. When the worker dies, its launcher revokes exactly these leases: never a lease
found by matching a host name and pid in etcd (containers can share both). The worker also
appends one ``committed`` line after its first commit: a worker that fails the same way twice
before that line is a bug no restart fixes. A worker appends ``run`` when ``ElasticState.run``
is called (a script that exits 0 without that line never joined the job), and ``setup-error``
when it stopped on a mistake in its setup (``elastic.foundation.errors.SetupError``): no restart fixes it.

Under the node's lease (``elastic run --node-lease``) a worker grants no lease for its first
identity: it appends ``member ID`` instead (the launcher deletes that member's key when the
worker dies), and touches the file every keepalive interval as its heartbeat (the launcher
removes a member whose file went untouched for a lease TTL: the worker is stopped or hung).
"""

from __future__ import annotations

import os

COMMITTED = "committed"
RAN = "run"
SETUP_ERROR = "setup-error"
_MEMBER = "member "


def append_lease(path: str, lease: int) -> None:
    """Appends ``lease`` to the file at ``path`` (one id per line; created 0600)."""
    _append_line(path, str(lease))


def append_committed(path: str) -> None:
    """Records at ``path`` that the worker made its first commit."""
    _append_line(path, COMMITTED)


def append_mark(path: str, mark: str) -> None:
    """Records at ``path`` that the worker reached a point the launcher asks about (``RAN``,
    ``SETUP_ERROR``)."""
    _append_line(path, mark)


def has_mark(path: str, mark: str) -> bool:
    """Whether the worker reporting at ``path`` recorded ``mark``."""
    return mark in _lines(path)


def append_member(path: str, member_id: str) -> None:
    """Records at ``path`` a member registered under the node's lease."""
    _append_line(path, f"{_MEMBER}{member_id}")


def heartbeat(path: str) -> None:
    """Marks the worker reporting at ``path`` alive now (the file's modification time)."""
    try:
        os.utime(path)
    except FileNotFoundError:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))


def last_heartbeat(path: str) -> float | None:
    """When the worker reporting at ``path`` last marked itself alive or reported anything
    (``time.time()`` seconds; None when the file does not exist)."""
    try:
        return os.stat(path).st_mtime
    except FileNotFoundError:
        return None


def read_members(path: str) -> list[str]:
    """The members registered under the node's lease recorded at ``path``, oldest first."""
    return [line[len(_MEMBER):] for line in _lines(path) if line.startswith(_MEMBER)]


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
