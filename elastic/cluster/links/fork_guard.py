"""Connections that no child may keep alive: the round's group and channel sockets.

When a worker dies, its kernel closes its sockets, and that is how its peers learn of the death
at once (gloo's connections reset, the agreement channel ends). A process forked from the
worker (a ``DataLoader`` worker with ``num_workers > 0``, forked after the group formed) holds
copies of those sockets, and while any copy is open the kernel closes nothing: the peers would
learn of the death only at the lease TTL. So every holder of such a socket registers it here.
A registered descriptor is made close-on-exec (gloo's sockets are not), so that a child that
runs another program (``os.system``, ``subprocess``, ``posix_spawn``: no fork hook runs for
those) drops it at its ``exec``; and in every forked child the registered descriptors are pointed at ``/dev/null`` (``dup2``)
right after the fork: the child's copies are gone, and a Python socket object in the child that
later closes its number closes only ``/dev/null``. The parent's sockets are untouched.

A destroyed process group can outlive its destruction as cyclic garbage (the last round's
``DistributedDataParallel`` holds it, and only the collector frees a DDP). Inherited by a forked
child, it would be freed by the child's own collector, and gloo's destructor there waits forever
on a condition copied from the parent's threads: the child hangs, and with it a parent waiting
for its batch. So after a group is destroyed (``collect_before_next_fork``), the next fork first
runs a full collection in the parent, where the destructor works.

Owns the process-wide registry and the ``os.register_at_fork`` hooks (installed at the first
registration, not at import). Must not close anything in the parent, and knows no torch.
"""

from __future__ import annotations

import gc
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
        self._collect = False  # a full collection is due before the next fork

    def _hook(self) -> None:
        """Installs the fork hooks once (call with the lock held)."""
        if not self._hooked:
            os.register_at_fork(before=self._before_fork, after_in_child=self._in_child)
            self._hooked = True

    def hold(self, fds: list[int]) -> None:
        """Registers ``fds`` (open descriptors of this process) to be let go of in children,
        and makes each close-on-exec."""
        found = [_Held(fd, inode) for fd in fds if (inode := _inode(fd)) is not None]
        for entry in found:
            os.set_inheritable(entry.fd, False)
        with self._lock:
            self._hook()
            known = {h.fd for h in found}
            self._held = tuple(h for h in self._held if h.fd not in known) + tuple(found)

    def release(self, fds: list[int]) -> None:
        """Forgets ``fds`` (call before closing them)."""
        gone = set(fds)
        with self._lock:
            self._held = tuple(h for h in self._held if h.fd not in gone)

    def collect_before_next_fork(self) -> None:
        """Asks for a full garbage collection in this process before its next fork (call once
        a process group was destroyed: what still holds it is freed here, not in a child)."""
        with self._lock:
            self._hook()
            self._collect = True

    def _before_fork(self) -> None:
        """Runs in the parent right before a fork: the collection asked for, if any."""
        with self._lock:
            due, self._collect = self._collect, False
        if due:
            gc.collect()

    @property
    def held(self) -> list[int]:
        """The registered descriptors."""
        return [h.fd for h in self._held]

    def _in_child(self) -> None:
        """Runs in the child right after a fork: replaces every registered descriptor."""
        self._lock = threading.Lock()  # the parent's may have been held by another thread
        self._collect = False
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
