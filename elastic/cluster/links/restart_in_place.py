"""Replaces this worker process with a fresh run of the same command.

For a worker whose training thread cannot be woken (``release_watchdog``): the process keeps
its id, its command line, its standard streams and the environment it was started with (less
the round's variables, ``ROUND_VARIABLES``, which the run loop sets at every formation), so a
launcher watching it (``elastic run``) goes on watching the new run, which registers as a new
member and receives the newest state like any joiner. Before the exec, every process this one
started is ended (``process_tree``) and every descriptor but the standard streams is made
close-on-exec: gloo's sockets are not, and a connection kept open by the new run would hide
this worker's departure from its peers.
"""

from __future__ import annotations

import logging
import os
import sys
from datetime import timedelta
from typing import TYPE_CHECKING, NoReturn

from elastic.cluster.links.process_tree import end_tree

if TYPE_CHECKING:
    from elastic.cluster.rounds.topology import Topology

#: What the run loop sets for a plain DDP script at every formation (``round_environment``).
ROUND_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def round_environment(topology: "Topology") -> dict[str, str]:
    """The round's variables (``ROUND_VARIABLES``) for ``topology``."""
    return dict(zip(ROUND_VARIABLES, (str(topology.rank), str(topology.world_size),
                                      topology.master_addr, str(topology.master_port))))


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


def restart_in_place(end_within: timedelta) -> NoReturn:
    """Execs ``sys.orig_argv`` with ``sys.executable`` (never returns), once every process
    this one started ended (each of the two waits bounded by ``end_within``: ``end_tree``)."""
    end_tree(end_within)
    logging.shutdown()  # flushes every handler
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    close_on_exec()
    environment = {k: v for k, v in os.environ.items() if k not in ROUND_VARIABLES}
    os.execve(sys.executable, sys.orig_argv, environment)
