"""Checks ``elastic run`` makes before it starts a worker: what no restart could fix.

Owns the launcher's side of a wrong ``--checkpoint`` (a scheme with no backend installed, no
credentials, a location that cannot be written): one line naming cause and fix, and no worker
started, instead of every worker failing (or warning at every epoch) the same way.
"""

from __future__ import annotations

from elastic.foundation.errors import CheckpointUnusableError
from elastic.foundation.timeouts import Timeouts

__all__ = ["CheckpointUnusableError", "check_checkpoint"]


def check_checkpoint(url: str, timeouts: Timeouts) -> None:
    """Writes and removes a probe file under ``url``, as the workers' rank 0 would.

    Raises:
        CheckpointUnusableError: no backend for the scheme, no credentials, or not writable.
    """
    from elastic.checkpoint import CheckpointError, check_writable  # noqa: PLC0415 (torch)
    try:
        check_writable(url, retry_for=timeouts.storage_retry)
    except CheckpointError as exc:
        raise CheckpointUnusableError(f"--checkpoint {url}: {exc}") from exc
