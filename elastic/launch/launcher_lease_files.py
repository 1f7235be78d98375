"""The launcher's side of the lease files: one private directory, one file per started worker.

See ``elastic.cluster.worker_lease_file`` for why: the launcher revokes only leases that a worker it
started reported, by lease id.
"""

from __future__ import annotations

import itertools
import shutil
import time
from pathlib import Path

from elastic.launch.parent_death import OwnedDirs
from elastic.cluster.worker_lease_file import (has_committed, has_mark, last_heartbeat, read_leases,
                                        read_members)


LEASES_PREFIX = "elastic-leases-"


class LeaseFiles:
    """Hands out lease file paths and reads them back by worker pid; ``close`` removes them."""

    def __init__(self) -> None:
        self._dir: Path | None = None
        self._paths: dict[int, str] = {}
        self._dropped: set[str] = set()  # node-lease members removed already
        self._numbers = itertools.count()

    def new_path(self, local_rank: int) -> str:
        """A fresh path for the next worker (the directory is made 0700 on first use)."""
        if self._dir is None:
            self._dir = OwnedDirs.make(LEASES_PREFIX)
        return str(self._dir / f"worker-{local_rank}-{next(self._numbers)}")

    def assign(self, pid: int, path: str) -> None:
        self._paths[pid] = path

    def read(self, pid: int) -> list[int]:
        """The leases worker ``pid`` reported (empty: none, or not a worker of ours)."""
        path = self._paths.get(pid)
        return read_leases(path) if path else []

    def node_members(self, pid: int) -> list[str]:
        """The members worker ``pid`` registered under the node's lease."""
        path = self._paths.get(pid)
        return read_members(path) if path else []

    def silent_s(self, pid: int) -> float | None:
        """Seconds since worker ``pid`` last sent a heartbeat; None when it has no member under
        the node's lease that was not removed already (``mark_dropped``). A worker restarted in
        place (the same pid) reports its new member in the same file."""
        path = self._paths.get(pid)
        if path is None or set(read_members(path)) <= self._dropped:
            return None
        beat = last_heartbeat(path)
        return None if beat is None else time.time() - beat

    def mark_dropped(self, pid: int) -> None:
        """Records that worker ``pid``'s node-lease members so far were removed."""
        self._dropped.update(self.node_members(pid))

    def has_committed(self, pid: int) -> bool:
        """Whether worker ``pid`` reported a commit."""
        path = self._paths.get(pid)
        return has_committed(path) if path else False

    def has_mark(self, pid: int, mark: str) -> bool:
        """Whether worker ``pid`` recorded ``mark`` (``elastic.cluster.worker_lease_file``)."""
        path = self._paths.get(pid)
        return has_mark(path, mark) if path else False

    def forget(self, pid: int) -> None:
        self._dropped.difference_update(self.node_members(pid))
        path = self._paths.pop(pid, None)
        if path:
            Path(path).unlink(missing_ok=True)

    def close(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        self._paths.clear()
