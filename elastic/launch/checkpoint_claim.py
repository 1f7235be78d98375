"""One job per checkpoint URL: the launcher's heartbeat marker under ``--checkpoint``.

Before a launcher starts workers it reads the markers of other jobs under its checkpoint URL
(``elastic.checkpoint.live_marker``) and refuses, in one line, to start beside a live one; a
launcher of the same job (another node, or the job resuming) may. While it runs it rewrites its
own marker every ``Timeouts.checkpoint_marker`` from a daemon thread, and removes it at the end.
"""

from __future__ import annotations

import logging
import threading

from elastic.foundation.errors import CheckpointUnusableError
from elastic.foundation.timeouts import Timeouts

log = logging.getLogger(__name__)


class CheckpointClaim:
    """This job's marker under its checkpoint URL.

    Args:
        url: the ``--checkpoint`` URL.
        job_id: this job's id.
        timeouts: the marker's interval and the storage's retry time.
    """

    def __init__(self, url: str, job_id: str, timeouts: Timeouts) -> None:
        from elastic.checkpoint import CheckpointError  # noqa: PLC0415 (imports torch)
        from elastic.checkpoint.live_marker import LiveMarker  # noqa: PLC0415
        self._errors = (OSError, CheckpointError)  # what writing or removing it can raise
        self.url = url
        self.marker = LiveMarker(url, job_id, retry_for=timeouts.storage_retry)
        self._every = timeouts.checkpoint_marker
        self._stale = timeouts.checkpoint_stale
        self._join_s = timeouts.shutdown.total_seconds()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self) -> None:
        """Raises if another job's marker under the URL is fresh.

        Raises:
            CheckpointUnusableError: another job runs on this checkpoint URL.
        """
        live = self.marker.others(self._stale)
        if live:
            other = live[0]
            raise CheckpointUnusableError(
                f"--checkpoint {self.url} is in use by job {other.job_id!r}, which is running "
                f"(its marker was written {other.age_s:.0f} s ago): two jobs on one URL resume "
                "from each other's checkpoints. Give this job its own --checkpoint, or add "
                f"workers to that job with --job-id {other.job_id}.")

    def start(self) -> None:
        """Writes the marker now and then every interval until ``stop``."""
        self._touch()
        self._thread = threading.Thread(target=self._beat, name="elastic-checkpoint-marker",
                                        daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self._every.total_seconds()):
            self._touch()

    def _touch(self) -> None:
        try:
            self.marker.touch()
        except self._errors as exc:  # the storage's trouble is the workers' to report
            log.warning("could not write the job's marker under %s: %s", self.url, exc)

    def stop(self) -> None:
        """Stops rewriting the marker and removes it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self._join_s)
        try:
            self.marker.remove()
        except self._errors as exc:
            log.warning("could not remove the job's marker under %s: %s", self.url, exc)
