"""What the launcher says when one of its workers dies: one ``elastic:`` line per death.

Owns the wording only. The line names the worker as a person finds it (its local rank, host and
pid, as in ``worker local_rank=1 (host-a:pid 812) died (SIGKILL)``); the world change, the time
and the steps rolled back follow in rank 0's ``re-formed after a failure`` line. What the launcher
did in etcd for the dead worker (its lease revoked, its member key removed) is bookkeeping: it
goes to the launcher's log at INFO (``ELASTIC_LOG_LEVEL=INFO``), and onto the line itself with
``ELASTIC_DEBUG=1``.
"""

from __future__ import annotations

import logging
import signal

from elastic.foundation.settings import is_debug

log = logging.getLogger(__name__)


def cause(returncode: int) -> str:
    """``SIGKILL``, ``signal 42`` or ``exit code 3``: how a worker process ended."""
    if returncode < 0:
        try:
            return signal.Signals(-returncode).name
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


def named(local_rank: int, host: str, pid: int) -> str:
    """``worker local_rank=1 (host-a:pid 812)``: a worker as the launcher's lines name it."""
    return f"worker local_rank={local_rank} ({host}:pid {pid})"


def died(local_rank: int, host: str, pid: int, returncode: int) -> str:
    """``worker local_rank=1 (host-a:pid 812) died (SIGKILL)``, or ``... failed (exit code 1)``
    when the process exited with an error status of its own."""
    verb = "died" if returncode < 0 else "failed"
    return f"{named(local_rank, host, pid)} {verb} ({cause(returncode)})"


def with_detail(line: str, detail: str) -> str:
    """The death ``line`` for the console; ``detail`` (what the launcher did in etcd) is logged
    at INFO, and kept on the line with ``ELASTIC_DEBUG=1``."""
    log.info("%s; %s", line, detail)
    return f"{line}; {detail}" if is_debug() else line
