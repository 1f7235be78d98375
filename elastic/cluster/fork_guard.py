"""Connections that a forked child must not keep alive: the round's group and channel sockets.

When a worker dies, its kernel closes its sockets, and that is how its peers learn of the death
at once (gloo's connections reset, the agreement channel ends). A process forked from the
worker (a ``DataLoader`` worker with ``num_workers > 0``, forked after the group formed) holds
copies of those sockets, and while any copy is open the kernel closes nothing: the peers would
learn of the death only at the lease TTL. So every holder of such a socket registers it here,
and in every forked child the registered descriptors are pointed at ``/dev/null`` (``dup2``)
right after the fork: the child's copies are gone, and a Python socket object in the child that
later closes its number closes only ``/dev/null``. The parent's sockets are untouched.

Owns the process-wide registry and the one ``os.register_at_fork`` hook (installed at the first
registration, not at import). Must not close anything in the parent, and knows no torch.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

__all__ = ["ForkGuard", "guard"]


@dataclass(frozen=True)
class _Held:
    fd: int
    inode: int


def _inode(fd: int) -> int | None:
    try:
        return os.fstat(fd).st_ino
    except OSError:
        return None


class ForkGuard:
    """Descriptors to let go of in every child forked from this process.

    The registry is an immutable tuple swapped under a lock, so a fork from any thread copies a
    consistent one; the child checks each descriptor's inode before replacing it, so a number
    the parent closed and reused meanwhile is left alone.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: tuple[_Held, ...] = ()
        self._hooked = False

    def hold(self, fds: list[int]) -> None:
        """Registers ``fds`` (open descriptors of this process) to be let go of in children."""
        found = [_Held(fd, inode) for fd in fds if (inode := _inode(fd)) is not None]
        with self._lock:
            if not self._hooked:
                os.register_at_fork(after_in_child=self._in_child)
                self._hooked = True
            known = {h.fd for h in found}
            self._held = tuple(h for h in self._held if h.fd not in known) + tuple(found)

    def release(self, fds: list[int]) -> None:
        """Forgets ``fds`` (call before closing them)."""
        gone = set(fds)
        with self._lock:
            self._held = tuple(h for h in self._held if h.fd not in gone)

    @property
    def held(self) -> list[int]:
        """The registered descriptors."""
        return [h.fd for h in self._held]

    def _in_child(self) -> None:
        """Runs in the child right after a fork: replaces every registered descriptor."""
        self._lock = threading.Lock()  # the parent's may have been held by another thread
        held, self._held = self._held, ()
        if not held:
            return
        null = os.open(os.devnull, os.O_RDWR)
        try:
            for entry in held:
                if entry.fd != null and _inode(entry.fd) == entry.inode:
                    os.dup2(null, entry.fd)
        finally:
            os.close(null)


guard = ForkGuard()  # the process's one registry (a fork copies the whole process)
