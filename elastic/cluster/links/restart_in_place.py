"""Replaces this worker process with a fresh run of the same command.

For a worker whose training thread cannot be woken (``release_watchdog``): the process keeps
its id, its command line, its environment and its standard streams, so a launcher watching it
(``elastic run``) goes on watching the new run, which registers as a new member and receives
the newest state like any joiner. Before the exec, the children this process started (a
DataLoader's workers) are ended and every descriptor but the standard streams is made
close-on-exec: gloo's sockets are not, and a connection kept open by the new run would hide
this worker's departure from its peers.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path
from typing import NoReturn


def _children() -> list[int]:
    """The ids of this process's children (every thread's), from /proc."""
    pids: list[int] = []
    for task in Path(f"/proc/{os.getpid()}/task").glob("*/children"):
        try:
            pids += [int(pid) for pid in task.read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended meanwhile
    return pids


def end_children() -> None:
    """Ends (SIGKILL) and reaps the processes this process started."""
    for pid in _children():
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            continue  # it ended, or was reaped, meanwhile


def close_on_exec() -> None:
    """Marks every descriptor above stderr close-on-exec (Python's own are already; gloo's
    sockets are not). Nothing is closed before the exec: threads still using them are left
    undisturbed until the process image goes."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd <= 2:
            continue
        try:
            if os.get_inheritable(fd):
                os.set_inheritable(fd, False)
        except OSError:
            continue  # closed meanwhile (the listing's own descriptor among them)


def restart_in_place() -> NoReturn:
    """Execs ``sys.orig_argv`` with ``sys.executable`` (never returns)."""
    end_children()
    logging.shutdown()  # flushes every handler
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    close_on_exec()
    os.execv(sys.executable, sys.orig_argv)
