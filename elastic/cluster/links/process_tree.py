"""Ends every process this process started, and their descendants, in bounded time.

For a worker about to replace itself (``restart_in_place``): a DataLoader's workers, a user's
subprocesses and their own children must not outlive it, holding its sockets or its GPU. The
one child spared at first is multiprocessing's resource tracker: ended by a signal it would
leave every shared-memory segment the user registered in ``/dev/shm``; told by the end of its
pipe, it unlinks them and exits. Nothing here waits without a bound: a process that does not
end within the time given is left behind, and named in the log.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import time
from datetime import timedelta
from multiprocessing import resource_tracker
from pathlib import Path

log = logging.getLogger(__name__)

_PASSES = 8  # listings of the tree while stopped processes can still be caught forking


def children(pid: int) -> list[int]:
    """The ids of ``pid``'s children (every thread's), from /proc."""
    pids: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            pids += [int(child) for child in task.read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread, or the process, ended meanwhile
    return pids


def descendants(root: int, spared: frozenset[int] = frozenset()) -> list[int]:
    """The ids of ``root``'s descendants, parents before children, leaving out the processes
    in ``spared`` and their own descendants."""
    found: list[int] = []
    parents = [root]
    while parents:
        below = [pid for parent in parents for pid in children(parent) if pid not in spared]
        found += below
        parents = below
    return found


def _open(pid: int) -> int | None:
    """A pidfd of ``pid`` (None: it is gone already)."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return None


def _stop_tree(spared: frozenset[int]) -> dict[int, int | None]:
    """Stops (SIGSTOP) every descendant but ``spared``, listing the tree again until it holds
    no new process (a stopped process forks no more); returns each one's pidfd."""
    stopped: dict[int, int | None] = {}
    for _ in range(_PASSES):
        fresh = [pid for pid in descendants(os.getpid(), spared) if pid not in stopped]
        if not fresh:
            break
        for pid in fresh:
            stopped[pid] = _open(pid)  # before the signal: the id cannot be reused meanwhile
            _signal(pid, signal.SIGSTOP)
    return stopped


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass  # it ended meanwhile


def await_exits(pidfds: dict[int, int | None], within: timedelta) -> list[int]:
    """Waits up to ``within`` until each process ends, reaps those that are this process's
    children, closes the pidfds; returns the ids of those still running at the deadline."""
    deadline = time.monotonic() + within.total_seconds()
    waiting = {fd: pid for pid, fd in pidfds.items() if fd is not None}
    poller = select.poll()
    for fd in waiting:
        poller.register(fd, select.POLLIN)
    while waiting:
        left_ms = (deadline - time.monotonic()) * 1000
        if left_ms <= 0:
            break
        for fd, _ in poller.poll(left_ms):
            poller.unregister(fd)
            os.close(fd)
            _reap(waiting.pop(fd))
    for fd in waiting:
        os.close(fd)
    return sorted(waiting.values())


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass  # not this process's child: its own parent (or init) reaps it


def _tracker_pid() -> int | None:
    """The resource tracker's id when it is this process's child (None: none runs)."""
    pid = resource_tracker._resource_tracker._pid  # noqa: SLF001 (no public accessor)
    return pid if pid is not None and pid in children(os.getpid()) else None


def _stop_tracker(pid: int, within: timedelta) -> None:
    """Closes this process's end of the tracker's pipe, so that it unlinks what is left
    registered and exits; ends it by SIGKILL when it does not within ``within``."""
    tracker = resource_tracker._resource_tracker  # noqa: SLF001
    fd, tracker._fd, tracker._pid = tracker._fd, None, None  # noqa: SLF001
    pidfd = _open(pid)
    if fd is not None:
        os.close(fd)
    if await_exits({pid: pidfd}, within):
        log.warning("multiprocessing's resource tracker (pid %d) did not exit within %s; "
                    "ending it: shared memory it tracked may be left in /dev/shm", pid, within)
        _signal(pid, signal.SIGKILL)
        await_exits({pid: _open(pid)}, within)


def end_tree(within: timedelta) -> None:
    """Ends every descendant of this process (SIGKILL, after stopping the whole tree so that
    none forks meanwhile), the resource tracker last and by the end of its pipe; each of the
    two waits is bounded by ``within``."""
    tracker = _tracker_pid()
    spared = frozenset() if tracker is None else frozenset({tracker})
    pidfds = _stop_tree(spared)
    for pid in pidfds:
        _signal(pid, signal.SIGKILL)
    left = await_exits(pidfds, within)
    if left:
        log.warning("processes %s of this worker did not end within %s after SIGKILL", left,
                    within)
    if tracker is not None:
        _stop_tracker(tracker, within)
