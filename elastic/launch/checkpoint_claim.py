"""The launcher's hold on its job's checkpoint URL: claimed before any worker starts, renewed
while the job runs here, released when it ends.

Owns the heartbeat thread and the one-line refusal of a second job on a URL that a live job
holds (``elastic.checkpoint.UrlClaim`` owns the record). Staleness and the renewal interval come
from ``Timeouts.checkpoint_claim``.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Iterator
from typing import Any

from elastic.foundation.errors import CheckpointUnusableError
from elastic.foundation.timeouts import Timeouts

log = logging.getLogger(__name__)
_RENEWALS_PER_CLAIM = 3  # a claim outlives two missed renewals


@contextlib.contextmanager
def held_checkpoint(url: str | None, job_id: str, timeouts: Timeouts) -> Iterator[None]:
    """Probes ``url`` (``preflight``) and holds it for ``job_id`` while the block runs; nothing
    when ``url`` is None.

    Raises:
        CheckpointUnusableError: the URL cannot be written, or another job holds it.
    """
    if url is None:
        yield
        return
    from elastic.launch.preflight import check_checkpoint  # noqa: PLC0415 (imports torch)
    check_checkpoint(url, timeouts)
    claim = CheckpointClaim(url, job_id, timeouts)
    claim.acquire()
    try:
        yield
    finally:
        claim.release()


class CheckpointClaim:
    """This launcher's claim on ``url`` for ``job_id``.

    Args:
        url: the job's checkpoint URL.
        job_id: the job.
        timeouts: the job's timeout table (``checkpoint_claim``, ``storage_retry``).
    """

    def __init__(self, url: str, job_id: str, timeouts: Timeouts) -> None:
        self._url = url
        self._job_id = job_id
        self._interval_s = timeouts.checkpoint_claim.total_seconds() / _RENEWALS_PER_CLAIM
        self._timeouts = timeouts
        self._claim: Any = None  # an elastic.checkpoint.UrlClaim once acquired
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> None:
        """Claims the URL and starts renewing the claim.

        Raises:
            CheckpointUnusableError: another job holds the URL (one line naming it), or the
                storage failed.
        """
        from elastic.checkpoint import CheckpointError, UrlClaim  # noqa: PLC0415 (torch)
        from elastic.checkpoint.backend import Storage, resolve_filesystem  # noqa: PLC0415
        try:
            fs, root = resolve_filesystem(self._url, None)
            claim = UrlClaim(Storage(fs, root, self._timeouts.storage_retry), self._job_id,
                             self._timeouts.checkpoint_claim)
            claim.acquire()
        except (CheckpointError, OSError) as exc:
            raise CheckpointUnusableError(f"--checkpoint {self._url}: {exc}") from None
        self._claim = claim
        self._thread = threading.Thread(target=self._renew_until_stopped, daemon=True,
                                        name="checkpoint-claim")
        self._thread.start()

    def release(self) -> None:
        """Stops renewing and removes the claim (a storage failure costs one warning: the
        claim then goes stale on its own)."""
        from elastic.checkpoint import CheckpointError  # noqa: PLC0415
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self._timeouts.storage_retry.total_seconds())
        if self._claim is None:
            return
        try:
            self._claim.release()
        except (CheckpointError, OSError) as exc:
            log.warning("could not release the claim on %s (%r); it goes stale after %s",
                        self._url, exc, self._timeouts.checkpoint_claim)

    def _renew_until_stopped(self) -> None:
        from elastic.checkpoint import CheckpointError  # noqa: PLC0415
        told = False
        while not self._stop.wait(self._interval_s):
            try:
                kept = self._claim.renew()
            except (CheckpointError, OSError) as exc:
                log.warning("could not renew the claim on %s: %r", self._url, exc)
                continue
            if not kept and not told:
                told = True
                print(f"elastic: warning: another job took over checkpoint URL {self._url} "
                      f"(job {self._job_id}'s claim had gone stale); its checkpoints fence "
                      "this job's writes. Stop one of the two jobs.", file=sys.stderr,
                      flush=True)
