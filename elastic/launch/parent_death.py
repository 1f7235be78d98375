"""The launcher's children never outlive it, and what a killed launcher left is cleaned up.

Owns two things. ``die_with_parent``: each worker and the embedded etcd are started with
``PR_SET_PDEATHSIG`` (Linux ``prctl``, set in the child before ``exec``), so that a launcher
ended by SIGKILL, which can clean nothing up, still takes them with it; their leases then
expire within the lease TTL. ``OwnedDirs``: the temporary directories a launcher makes (the
embedded etcd's data, the workers' lease files) hold an ``.owner`` file naming its pid and
start time; the next launcher removes those whose owner is gone. A directory kept on purpose
(an etcd that exited by itself keeps its log) drops the file first. It must not start processes.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)
OWNER = ".owner"
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the child killed (SIGKILL) when this process dies, and that
    kills it at once if this process died before that took hold; None off Linux.

    The signal follows the thread that started the child: call ``Popen`` from a thread that
    lives as long as the launcher (its main thread).
    """
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it
    parent = os.getpid()

    def in_child() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the launcher was gone before the line above
            os.kill(os.getpid(), signal.SIGKILL)

    return in_child


def _start_time(pid: int) -> str | None:
    """Process ``pid``'s start time (clock ticks since boot; None when it does not exist), so
    that a pid reused by another process does not count as the owner."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _is_running(pid: str, started: str = "", *_: str) -> bool:
    """Whether process ``pid`` that started at ``started`` (if known) still runs."""
    now = _start_time(int(pid))
    return now is not None and (not started or now == started)


class OwnedDirs:
    """Marks this process's temporary directories, and removes those of dead launchers."""

    @staticmethod
    def make(prefix: str) -> Path:
        """A fresh private temporary directory (0700) that names this process as its owner."""
        directory = Path(tempfile.mkdtemp(prefix=prefix))
        pid = os.getpid()
        (directory / OWNER).write_text(f"{pid} {_start_time(pid) or ''}\n")
        return directory

    @staticmethod
    def keep(directory: Path) -> None:
        """Keeps ``directory`` after this process ends (it holds something to read)."""
        (directory / OWNER).unlink(missing_ok=True)

    @staticmethod
    def remove_leftovers(*prefixes: str) -> list[Path]:
        """Removes the marked directories whose owner is no longer running.

        Returns:
            The directories removed.
        """
        removed = []
        for prefix in prefixes:
            for directory in Path(tempfile.gettempdir()).glob(f"{prefix}*"):
                try:
                    owner = (directory / OWNER).read_text().split()
                except OSError:
                    continue  # not marked: kept on purpose, or not a launcher's
                if not owner or not owner[0].isdigit() or _is_running(*owner):
                    continue
                shutil.rmtree(directory, ignore_errors=True)
                removed.append(directory)
        return removed
