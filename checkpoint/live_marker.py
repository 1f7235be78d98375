"""Which jobs are writing under a checkpoint URL now: one heartbeat marker file per job.

A running job's launcher keeps ``{url}/.elastic-live-{job_id}`` fresh (its job id and the wall
time it last wrote it); a job about to start on the URL reads the others' markers and refuses
to start beside a live one, since two jobs on one URL resume from each other's checkpoints and
fence each other's writes. A marker older than its staleness bound is a job that ended without
removing it. Never touches a checkpoint; knows nothing of etcd or processes.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from elastic.checkpoint.backend import DEFAULT_RETRY_FOR, Storage, resolve_filesystem
from elastic.checkpoint.errors import CheckpointError

PREFIX = ".elastic-live-"


@dataclass(frozen=True)
class LiveJob:
    """Another job's fresh marker: its job id and how long ago it was written."""

    job_id: str
    age_s: float


class LiveMarker:
    """The marker of job ``job_id`` under checkpoint ``url``.

    Args:
        url: the checkpoint URL (a local path or any fsspec URL).
        job_id: this job's id (letters, digits, ``.``, ``_``, ``-``: fit for a file name).
        storage_options: keyword arguments for the filesystem.
        retry_for: how long transient storage errors are retried.
    """

    def __init__(self, url: str, job_id: str, storage_options: dict[str, Any] | None = None,
                 retry_for: timedelta = DEFAULT_RETRY_FOR) -> None:
        fs, root = resolve_filesystem(url, storage_options)
        self.storage = Storage(fs, root, retry_for)
        self.job_id = job_id
        self.path = self.storage.join(PREFIX + job_id)

    def others(self, stale: timedelta, now: float | None = None) -> list[LiveJob]:
        """The other jobs whose marker was written within ``stale`` (a torn or foreign file
        counts as no job)."""
        now = time.time() if now is None else now
        found = []
        for rel in self.storage.entries():
            if "/" in rel or not rel.startswith(PREFIX) or rel == PREFIX + self.job_id:
                continue
            try:
                record = json.loads(self.storage.read_bytes(self.storage.join(rel)))
                job, written = str(record["job_id"]), float(record["t"])
            except (OSError, CheckpointError, ValueError, KeyError, TypeError):
                continue  # gone since the listing, torn, or not ours
            if now - written < stale.total_seconds():
                found.append(LiveJob(job, max(0.0, now - written)))
        return found

    def touch(self, now: float | None = None) -> None:
        """Writes the marker with the time now."""
        record = {"job_id": self.job_id, "t": time.time() if now is None else now}
        self.storage.write_bytes(self.path, json.dumps(record).encode())

    def remove(self) -> None:
        """Removes the marker (gone already is fine)."""
        try:
            self.storage.remove(self.path)
        except FileNotFoundError:
            pass
