"""The heartbeat sender, the worker's side: a small child process (``pulse_child``) that beats on
its worker's agreement connections for as long as the worker is not stopped.

Why a process: every thread of the worker stops together under a full garbage collection or a
long native call that holds the GIL (freeing a big structure), so a thread would fall silent
for seconds while the worker is only busy. The child needs no GIL of the worker's: every
``interval`` it reads the worker's state in ``/proc`` and beats unless the worker is stopped
(SIGSTOP, a debugger: ``T``/``t``). So a stopped worker falls silent within one interval and a
busy one never does. A machine that vanished takes its child with it.

The worker hands each round's connections over (``hold``, the descriptors passed on a unix
socket) and takes them back (``drop``) before it closes them; the child ends when that socket
ends, that is as soon as the worker's process ends or execs (its end is close-on-exec), so it
never keeps a dead worker's connection open (the agreement channel's death detector). It beats
with ``MSG_DONTWAIT``: a full buffer skips a beat. No torch, no etcd.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading

from elastic.cluster.links import pulse_child
from elastic.cluster.links.fork_guard import guard as fork_guard

log = logging.getLogger(__name__)



class PulseProcess:
    """The worker's side: starts the child, hands it connections, takes them back.

    Args:
        interval: seconds between two beats (``Timeouts.heartbeat``).
    """

    def __init__(self, interval_s: float) -> None:
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._control: socket.socket | None = None
        self._child: subprocess.Popen[bytes] | None = None

    def start(self) -> bool:
        """Starts the child unless it runs; returns whether it runs (logs once why not)."""
        with self._lock:
            if self._child is not None and self._child.poll() is None:
                return True
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                self._child = subprocess.Popen(  # -I -S: the standard library only, fast
                    [sys.executable, "-I", "-S", pulse_child.__file__, str(os.getpid()),
                     repr(self._interval_s), str(theirs.fileno())], pass_fds=[theirs.fileno()],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
            except OSError as exc:
                ours.close()
                log.warning("the heartbeat process did not start (%s): heartbeats come from a "
                            "thread, which a long garbage collection silences", exc)
                return False
            finally:
                theirs.close()
            self._control = ours
            fork_guard.hold([ours.fileno()])  # a forked child must not keep the child alive
            return True

    @property
    def pid(self) -> int | None:
        """The child's process id, while it runs."""
        child = self._child
        return None if child is None or child.poll() is not None else child.pid

    def hold(self, key: str, socks: list[socket.socket]) -> bool:
        """Hands ``socks`` to the child to beat on, under ``key``; false when it cannot."""
        return self._tell(f"hold:{key}".encode(), [s.fileno() for s in socks])

    def drop(self, key: str) -> None:
        """Takes back the connections held under ``key`` (the child closes its copies)."""
        self._tell(f"drop:{key}".encode(), [])

    def close(self) -> None:
        """Ends the child (it ends by itself when the worker's process ends)."""
        with self._lock:
            control, child, self._control, self._child = self._control, self._child, None, None
        if control is not None:
            fork_guard.release([control.fileno()])
            control.close()
        if child is not None:
            child.wait()

    def _tell(self, message: bytes, fds: list[int]) -> bool:
        with self._lock:
            control = self._control
            if control is None:
                return False
            try:
                socket.send_fds(control, [message], fds)
            except OSError as exc:
                log.warning("the heartbeat process is gone (%s)", exc)
                return False
            return True
