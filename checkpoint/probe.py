"""Checking a checkpoint location before anything trains: can this process write there?

A wrong ``--checkpoint`` (no backend for its scheme, no credentials, a location nobody can
write) never fixes itself, so the launcher asks once, up front, and stops with the reason
instead of starting workers that each fail, or warn at every epoch. Writes one empty probe file
under the root and removes it; never touches a checkpoint.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

from elastic.checkpoint.backend import DEFAULT_RETRY_FOR, Storage, resolve_filesystem
from elastic.checkpoint.errors import CheckpointLocationError


def check_writable(url: str, storage_options: dict[str, Any] | None = None,
                   retry_for: timedelta = DEFAULT_RETRY_FOR) -> None:
    """Writes and removes an empty probe file under ``url``.

    Args:
        url: the checkpoint URL (a local path or any fsspec URL).
        storage_options: keyword arguments for the filesystem.
        retry_for: how long transient storage errors are retried.

    Raises:
        CheckpointBackendError: the scheme is unknown or its fsspec package is missing.
        CheckpointCredentialsError: the object store found no credentials.
        CheckpointLocationError: the location cannot be written.
    """
    fs, root = resolve_filesystem(url, storage_options)
    storage = Storage(fs, root, retry_for)
    probe = storage.join(f".elastic-probe-{uuid.uuid4().hex[:8]}")
    try:
        storage.write_bytes(probe, b"")
        storage.remove(probe)
    except OSError as exc:  # permissions, a file in the way, a missing bucket, a full disk
        raise CheckpointLocationError(
            f"Checkpoint location {url!r} is not writable ({type(exc).__name__}: {exc}). "
            "Choose a --checkpoint this user can create files in, or fix its permissions."
        ) from exc
